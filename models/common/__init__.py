"""Building blocks shared by families: the Llama-style decoder (`llama_decoder`, configured by
`llama_config.LlamaDecoderConfig` from Qwen2, Llama and InternLM2 configs), InternLM2 checkpoints for it
(`internlm2_weights`), and one package per lineage of families (`qwen_vl/`: what the Qwen-VL families
share). Families share code only through here: a family folder never imports another's
(tests/structure/test_family_folders.py)."""
