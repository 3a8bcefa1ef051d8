"""Reading a Hugging Face checkpoint directory: config, tokenizer, safetensors weights.

Every failure is a `CheckpointError` that names the file or tensor involved.

Weights are copied with `load_checked`. Model code describes where each checkpoint tensor goes with
a `ParamSlot` per checkpoint name: a parameter (or persistent buffer) of the module, the shape the
checkpoint tensor must have, and optionally the first row of the range it fills in a fused parameter
(q/k/v -> qkv_proj, gate/up -> gate_up_proj); the tensor is reshaped to the parameter's trailing dims
(a Conv3d patch-embed weight -> a Linear). A slot may take only a `Shard` of the checkpoint tensor (one
tensor-parallel rank's slice along one dim): the tensor is checked at its full shape, then only the
slice is copied, so a rank never keeps the whole tensor. `load_checked` refuses unexpected, mis-shaped, duplicated
and missing tensors instead of leaving random weights behind, and checks up front that the slots
cover every row of every parameter exactly once. It knows no model: name aliases (e.g. the
`model.language_model.*` spelling of transformers 4.5x) come in as a `canonical` function.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import torch

from vlm_sdk.errors import CheckpointError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = [
    "CheckpointInfo", "read_checkpoint", "text_config", "load_tokenizer", "iter_safetensors",
    "ParamSlot", "Shard", "load_checked", "config_from_dict", "ConfigInfo", "read_config",
]

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
PREPROCESSOR_CONFIG_FILE = "preprocessor_config.json"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
_UNSUPPORTED_WEIGHT_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf", "*.h5", "*.msgpack")


@dataclass(frozen=True)
class CheckpointInfo:
    model_dir: Path
    hf_config: "PretrainedConfig"   # parsed by transformers' config class; both nested and flat layouts
    architecture: str               # config.json architectures[0], e.g. "Qwen2_5_VLForConditionalGeneration"
    eos_token_ids: tuple[int, ...]  # generation_config.json, else config, else the tokenizer's eos
    preprocessor: dict              # raw preprocessor_config.json ({} if absent)
    torch_dtype: str | None         # the dtype config.json declares ("torch_dtype" or v5 "dtype"), if any

    @property
    def text_config(self) -> "PretrainedConfig":
        return text_config(self.hf_config)


def read_checkpoint(model_dir) -> CheckpointInfo:
    root = _checkpoint_dir(model_dir)
    config_path = root / CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(f"{config_path} not found: a checkpoint directory needs the Hugging Face "
                              f"config.json next to its weights")
    raw = _read_json(config_path)
    architecture = _architecture(raw, config_path)
    _safetensors_files(root)  # fails early when there are no usable weights
    hf_config = _parse_config(root, raw)

    gen_path = root / GENERATION_CONFIG_FILE
    gen = _read_json(gen_path) if gen_path.is_file() else {}
    eos = _as_ids(gen.get("eos_token_id"))
    if not eos:
        # raw config.json only: parsed configs fill in class defaults (Qwen2.5-VL: 151645) when absent
        eos = _as_ids(raw.get("eos_token_id"))
        for sub in ("text_config", "llm_config"):
            if not eos and isinstance(raw.get(sub), dict):
                eos = _as_ids(raw[sub].get("eos_token_id"))
    if not eos:
        eos = _tokenizer_eos(root)

    return CheckpointInfo(model_dir=root, hf_config=hf_config, architecture=architecture,
                          eos_token_ids=eos, preprocessor=_preprocessor_beside(config_path),
                          torch_dtype=_declared_dtype(raw))


@dataclass(frozen=True)
class ConfigInfo:
    """What `read_config` reads: config.json (parsed as `read_checkpoint` parses it) and the
    preprocessor config beside it, without weights or a tokenizer."""
    config_path: Path
    hf_config: "PretrainedConfig"
    architecture: str
    preprocessor: dict              # raw preprocessor_config.json next to the config ({} if absent)
    torch_dtype: str | None


def read_config(path) -> ConfigInfo:
    """config.json alone, for planning: `path` is a directory holding config.json or the JSON file
    itself (any name). Parsed exactly as `read_checkpoint` parses it; no weights are needed."""
    given = Path(path).expanduser()
    if not given.exists():
        raise CheckpointError(f"{given} does not exist; pass a checkpoint directory or its config.json")
    config_path = given / CONFIG_FILE if given.is_dir() else given
    if not config_path.is_file():
        raise CheckpointError(f"{config_path} not found: a checkpoint directory needs the Hugging Face config.json")
    raw = _read_json(config_path)
    architecture = _architecture(raw, config_path)
    # from_pretrained takes the directory when the file is config.json, else the file itself
    hf_config = _parse_config(config_path.parent if config_path.name == CONFIG_FILE else config_path, raw)
    return ConfigInfo(config_path=config_path, hf_config=hf_config, architecture=architecture,
                      preprocessor=_preprocessor_beside(config_path), torch_dtype=_declared_dtype(raw))


def _architecture(raw: dict, config_path: Path) -> str:
    archs = raw.get("architectures")
    if not archs or not isinstance(archs, list) or not isinstance(archs[0], str):
        raise CheckpointError(f"{config_path} has no 'architectures' list (e.g. "
                              f"[\"Qwen2_5_VLForConditionalGeneration\"]); cannot tell which model to build")
    return archs[0]


def _preprocessor_beside(config_path: Path) -> dict:
    """The raw preprocessor_config.json next to config.json ({} if absent)."""
    path = config_path.parent / PREPROCESSOR_CONFIG_FILE
    return _read_json(path) if path.is_file() else {}


def _declared_dtype(raw: dict) -> str | None:
    """The dtype config.json declares ("torch_dtype" or v5 "dtype", top level or in text_config)."""
    dtype = raw.get("torch_dtype") or raw.get("dtype")
    if dtype is None and isinstance(raw.get("text_config"), dict):
        dtype = raw["text_config"].get("torch_dtype") or raw["text_config"].get("dtype")
    return None if dtype is None else str(dtype).removeprefix("torch.")


def text_config(hf_config) -> "PretrainedConfig":
    """The language-model sub-config (`text_config`, InternVL's `llm_config`), or the config itself."""
    for attr in ("text_config", "llm_config"):
        sub = getattr(hf_config, attr, None)
        if sub is None:
            continue
        if isinstance(sub, dict):
            return config_from_dict(sub)
        return sub
    getter = getattr(hf_config, "get_text_config", None)
    return getter() if callable(getter) else hf_config


def config_field(config, key: str):
    """A field of a config given as an object or a plain dict; None when absent (or config is None)."""
    if config is None:
        return None
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def config_from_dict(fields: dict, config_cls=None) -> "PretrainedConfig":
    """A transformers config (`config_cls`, default the generic `PretrainedConfig`) from a plain dict,
    e.g. the original InternVL layout's `llm_config`. The flat `rope_theta` + `rope_scaling` of
    published files is passed as transformers 5's `rope_parameters`, which it would otherwise convert
    with a FutureWarning."""
    from transformers import PretrainedConfig

    config_cls = config_cls or PretrainedConfig
    fields = dict(fields)
    scaling = fields.pop("rope_scaling", None)
    if "rope_parameters" not in fields and (scaling or "rope_theta" in fields):
        rope = dict(scaling or {})
        rope["rope_type"] = rope.pop("type", rope.get("rope_type", "default"))
        if "rope_theta" in fields:
            rope["rope_theta"] = fields["rope_theta"]
        fields["rope_parameters"] = rope
    return config_cls(**fields)


def load_tokenizer(model_dir, *, require_chat_template: bool = True):
    """transformers' fast tokenizer for the checkpoint, with its chat template.

    The template comes from tokenizer_config.json / chat_template.jinja, else from the processor's
    chat_template.json (published Qwen2.5-VL ships both).
    """
    root = _checkpoint_dir(model_dir)
    if not any((root / name).is_file() for name in _TOKENIZER_FILES):
        raise CheckpointError(f"no tokenizer in {root}: expected tokenizer.json (+ tokenizer_config.json); "
                              f"copy the tokenizer files of the model next to config.json")
    from transformers import AutoTokenizer

    try:
        # never remote code: an original-layout config.json names its remote classes in auto_map
        tok = AutoTokenizer.from_pretrained(str(root), local_files_only=True, trust_remote_code=False)
    except Exception as e:  # transformers raises many types here; the cause is kept
        raise CheckpointError(f"cannot load the tokenizer in {root}: {type(e).__name__}: {e}") from e
    if not getattr(tok, "is_fast", False):
        raise CheckpointError(f"the tokenizer in {root} is a slow (Python) tokenizer; a fast tokenizer "
                              f"(tokenizer.json) is required")
    if not getattr(tok, "chat_template", None):
        processor_template = root / "chat_template.json"
        if processor_template.is_file():
            tok.chat_template = _read_json(processor_template).get("chat_template")
    if require_chat_template and not getattr(tok, "chat_template", None):
        raise CheckpointError(f"the tokenizer in {root} has no chat template (none in tokenizer_config.json, "
                              f"chat_template.jinja or chat_template.json)")
    return tok


def iter_safetensors(model_dir, *, show_progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (checkpoint name, CPU tensor) for every tensor, each exactly once, shard by shard."""
    from safetensors import safe_open
    from tqdm.auto import tqdm

    root = _checkpoint_dir(model_dir)
    files = _safetensors_files(root)
    headers = {f: _safetensors_header(f) for f in files}
    expected = _index_weight_map(root)
    seen: dict[str, Path] = {}
    for f, header in headers.items():
        for name in header:
            if name in seen:
                raise CheckpointError(f"tensor {name} is stored twice: in {seen[name].name} and {f.name}")
            if expected is not None and expected.get(name, f.name) != f.name:
                raise CheckpointError(f"{SAFETENSORS_INDEX_FILE} puts tensor {name} in {expected[name]}, "
                                      f"but it is in {f.name}")
            seen[name] = f
    if expected is not None:
        absent = sorted(set(expected) - set(seen))
        if absent:
            raise CheckpointError(f"{len(absent)} tensor(s) listed in {root / SAFETENSORS_INDEX_FILE} are in "
                                  f"no shard: {_name_list(absent)}")

    total = sum(nbytes for header in headers.values() for nbytes in header.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc="Loading weights",
              disable=not show_progress) as bar:
        for f in files:
            try:
                handle = safe_open(str(f), framework="pt", device="cpu")
            except Exception as e:
                raise CheckpointError(f"cannot open {f}: {e}") from e
            with handle:
                for name in handle.keys():
                    tensor = handle.get_tensor(name)
                    bar.update(headers[f][name])
                    yield name, tensor


@dataclass(frozen=True)
class Shard:
    """The slice [start, start + length) along `dim` of a checkpoint tensor: what one tensor-parallel
    rank loads (column-parallel: dim 0 of a weight; row-parallel: dim 1)."""
    dim: int
    start: int
    length: int


@dataclass(frozen=True)
class ParamSlot:
    """Where one checkpoint tensor goes: rows [row_start, row_start + loaded rows) of parameter `param`
    (the whole parameter when `row_start` is None), after reshaping to the parameter's trailing dims.
    `param` is a name in the module's `state_dict()` (a parameter or a persistent buffer). With a
    `shard`, only that slice of the tensor is loaded (`shape` is still the whole tensor's)."""
    param: str
    shape: tuple[int, ...]  # the shape the checkpoint tensor must have
    row_start: int | None = None
    shard: Shard | None = None

    def under(self, prefix: str) -> "ParamSlot":
        """The same slot for the parameter seen from a parent module (`prefix` + param)."""
        return ParamSlot(prefix + self.param, self.shape, self.row_start, self.shard)

    @property
    def loaded_shape(self) -> tuple[int, ...]:
        """The shape of what is copied: `shape`, narrowed to the shard."""
        if self.shard is None:
            return tuple(self.shape)
        shape = list(self.shape)
        shape[self.shard.dim] = self.shard.length
        return tuple(shape)


def _identity(name: str) -> str:
    return name


def load_checked(module: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                 slots: dict[str, ParamSlot], *, ignore: frozenset[str] = frozenset(),
                 canonical: Callable[[str], str] = _identity,
                 source: str | Path | None = None) -> None:
    """Copy checkpoint tensors into `module`, strictly: each into the slot `slots[canonical(name)]`.

    `slots` is keyed by canonical checkpoint name; checkpoint tensors whose canonical name is in
    `ignore` are skipped (e.g. lm_head when tied). `CheckpointError`, naming the tensor, its shape and
    `source` (the checkpoint directory) when given, for: a tensor with no slot; a tensor whose shape is
    not the slot's (both shapes named); a tensor given twice, also under two aliases, or two tensors
    for one weight (slots naming the same rows are aliases, as tied weights are); and slots the
    checkpoint never fills, unless an alias was loaded (the first 10 named, then a count).
    Values are cast to the target's dtype and device.

    Slots that name no parameter or persistent buffer, run past its rows, cannot be reshaped into it,
    overlap, or leave rows of a parameter uncovered are a bug in the caller's map: `ValueError`, before
    anything is copied. Persistent buffers are loaded when a slot names them, else left alone.
    """
    where = f" in {source}" if source is not None else ""
    owner = type(module).__name__
    regions = _slot_regions(module, slots)
    loaded: dict[str, str] = {}                          # slot name -> checkpoint name
    filled: dict[tuple[int, int, int], str] = {}         # (id(target), start, stop) -> checkpoint name
    with torch.no_grad():
        for raw_name, tensor in weights:
            name = canonical(raw_name)
            if name in ignore:
                continue
            read_as = "" if name == raw_name else f" (read as {name!r})"
            slot = slots.get(name)
            if slot is None:
                raise CheckpointError(
                    f"unexpected tensor {raw_name} (shape {_shape(tensor)}){where}{read_as} matches no weight "
                    f"of {owner}: wrong architecture or config.json for these weights?")
            if tuple(tensor.shape) != tuple(slot.shape):
                raise CheckpointError(
                    f"tensor {raw_name}{where} has shape {_shape(tensor)} but {owner} expects "
                    f"{list(slot.shape)}{read_as} for {_slot_text(slot)}: config.json does not match the weights")
            previous = loaded.get(name)
            if previous == raw_name:
                raise CheckpointError(f"tensor {raw_name}{where} appears twice in the checkpoint")
            target, start, stop = regions[name]
            key = (id(target), start, stop)
            previous = previous or filled.get(key)
            if previous is not None:   # two aliases of one name, or two names tied to one weight
                raise CheckpointError(f"tensors {previous} and {raw_name}{where} both load into {_slot_text(slot)}")
            view = target.data if slot.row_start is None else target.data[start:stop]
            if slot.shard is not None:  # this rank's slice only
                tensor = tensor.narrow(slot.shard.dim, slot.shard.start, slot.shard.length)
            view.copy_(tensor.reshape(view.shape))
            loaded[name] = filled[key] = raw_name
    missing = [n for n in slots if n not in loaded and (id(regions[n][0]), *regions[n][1:]) not in filled]
    if missing:
        shown = [f"{n} {list(slots[n].shape)}" for n in missing]
        raise CheckpointError(f"{len(missing)} tensor(s) of {owner} missing from the checkpoint{where}: "
                              f"{_name_list(shown)}")


def _slot_regions(module: torch.nn.Module,
                  slots: dict[str, ParamSlot]) -> dict[str, tuple[torch.Tensor, int, int]]:
    """slot name -> (target tensor, first row, end row); checks the map against the module."""
    owner = type(module).__name__
    targets: dict[str, torch.Tensor] = module.state_dict(keep_vars=True)  # params + persistent buffers
    regions: dict[str, tuple[torch.Tensor, int, int]] = {}
    for name, slot in slots.items():
        target = targets.get(slot.param)
        if target is None:
            raise ValueError(f"slot for {name} names {slot.param!r}, which {owner} does not have")
        rows = target.shape[0] if target.dim() else 1
        loaded = slot.loaded_shape
        if slot.shard is not None and not (0 <= slot.shard.dim < len(slot.shape) and slot.shard.start >= 0
                                           and slot.shard.start + slot.shard.length <= slot.shape[slot.shard.dim]):
            raise ValueError(f"slot for {name}: {slot.shard} is outside the tensor's shape {list(slot.shape)}")
        if slot.row_start is None:
            start, stop, expect = 0, rows, target.numel()
        else:
            start, stop = slot.row_start, slot.row_start + (loaded[0] if loaded else 1)
            expect = (stop - start) * prod(target.shape[1:])
            if target.dim() == 0 or start < 0 or stop > rows:
                raise ValueError(f"slot for {name}: rows [{start}, {stop}) are outside {slot.param} "
                                 f"{_shape(target)}")
        if prod(loaded) != expect:
            raise ValueError(f"slot for {name}: shape {list(loaded)} does not reshape into "
                             f"{_slot_text(slot)} of {owner} ({_shape(target)})")
        regions[name] = (target, start, stop)
    # every parameter row is filled by exactly one region (slots naming the same region are aliases)
    covered: dict[int, set[tuple[int, int]]] = {}
    for target, start, stop in regions.values():
        covered.setdefault(id(target), set()).add((start, stop))
    by_region = {(id(t), a, b): n for n, (t, a, b) in reversed(regions.items())}  # first slot per region
    for key, spans in covered.items():
        ordered = sorted(spans)
        for (a0, b0), (a1, b1) in zip(ordered, ordered[1:]):
            if a1 < b0:
                first, second = by_region[(key, a0, b0)], by_region[(key, a1, b1)]
                raise ValueError(f"slots for {first} and {second} overlap: {_slot_text(slots[first])} "
                                 f"and {_slot_text(slots[second])}")
    gaps: list[str] = []
    for pname, param in module.named_parameters():   # tied parameters appear once
        rows = param.shape[0] if param.dim() else 1
        nxt = 0
        for start, stop in sorted(covered.get(id(param), ())):
            if start > nxt:
                break
            nxt = max(nxt, stop)
        if nxt < rows:
            gaps.append(pname if nxt == 0 else f"{pname} rows [{nxt}, {rows})")
    if gaps:
        raise ValueError(f"the slots leave {len(gaps)} parameter(s) of {owner} unloaded: {_name_list(gaps)}")
    return regions


def _slot_text(slot: ParamSlot) -> str:
    loaded = slot.loaded_shape
    text = slot.param if slot.row_start is None else \
        f"{slot.param} rows [{slot.row_start}, {slot.row_start + (loaded[0] if loaded else 1)})"
    if slot.shard is not None:
        sh = slot.shard
        text += f" (its dim-{sh.dim} slice [{sh.start}, {sh.start + sh.length}))"
    return text


# ----------------------------------------------------------------------------------------------
# helpers

def _checkpoint_dir(model_dir) -> Path:
    root = Path(model_dir).expanduser()
    if not root.exists():
        raise CheckpointError(f"checkpoint directory {root} does not exist")
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a directory; pass the checkpoint directory holding config.json")
    return root


def _read_json(path: Path) -> dict:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from e
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} must hold a JSON object, found {type(obj).__name__}")
    return obj


def _parse_config(root: Path, raw: dict):
    """transformers' own config class for the model_type (it converts the flat published layout)."""
    from transformers import CONFIG_MAPPING, PretrainedConfig

    model_type = raw.get("model_type")
    try:
        if model_type in CONFIG_MAPPING:
            return CONFIG_MAPPING[model_type].from_pretrained(str(root), local_files_only=True)
        # remote-code families (e.g. InternVL's "internvl_chat"): a generic config, sub-configs as dicts
        return PretrainedConfig.from_dict(raw)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"transformers cannot parse {root / CONFIG_FILE} "
                              f"(model_type {model_type!r}): {type(e).__name__}: {e}") from e


def _safetensors_files(root: Path) -> list[Path]:
    index_path = root / SAFETENSORS_INDEX_FILE
    weight_map = _index_weight_map(root)
    if weight_map is not None:
        files = [root / n for n in sorted(set(weight_map.values()))]  # each shard once, by file name
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise CheckpointError(f"{index_path} names shard(s) that are not in {root}: {', '.join(absent)}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        others = sorted({p.name for pat in _UNSUPPORTED_WEIGHT_PATTERNS for p in root.glob(pat)})
        found = f" (found {', '.join(others[:5])})" if others else ""
        raise CheckpointError(f"no *.safetensors weights in {root}{found}: only safetensors are supported; "
                              f"convert the weights with transformers' save_pretrained(safe_serialization=True)")
    return files


def _index_weight_map(root: Path) -> dict[str, str] | None:
    index_path = root / SAFETENSORS_INDEX_FILE
    if not index_path.is_file():
        return None
    weight_map = _read_json(index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_path} has no 'weight_map' object")
    return weight_map


def _safetensors_header(path: Path) -> dict[str, int]:
    """name -> bytes, from the file header alone (8-byte little-endian length + JSON)."""
    try:
        with open(path, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
    except (OSError, struct.error, ValueError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from e
    return {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


def _tokenizer_eos(root: Path) -> tuple[int, ...]:
    cfg_path = root / "tokenizer_config.json"
    if not cfg_path.is_file():
        return ()
    eos = _read_json(cfg_path).get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if not eos:
        return ()
    tok = load_tokenizer(root, require_chat_template=False)
    eos_id = tok.convert_tokens_to_ids(eos)
    return () if eos_id is None else (int(eos_id),)


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, (list, tuple)) else [value]
    return tuple(dict.fromkeys(int(v) for v in values))


def _shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)


def _name_list(names: list[str], limit: int = 10) -> str:
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} (and {len(names) - limit} more)"
