"""config.json's `quantization_config` -> the weight format of the checkpoint's quantized Linears (a
`QuantScheme`), or None for a float checkpoint. Every field we cannot serve is a `CheckpointError` naming the
field, its value and what is supported: a checkpoint is never run with a layout we do not read exactly.

    quant_method        formats read                      what config.json must say
    awq                 AWQ GEMM (AutoAWQ)                 bits 4, zero_point true, version gemm, group_size
    gptq                GPTQ (AutoGPTQ / gptqmodel)        bits 4, group_size, desc_act, sym,
                                                           checkpoint_format gptq | gptq_v2, no lm_head
    fp8                 block-wise FP8                     fmt e4m3, weight_block_size [b0, b1],
                                                           activation_scheme dynamic
    compressed-tensors  float-quantized FP8                one config group targeting Linear: weights 8-bit
                                                           float, strategy channel; activations dynamic or none
                        pack-quantized W4A16               one config group targeting Linear: weights 4-bit
                                                           int, strategy group (group_size) or channel,
                                                           symmetric or not, actorder none / weight / group;
                                                           no input_activations
"""
from __future__ import annotations

from typing import Any, Mapping

from vlm_sdk.errors import CheckpointError
from vlm_sdk.layers.quantization.awq import AWQScheme
from vlm_sdk.layers.quantization.base import QuantScheme
from vlm_sdk.layers.quantization.fp8 import FP8BlockScheme, FP8ChannelScheme
from vlm_sdk.layers.quantization.gptq import GPTQScheme
from vlm_sdk.layers.quantization.wna16 import W4A16Scheme

QUANT_METHODS = ("awq", "gptq", "fp8", "compressed-tensors")


def quant_scheme(hf_config: Any) -> QuantScheme | None:
    """The checkpoint's weight format from its config (a transformers config or a dict holding
    `quantization_config`), None when it has none."""
    raw = hf_config.get("quantization_config") if isinstance(hf_config, Mapping) else \
        getattr(hf_config, "quantization_config", None)
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raw = raw.to_dict() if hasattr(raw, "to_dict") else vars(raw)
    method = str(raw.get("quant_method", "")).lower()
    parse = {"awq": _awq, "gptq": _gptq, "fp8": _fp8, "compressed-tensors": _compressed_tensors}.get(method)
    if parse is None:
        raise CheckpointError(f"config.json quantization_config.quant_method {raw.get('quant_method')!r} is not "
                              f"supported; supported: {', '.join(QUANT_METHODS)}")
    return parse(raw)


def _field(raw: Mapping, key: str, method: str, supported: str, *aliases: str):
    for name in (key, *aliases):
        if name in raw:
            return raw[name]
    raise CheckpointError(f"config.json quantization_config ({method}) has no {key!r}: {supported}")


def _refuse(method: str, key: str, value, supported: str) -> CheckpointError:
    return CheckpointError(f"config.json quantization_config ({method}) {key}={value!r} is not supported; "
                           f"supported: {supported}")


def _group_size(raw: Mapping, method: str, *aliases: str) -> int:
    g = _field(raw, "group_size", method, "the input rows per scale, e.g. 128", *aliases)
    if isinstance(g, bool) or not isinstance(g, int) or not (g == -1 or g > 0):
        raise _refuse(method, "group_size", g, "a positive number of input rows per scale (e.g. 128), or -1")
    return g


def _skip(raw: Mapping, *keys: str) -> tuple[str, ...]:
    for key in keys:
        value = raw.get(key)
        if value:
            return tuple(str(v) for v in value)
    return ()


def _awq(raw: Mapping) -> AWQScheme:
    bits = _field(raw, "bits", "awq", "4", "w_bit")
    if bits != 4:
        raise _refuse("awq", "bits", bits, "4")
    if not _field(raw, "zero_point", "awq", "true"):
        raise _refuse("awq", "zero_point", raw.get("zero_point"), "true (the GEMM layout with zero points)")
    version = str(raw.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse("awq", "version", raw.get("version"), "'gemm' (AutoAWQ's GEMM packing)")
    return AWQScheme(_group_size(raw, "awq", "q_group_size"), _skip(raw, "modules_to_not_convert"))


def _gptq(raw: Mapping) -> GPTQScheme:
    bits = _field(raw, "bits", "gptq", "4")
    if bits != 4:
        raise _refuse("gptq", "bits", bits, "4")
    fmt = str(raw.get("checkpoint_format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse("gptq", "checkpoint_format", raw.get("checkpoint_format"), "'gptq' (zero - 1 stored) or "
                      "'gptq_v2'")
    if raw.get("lm_head"):
        raise _refuse("gptq", "lm_head", raw.get("lm_head"), "false (the LM head unquantized)")
    if raw.get("dynamic"):
        raise _refuse("gptq", "dynamic", "{...}", "no per-module overrides (one format for every Linear)")
    return GPTQScheme(_group_size(raw, "gptq"), bool(raw.get("desc_act", False)), bool(raw.get("sym", True)),
                      1 if fmt == "gptq" else 0, _skip(raw, "modules_to_not_convert"))


def _fp8(raw: Mapping) -> FP8BlockScheme:
    fmt = str(raw.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise _refuse("fp8", "fmt", raw.get("fmt"), "'e4m3'")
    block = raw.get("weight_block_size")
    if block is None:
        raise CheckpointError("config.json quantization_config (fp8) has no 'weight_block_size': per-tensor FP8 "
                              "checkpoints are not supported; supported: block-wise FP8 (weight_block_size [b0, b1], "
                              "weight_scale_inv per block) or compressed-tensors FP8")
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise _refuse("fp8", "weight_block_size", block, "two positive ints [output rows, input columns], e.g. "
                      "[128, 128]")
    scheme = str(raw.get("activation_scheme", "dynamic")).lower()
    if scheme != "dynamic":
        raise _refuse("fp8", "activation_scheme", raw.get("activation_scheme"), "'dynamic'")
    return FP8BlockScheme((block[0], block[1]), _skip(raw, "modules_to_not_convert", "ignored_layers"))


_CT = "compressed-tensors"
_CT_FORMATS = "'float-quantized' with 8-bit float weights (FP8) or 'pack-quantized' with 4-bit int weights (W4A16)"


def _compressed_tensors(raw: Mapping) -> FP8ChannelScheme | W4A16Scheme:
    groups = raw.get("config_groups") or {}
    if len(groups) != 1:
        raise _refuse(_CT, "config_groups", f"{len(groups)} groups", "exactly one group (one format for every "
                      "quantized Linear)")
    (group,) = groups.values()
    targets = list(group.get("targets") or [])
    if targets != ["Linear"]:
        raise _refuse(_CT, "config_groups.*.targets", targets, "['Linear']")
    fmt = str(group.get("format") or raw.get("format") or "")
    w = group.get("weights") or {}
    if fmt == "pack-quantized":
        scheme = _pack_quantized(w, group.get("input_activations"), _skip(raw, "ignore"))
    elif fmt == "float-quantized" and w.get("type") == "float" and w.get("num_bits") == 8:
        scheme = _float_quantized(w, group.get("input_activations"), _skip(raw, "ignore"))
    else:
        raise _refuse(_CT, "format", fmt or None, _CT_FORMATS)
    _check_kv_cache_scheme(raw.get("kv_cache_scheme"))
    return scheme


def _float_quantized(w: Mapping, acts: Mapping | None, skip: tuple[str, ...]) -> FP8ChannelScheme:
    if w.get("strategy") != "channel" or not w.get("symmetric", True) or w.get("dynamic"):
        raise _refuse(_CT, "weights.strategy", w.get("strategy"), "'channel' (static, symmetric)")
    if acts is not None and not acts.get("dynamic"):
        raise _refuse(_CT, "input_activations.dynamic", acts.get("dynamic"),
                      "true (dynamic per-token scales) or no input_activations")
    return FP8ChannelScheme(skip)


def _pack_quantized(w: Mapping, acts: Mapping | None, skip: tuple[str, ...]) -> W4A16Scheme:
    if w.get("type") != "int":
        raise _refuse(_CT, "weights.type", w.get("type"), "'int' (pack-quantized W4A16)")
    if w.get("num_bits") != 4:
        raise _refuse(_CT, "weights.num_bits", w.get("num_bits"), "4 (pack-quantized W4A16)")
    if acts is not None:
        raise _refuse(_CT, "input_activations", "{...}", "none (pack-quantized W4A16 is weight-only)")
    if w.get("dynamic"):
        raise _refuse(_CT, "weights.dynamic", w.get("dynamic"), "false (static scales in the checkpoint)")
    strategy = w.get("strategy")
    if strategy == "channel":
        group = -1
    elif strategy == "group":
        group = w.get("group_size")
        if isinstance(group, bool) or not isinstance(group, int) or group <= 0:
            raise _refuse(_CT, "weights.group_size", group, "a positive number of input columns per scale (e.g. 128)")
    else:
        raise _refuse(_CT, "weights.strategy", strategy, "'group' or 'channel'")
    # compressed-tensors' ActivationOrdering: "group" (or true) stores weight_g_idx; "weight" / "static"
    # reorder before quantizing and store the columns in order, as none does
    actorder = w.get("actorder")
    order = str(actorder).lower() if isinstance(actorder, str) else actorder
    if order not in (None, False, True, "weight", "static", "group"):
        raise _refuse(_CT, "weights.actorder", actorder, "null, 'weight', 'static' or 'group'")
    return W4A16Scheme(group, bool(w.get("symmetric", True)), order in (True, "group") and group != -1, skip)


def _check_kv_cache_scheme(kv: Mapping | None) -> None:
    if kv and not (kv.get("type") == "float" and kv.get("num_bits") == 8 and kv.get("strategy") == "tensor"
                   and not kv.get("dynamic") and kv.get("symmetric", True)):
        raise _refuse(_CT, "kv_cache_scheme", {k: kv.get(k) for k in ("type", "num_bits", "strategy", "dynamic")},
                      "none, or static per-tensor 8-bit float scales (type float, num_bits 8, strategy tensor, "
                      "dynamic false): the FP8 KV cache's k_scale / v_scale")
