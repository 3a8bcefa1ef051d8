"""Building blocks shared by families: the Llama-style decoder (`llama_decoder`, configured by
`llama_config.LlamaDecoderConfig` from Qwen2, Llama and InternLM2 configs)."""
