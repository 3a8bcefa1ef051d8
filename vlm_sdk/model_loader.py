"""Reading a Hugging Face checkpoint directory: config, tokenizer, safetensors weights.

Every failure is a `CheckpointError` that names the file or tensor involved. The tensors it streams
are copied into a model by `vlm_sdk.weight_loading.load_checked`. Under tensor parallelism the stream
is lazy (`iter_safetensors(lazy=True)`): each item is a `SafetensorsTensor` (shape and dtype from the
header, `narrow` reads only a slice from the file), so a rank reads only its slices.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch

from vlm_sdk.errors import CheckpointError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = [
    "CheckpointInfo", "read_checkpoint", "text_config", "load_tokenizer", "iter_safetensors",
    "config_from_dict", "ConfigInfo", "read_config", "SafetensorsTensor",
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


_SAFETENSORS_DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16",
                       "F16": "float16", "BF16": "bfloat16", "I32": "int32", "U32": "uint32", "F32": "float32",
                       "F64": "float64", "I64": "int64", "U64": "uint64", "F8_E4M3": "float8_e4m3fn",
                       "F8_E5M2": "float8_e5m2"}


class SafetensorsTensor:
    """One tensor of an open safetensors file, not read yet: `shape` and `dtype` from the header;
    `narrow(dim, start, length)` reads only that slice (safetensors' `get_slice`), `materialize()` the
    whole tensor, both as CPU tensors. Read it before the stream moves on to the next tensor (the
    file may be closed after that). `vlm_sdk.weight_loading.load_checked` takes these in place of
    tensors (its `LazyTensor` protocol)."""

    def __init__(self, handle: Any, name: str, path: Path):
        self._handle, self.name, self.path = handle, name, path
        self._slice = handle.get_slice(name)
        self.shape = torch.Size(self._slice.get_shape())
        kind = self._slice.get_dtype()
        self.dtype = getattr(torch, _SAFETENSORS_DTYPES.get(kind, ""), None)
        if not isinstance(self.dtype, torch.dtype):
            raise CheckpointError(f"tensor {name} in {path} has dtype {kind}, which torch cannot hold")

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]

    def materialize(self) -> torch.Tensor:
        return self._handle.get_tensor(self.name)

    def __repr__(self) -> str:
        return f"SafetensorsTensor({self.name!r}, shape={list(self.shape)}, dtype={self.dtype})"


def iter_safetensors(model_dir, *, show_progress: bool = True, lazy: bool = False
                     ) -> Iterator[tuple[str, "torch.Tensor | SafetensorsTensor"]]:
    """Yield (checkpoint name, CPU tensor) for every tensor, each exactly once, shard by shard.

    `lazy`: yield a `SafetensorsTensor` instead, which reads nothing until narrowed or materialized: a
    tensor-parallel rank loads only its slices (`load_checked` narrows each to the rank's shard)."""
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
                    tensor = SafetensorsTensor(handle, name, f) if lazy else handle.get_tensor(name)
                    bar.update(headers[f][name])
                    yield name, tensor


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


def _name_list(names: list[str], limit: int = 10) -> str:
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} (and {len(names) - limit} more)"
