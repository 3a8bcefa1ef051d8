"""EAGLE-3 draft checkpoints for tests and benchmarks, written in the published layout (config.json +
model.safetensors: models/common/eagle3_config.py, eagle3_draft.py) from a target checkpoint.

No trained draft exists here, so `write_eagle3_draft` builds one that AGREES with the target where it can:
the target's last layer's MLP and post-attention norm, its final norm and its LM head, wired so that a row
reading token t + 1 computes (about) what the target's last layer computes from that token's embedding:

    input_layernorm 1, v_proj = [I | 0], o_proj = I   the attention passes the normed embedding through
    q_proj = k_proj = 0 with a large constant bias    every query attends (almost) only to its own row
    hidden_norm = `hidden_weight` (0: the aux states are ignored), norm_before_residual, fc random

The draft is then exact for a target whose layers mix nothing between tokens and whose embedding rows have
unit RMS (`make_token_local`: the bench's target, acceptance near 1), and only close for an ordinary target
(the tests': drafts both accepted and rejected). `draft_vocab_size` below the vocabulary keeps the first
ids, mapped back to the target's by d2t (vLLM's draft_id + d2t[draft_id]).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from vlm_sdk.model_loader import iter_safetensors, read_checkpoint, text_config

ATTEND_SELF = 16.0  # the q/k bias: a score gap of ~0.2 * bias^2 between a row and any other


def _lm_prefix(names, num_layers: int) -> str:
    pattern = re.compile(rf"^(?!.*visual)(.*)layers\.{num_layers - 1}\.mlp\.gate_proj\.weight$")
    for n in names:
        m = pattern.match(n)
        if m:
            return m.group(1)
    raise ValueError(f"no decoder layer {num_layers - 1} in the checkpoint's tensors")


def write_eagle3_draft(target_dir: str | Path, out: str | Path, *, aux_layer_ids=None, draft_vocab_size=None,
                       hidden_weight: float = 0.0, seed: int = 0) -> Path:
    """A draft of the target in `target_dir`, saved to `out` (see the module docstring). `aux_layer_ids`:
    written into config.json (None: left out, vLLM's default applies)."""
    info = read_checkpoint(target_dir)
    tc = text_config(info.hf_config)
    w = dict(iter_safetensors(target_dir, show_progress=False))
    layers, h = tc.num_hidden_layers, tc.hidden_size
    d = getattr(tc, "head_dim", None) or h // tc.num_attention_heads
    heads = h // d
    p = _lm_prefix(w, layers)
    last = f"{p}layers.{layers - 1}."
    vocab = tc.vocab_size
    dv = draft_vocab_size or vocab
    head = w.get("lm_head.weight", w[f"{p}embed_tokens.weight"])
    g = torch.Generator().manual_seed(seed)
    dtype = head.dtype
    eye = torch.eye(h, dtype=dtype)
    bias = torch.full((heads * d,), ATTEND_SELF, dtype=dtype)
    tensors = {
        "fc.weight": torch.randn(h, 3 * h, generator=g, dtype=dtype) * 0.1,
        "midlayer.input_layernorm.weight": torch.ones(h, dtype=dtype),
        "midlayer.hidden_norm.weight": torch.full((h,), hidden_weight, dtype=dtype),
        "midlayer.self_attn.q_proj.weight": torch.zeros(heads * d, 2 * h, dtype=dtype),
        "midlayer.self_attn.q_proj.bias": bias,
        "midlayer.self_attn.k_proj.weight": torch.zeros(heads * d, 2 * h, dtype=dtype),
        "midlayer.self_attn.k_proj.bias": bias.clone(),
        "midlayer.self_attn.v_proj.weight": torch.cat([eye, torch.zeros(h, h, dtype=dtype)], dim=1),
        "midlayer.self_attn.v_proj.bias": torch.zeros(h, dtype=dtype),
        "midlayer.self_attn.o_proj.weight": eye.clone(),
        "midlayer.self_attn.o_proj.bias": torch.zeros(h, dtype=dtype),
        "midlayer.post_attention_layernorm.weight": w[f"{last}post_attention_layernorm.weight"],
        "midlayer.mlp.gate_proj.weight": w[f"{last}mlp.gate_proj.weight"],
        "midlayer.mlp.up_proj.weight": w[f"{last}mlp.up_proj.weight"],
        "midlayer.mlp.down_proj.weight": w[f"{last}mlp.down_proj.weight"],
        "norm.weight": w[f"{p}norm.weight"],
        "lm_head.weight": head[:dv].contiguous(),
        # every draft id keeps its own target id (the first dv ids): offsets 0; t2d as SpecForge ships it
        "d2t": torch.zeros(dv, dtype=torch.int64),
        "t2d": torch.arange(vocab) < dv,
    }
    rope = getattr(tc, "rope_parameters", None) or getattr(tc, "rope_scaling", None) or {}
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
              "hidden_size": h, "num_attention_heads": heads, "num_key_value_heads": heads, "head_dim": d,
              "intermediate_size": tc.intermediate_size, "rms_norm_eps": tc.rms_norm_eps, "hidden_act": "silu",
              "rope_theta": rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0)), "attention_bias": True,
              "rope_scaling": {"rope_type": "default", "mrope_section": list(rope["mrope_section"]),
                               "mrope_interleaved": bool(rope.get("mrope_interleaved", False))}
              if rope.get("mrope_section") else None,
              "vocab_size": vocab, "draft_vocab_size": dv, "target_hidden_size": h, "norm_before_residual": True,
              "tie_word_embeddings": False, "torch_dtype": str(dtype).removeprefix("torch.")}
    if aux_layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids), "use_aux_hidden_state": True}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


def make_token_local(target_dir: str | Path, attention_scale: float = 0.0, keep_vocab: int | None = None) -> None:
    """Rewrite the target's decoder (in place) so that it mixes nothing between tokens and only its last
    layer's MLP acts: every o_proj scaled by `attention_scale` (0: zeroed), every earlier down_proj zeroed,
    embedding rows scaled to unit RMS. Its speed is unchanged (the same shapes run); with 0 its next token
    is a function of the current one, which `write_eagle3_draft`'s draft computes exactly (the bench's
    agreeing pair); a little attention left makes the draft right often, not always (the tests'). `keep_vocab`:
    the LM head's rows (a tied head's embedding rows) past it zeroed, so the target's greedy tokens stay in
    the first ids, where a draft with that draft_vocab_size looks (the published drafts keep 32,000)."""
    info = read_checkpoint(target_dir)
    layers = text_config(info.hf_config).num_hidden_layers
    files = sorted(Path(target_dir).glob("*.safetensors"))
    from safetensors.torch import load_file
    for f in files:
        w = load_file(str(f))
        for name, t in w.items():
            if "visual" in name:
                continue
            if name.endswith("self_attn.o_proj.weight") or name.endswith("self_attn.o_proj.bias"):
                w[name] = t * attention_scale
            elif name.endswith("mlp.down_proj.weight") and f"layers.{layers - 1}." not in name:
                w[name] = torch.zeros_like(t)
            elif name.endswith("embed_tokens.weight"):
                w[name] = (t.float() / t.float().pow(2).mean(-1, keepdim=True).sqrt()).to(t.dtype)
            if keep_vocab is not None and (name == "lm_head.weight" or (
                    name.endswith("embed_tokens.weight") and "lm_head.weight" not in w)):
                w[name] = w[name].clone()
                w[name][keep_vocab:] = 0
        save_file(w, str(f), metadata={"format": "pt"})
