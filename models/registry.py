"""config.json `architectures` -> the model family that serves it.

One line per family below: its name, the module defining `FAMILY` (a `FamilySpec`), and the
config.json architectures it serves. Families are imported lazily by module path, so importing the
registry imports no family; `resolve` imports only the family it returns.
"""
from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vlm_sdk.errors import CheckpointError, InvalidRequestError

if TYPE_CHECKING:  # families import the registry's siblings, never the reverse at run time
    from vlm_sdk.models.family import FamilySpec, Setting


@dataclass(frozen=True)
class FamilyEntry:
    name: str  # e.g. "qwen2_5_vl"
    module: str  # module path defining FAMILY
    architectures: tuple[str, ...]  # config.json names served by this family


FAMILIES = (
    FamilyEntry("qwen2_5_vl", "vlm_sdk.models.qwen2_5_vl.spec", ("Qwen2_5_VLForConditionalGeneration",)),
    FamilyEntry("internvl", "vlm_sdk.models.internvl.spec", ("InternVLForConditionalGeneration", "InternVLChatModel")),
    FamilyEntry("qwen3_vl", "vlm_sdk.models.qwen3_vl.spec", ("Qwen3VLForConditionalGeneration",)),
    FamilyEntry("qwen3_vl_moe", "vlm_sdk.models.qwen3_vl_moe.spec", ("Qwen3VLMoeForConditionalGeneration",)),
    FamilyEntry("gemma3", "vlm_sdk.models.gemma3.spec", ("Gemma3ForConditionalGeneration",)),
    FamilyEntry("qwen3_5", "vlm_sdk.models.qwen3_5.spec", ("Qwen3_5ForConditionalGeneration",)),
    FamilyEntry("qwen3_5_moe", "vlm_sdk.models.qwen3_5_moe.spec", ("Qwen3_5MoeForConditionalGeneration",)),
)


def load(name: str) -> FamilySpec:
    """The family registered as `name` (imports its spec module)."""
    for entry in FAMILIES:
        if entry.name == name:
            return importlib.import_module(entry.module).FAMILY
    raise InvalidRequestError(f"unknown model family {name!r}; registered: {', '.join(family_names())}")


def load_module(module: str) -> FamilySpec:
    """`FAMILY` of the module at path `module` ("package.module", or "package.module:NAME" for another
    attribute); `InvalidRequestError` when there is none."""
    path, _, name = module.partition(":")
    try:
        spec = getattr(importlib.import_module(path), name or "FAMILY")
    except (ImportError, AttributeError) as e:
        raise InvalidRequestError(f"model_family={module!r}: not a module defining {name or 'FAMILY'} ({e})",
                                  param="model_family") from None
    if not all(hasattr(spec, attr) for attr in ("model_cls", "processor_cls", "image_limits")):
        raise InvalidRequestError(f"model_family={module!r}: its {name or 'FAMILY'} is a {type(spec).__name__}, not a "
                                  f"FamilySpec (models/family.py)", param="model_family")
    return spec


def family_names() -> tuple[str, ...]:
    return tuple(e.name for e in FAMILIES)


def families() -> tuple[FamilySpec, ...]:
    """Every registered family (imports each spec module)."""
    return tuple(load(e.name) for e in FAMILIES)


def supported_architectures() -> list[str]:
    return [arch for e in FAMILIES for arch in e.architectures]


def resolve(architectures: list[str], module: str | None = None) -> FamilySpec:
    """The family of the first known architecture; `CheckpointError` when none is known. `module`
    (`EngineArgs.model_family`): the module path of a `FamilySpec` outside this registry that serves the
    checkpoint instead (its `FAMILY`), imported here by path: a family of one's own, or the tests'
    mixed-cache model."""
    if module is not None:
        return load_module(module)
    for arch in architectures or []:
        for e in FAMILIES:
            if arch in e.architectures:
                return load(e.name)
    raise CheckpointError(f"config.json architectures {list(architectures or [])} are not supported; "
                          f"supported: {', '.join(supported_architectures())}")


def engine_settings() -> dict[str, Setting]:
    """Setting name -> one schema over every family declaring it (the flags are made from these): the
    first declaring family's check, and a help true for each family (`shared_setting`)."""
    declared: dict[str, list[tuple[FamilySpec, Setting]]] = {}
    for fam in families():
        for s in fam.engine_settings:
            declared.setdefault(s.name, []).append((fam, s))
    return {name: shared_setting(pairs) for name, pairs in declared.items()}


def shared_setting(declared: list[tuple[FamilySpec, Setting]]) -> Setting:
    """The schema of one setting name from its (family, Setting) declarations: the common help once,
    then each distinct `detail` with the families that declare it ("a multiple of 28x28
    (Qwen2.5-VL); a multiple of 32x32 (Qwen3-VL)"); where the helps themselves differ, each family's
    whole help beside its name. A help one family wrote never speaks for another."""
    first = declared[0][1]
    if len({s.help for _, s in declared}) > 1:
        text = "; ".join(f"{fam.display_name}: {s.full_help}" for fam, s in declared)
    elif len({s.detail for _, s in declared}) == 1:
        text = first.full_help
    else:
        owners: dict[str, list[str]] = {}
        for fam, s in declared:
            owners.setdefault(s.detail, []).append(fam.display_name)
        text = first.help + "; " + "; ".join(f"{d} ({', '.join(names)})" for d, names in owners.items() if d)
    return dataclasses.replace(first, help=text, detail="")


def plan_settings() -> dict[str, tuple[FamilySpec, str]]:
    """Plan option -> (family, engine setting) for every family's `plan_setting`."""
    out: dict[str, tuple[FamilySpec, str]] = {}
    for fam in families():
        out.setdefault(fam.plan_setting[0], (fam, fam.plan_setting[1]))
    return out


def engine_args(**kwargs):
    """`EngineArgs.from_kwargs` with the registered families' engine settings (e.g. `max_pixels=`)
    routed into `mm_processor_kwargs`, each checked against its schema (positive integer, ...); the
    checkpoint's family refuses another family's setting when the engine starts."""
    from vlm_sdk.config import EngineArgs
    schemas = engine_settings()
    for name, value in kwargs.items():
        if name in schemas and value is not None:
            schemas[name].check(value)
    return EngineArgs.from_kwargs(family_settings=tuple(schemas), **kwargs)
