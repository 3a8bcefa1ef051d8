"""Each family's test and benchmark fixtures (`FamilyFixtures`, models/fixtures.py): one line per family,
beside its line in vlm_sdk/models/registry.py. Imported lazily by module path, as the families are."""
from __future__ import annotations

import importlib
from types import MappingProxyType

from vlm_sdk.models import registry

FIXTURE_MODULES = MappingProxyType({
    "qwen2_5_vl": "vlm_sdk.models.qwen2_5_vl.fixtures",
    "internvl": "vlm_sdk.models.internvl.fixtures",
    "qwen3_vl": "vlm_sdk.models.qwen3_vl.fixtures",
    "qwen3_vl_moe": "vlm_sdk.models.qwen3_vl_moe.fixtures",
    "gemma3": "vlm_sdk.models.gemma3.fixtures",
    "qwen3_5": "vlm_sdk.models.qwen3_5.fixtures",
    "qwen3_5_moe": "vlm_sdk.models.qwen3_5_moe.fixtures",
})


def fixtures(family: str):
    """The `FamilyFixtures` of a registered family."""
    if family not in FIXTURE_MODULES:
        raise ValueError(f"no fixtures registered for family {family!r} (vlm_sdk/testing/families.py); "
                         f"registered families: {', '.join(registry.family_names())}")
    return importlib.import_module(FIXTURE_MODULES[family]).FIXTURES
