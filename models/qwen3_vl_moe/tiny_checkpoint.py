"""Tiny Qwen3-VL-MoE checkpoints with random weights, for tests and benchmarks without a model hub.

`make_tiny_qwen3_vl_moe_checkpoint` is the Qwen3-VL architecture's writer, as Qwen3-VL's
(models/common/qwen_vl/qwen3_tiny_checkpoint.py: the same tokenizer, templates, vision tower, config
layouts and options), on transformers' own `Qwen3VLMoeForConditionalGeneration`, with experts in the
text config. Reached as
`vlm_sdk.testing.make_tiny_checkpoint(path, family="qwen3_vl_moe", ...)`.

The tiny shape: 12 experts of width 32, 3 per token, in layers 0 and 2; layer 1 is in `mlp_only_layers`
(a dense MLP of 128). Greedy tokens on these random weights vary (8 experts, 2 per token, gave one
token over and over on the shared image prompt). 2I = 64 and I = 32 both differ from hidden 48, so the fused tensors' two
orientations cannot be mistaken for each other.

`experts` chooses how the expert tensors are stored (models/common/fused_experts.py):
    "fused"       transformers 5's save_pretrained: experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]
    "transposed"  the published BF16 repos': [E, H, 2I] and [E, I, H]
    "per_expert"  experts.e.gate_proj / up_proj / down_proj.weight, one tensor each (Qwen3-MoE's, the FP8 repos')
The same seed gives the same weights in every layout. `config_layout="flat"` writes the published
config.json (as Qwen3-VL's, plus `num_experts` as the published files spell it and the vision
model_type "qwen3_vl_moe").
"""
from __future__ import annotations

import json
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from vlm_sdk.models.common.tiny_checkpoint import write_json
from vlm_sdk.models.common.qwen_vl.qwen3_tiny_checkpoint import BENCH_SHAPE, write_qwen3_vl_checkpoint
from vlm_sdk.models.common.qwen_vl.qwen3_tiny_checkpoint import DEFAULTS as QWEN3_VL_DEFAULTS

EXPERT_LAYOUTS = ("fused", "transposed", "per_expert")

_DEFAULTS: Mapping[str, Any] = MappingProxyType(dict(
    **QWEN3_VL_DEFAULTS,
    num_experts=12,
    num_experts_per_tok=3,
    moe_intermediate_size=32,
    decoder_sparse_step=1,
    mlp_only_layers=(1,),
    norm_topk_prob=True,
    experts="fused",
))
_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step",
               "mlp_only_layers", "norm_topk_prob")


def make_tiny_qwen3_vl_moe_checkpoint(path, seed: int = 0, **overrides) -> Path:
    """Write a complete HF-format Qwen3-VL-MoE checkpoint with random weights to `path` and return it.
    Accepted overrides: Qwen3-VL's (models/common/qwen_vl/qwen3_tiny_checkpoint.py `DEFAULTS`) and the expert fields above."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration
    opts = {**_DEFAULTS, **overrides}
    if opts["experts"] not in EXPERT_LAYOUTS:
        raise ValueError(f"experts={opts['experts']!r}; use one of {EXPERT_LAYOUTS}")
    text = {k: list(v) if k == "mlp_only_layers" else v for k, v in opts.items() if k in _MOE_FIELDS}
    out = write_qwen3_vl_checkpoint(path, seed, _DEFAULTS, {k: v for k, v in overrides.items() if k != "experts"},
                                    Qwen3VLMoeForConditionalGeneration, Qwen3VLMoeConfig, text)
    if opts["config_layout"] == "flat":
        write_json(out / "config.json", _published_moe_config(json.loads((out / "config.json").read_text())))
    if opts["experts"] != "fused":
        _rewrite_experts(out, opts["experts"])
    return out


def make_bench_qwen3_vl_moe_checkpoint(path, seed: int = 0, **overrides) -> Path:
    """The benchmark shape: Qwen3-VL-MoE architecture at Qwen3-VL's benchmark size (hidden 512, 8
    layers, vocab 151936, bfloat16), every layer sparse: 16 experts of width 256, 4 per token (the
    active share of 30B-A3B's 8 of 128 is smaller; more experts per token here keeps the sparse path
    busy at this size). About 130M parameters, 50M of them experts."""
    experts = dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256, mlp_only_layers=())
    return make_tiny_qwen3_vl_moe_checkpoint(path, seed, **{**BENCH_SHAPE, **experts, **overrides})


def _published_moe_config(flat: dict) -> dict:
    """Qwen3-VL's published config.json (already flat) with the MoE fields as the published
    Qwen3-VL-30B-A3B spells them: `num_experts` (transformers 5 writes `num_local_experts`)."""
    text = dict(flat["text_config"])
    if "num_local_experts" in text:
        text["num_experts"] = text.pop("num_local_experts")
    vision = {**flat["vision_config"], "model_type": "qwen3_vl_moe"}
    return {**flat, "text_config": dict(sorted(text.items())), "vision_config": vision}


def _rewrite_experts(out: Path, layout: str) -> None:
    """Rewrite every safetensors file of `out` with its fused expert tensors in `layout`."""
    from safetensors.torch import load_file, save_file

    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    for file in sorted(out.glob("*.safetensors")):
        tensors = {}
        for name, t in load_file(file).items():
            if not name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
                tensors[name] = t
            elif layout == "transposed":
                tensors[name] = t.transpose(1, 2).contiguous()
            else:
                prefix, kind = name.rsplit(".", 1)
                parts = t.chunk(2, dim=1) if kind == "gate_up_proj" else (t,)
                names = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
                for part, what in zip(parts, names):
                    for e in range(t.shape[0]):
                        tensors[f"{prefix}.{e}.{what}.weight"] = part[e].contiguous()
        save_file(tensors, file, metadata={"format": "pt"})
        if index is not None:
            weight_map = {k: v for k, v in index["weight_map"].items() if v != file.name}
            index["weight_map"] = dict(sorted({**weight_map, **{k: file.name for k in tensors}}.items()))
    if index is not None:
        write_json(index_path, index)
