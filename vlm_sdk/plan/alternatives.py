"""What would fit when a GPU plan has problems: the same config planned again by `plan()` itself, with
more tensor-parallel ranks (`--tp`), an FP8 KV cache (`--kv-cache-dtype fp8`), whole MoE experts per rank
(`--enable-expert-parallel`, where slicing the experts does not split), or as a quantized checkpoint of
the same shape (block-wise FP8, AWQ int4: the formats the engine loads), each with the fewest ranks that
leave no problem. Every figure is a plan's own (weights per rank, KV capacity), never an estimate of one.

The rank count to try first is where the weights alone would fit (their bytes over the budget after
the activation peak and the encoder cache); sizes that do not split the model are skipped (the
executor's own rule), so a search costs two or three plans per variant.
"""
from __future__ import annotations

import dataclasses
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlm_sdk.errors import VLMError

# the quantized formats a checkpoint of the same shape may come in (vlm_sdk/layers/quantization/config.py)
QUANTIZED = {
    "block-wise FP8": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [128, 128]},
    "AWQ int4": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
}


@dataclass(frozen=True)
class Alternative:
    settings: dict[str, Any]  # plan options that fit (tp, kv_cache_dtype, enable_expert_parallel)
    checkpoint: str  # "" (this one) or the quantized format the checkpoint would have to be
    weights_bytes: int  # per rank
    capacity_tokens: int

    @property
    def flags(self) -> str:
        parts = []
        for k, v in self.settings.items():
            parts.append(f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')} {v}")
        return " ".join(parts)

    def text(self) -> str:
        what = f"a {self.checkpoint} checkpoint of this model with {self.flags}" if self.checkpoint else self.flags
        return (f"{what}: {self.weights_bytes / 2**30:.2f} GiB of weights per rank, KV capacity "
                f"{self.capacity_tokens:,} tokens")

    def to_dict(self) -> dict:
        return {"settings": dict(self.settings), "checkpoint": self.checkpoint, "weights_bytes": self.weights_bytes,
                "capacity_tokens": self.capacity_tokens, "flags": self.flags}


def alternatives(config_path, options: dict, base) -> list[Alternative]:
    """For a plan `base` of `config_path` with `options` that has problems on a GPU: each variant's
    fitting settings (at most one per variant, the fewest ranks). Empty on the CPU (ranks there share one
    host's memory) and when nothing fits."""
    from vlm_sdk.executor.launch import tensor_parallel_sizes
    from vlm_sdk.model_loader import read_config
    from vlm_sdk.models import registry
    from vlm_sdk.plan.planner import plan
    if not base.problems or base.device_memory_bytes is None:
        return []
    info = read_config(config_path)
    family = registry.resolve([info.architecture])
    tp0 = options.get("tp") or 1
    shard, ep = options.get("shard_vision"), bool(options.get("enable_expert_parallel"))
    room = base.device_memory_bytes * base.memory_utilization - base.activation_peak_bytes - base.encoder_cache_bytes

    def fewest_ranks(path, changes: dict, expert_parallel: bool, at_tp0=None) -> Alternative | None:
        """The first size that leaves no problem, from where this variant's weights alone would fit."""
        extra = {"enable_expert_parallel": True} if expert_parallel and not ep else {}
        try:
            here = at_tp0 or plan(path, **{**options, **changes, **extra})
        except VLMError:  # a format (or split) this model cannot take
            return None
        if not here.problems:
            return Alternative({**changes, **extra}, "", here.weights_bytes, here.capacity_tokens)
        first = max(tp0 + 1, int(here.weights_bytes * tp0 // room) + 1) if room > 0 else tp0 + 1
        for n in tensor_parallel_sizes(family, info.hf_config, shard is not False, expert_parallel=expert_parallel):
            if n < first:
                continue
            try:
                p = plan(path, **{**options, **changes, **extra, "tp": n})
            except VLMError:
                continue
            if not p.problems:
                return Alternative({**changes, "tp": n, **extra}, "", p.weights_bytes, p.capacity_tokens)
        return None

    def with_or_without_experts(path, changes: dict, at_tp0=None) -> Alternative | None:
        alt = fewest_ranks(path, changes, False, at_tp0)
        if alt is None and not ep and _is_moe(info.hf_config):  # whole experts may split where slices do not
            alt = fewest_ranks(path, changes, True)
        return alt

    found = [a for a in [with_or_without_experts(config_path, {}, base)] if a is not None]
    if base.kv_cache_dtype != "float8_e4m3fn":
        found += [a for a in [with_or_without_experts(config_path, {"kv_cache_dtype": "fp8"})] if a is not None]
    if base.weight_format == "float":
        raw = json.loads(Path(info.config_path).read_text())
        with tempfile.TemporaryDirectory(prefix="vlm-sdk-plan-") as tmp:
            for name, quantization in QUANTIZED.items():
                Path(tmp, "config.json").write_text(json.dumps({**raw, "quantization_config": quantization}))
                alt = with_or_without_experts(tmp, {})
                if alt is not None:
                    found.append(dataclasses.replace(alt, checkpoint=name))
    return found


def _is_moe(hf_config) -> bool:
    text = getattr(hf_config, "text_config", hf_config)
    return bool(getattr(text, "num_experts", 0) or getattr(text, "n_routed_experts", 0))
