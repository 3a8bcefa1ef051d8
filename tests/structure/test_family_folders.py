"""Families share code through models/common/, never by importing a sibling family's folder
(docs/ARCHITECTURE.md, "Families share through models/common"): every import in a family folder, at
module level or inside a function, names only its own folder, models/common, the family-neutral
modules of models/ and the shared vlm_sdk layers; models/common imports no family folder."""
from __future__ import annotations

import ast
from pathlib import Path

from helpers import REPO

MODELS = REPO / "models"


def family_folders(models: Path) -> list[str]:
    """Every package directly under models/ but common/: a family, or a part only one family uses."""
    return sorted(p.name for p in models.iterdir() if (p / "__init__.py").exists() and p.name != "common")


def _imported(path: Path, package: str) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in `path` (relative ones resolved against `package`)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            out += [(node.lineno, base)] + [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


def cross_family_imports(models: Path) -> list[str]:
    """'file:line: module' for each import of a family folder from another family folder or from common/."""
    families = family_folders(models)
    bad = []
    for folder in families + ["common"]:
        for path in sorted((models / folder).rglob("*.py")):
            package = "vlm_sdk.models." + ".".join(path.relative_to(models).parent.parts)
            for line, module in _imported(path, package):
                parts = module.split(".")
                if parts[:2] == ["vlm_sdk", "models"] and len(parts) > 2 and parts[2] in families and parts[2] != folder:
                    bad.append(f"models/{path.relative_to(models)}:{line}: {module}")
    return sorted(set(bad))


def test_no_family_folder_imports_another():
    assert {"qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "internvl"} <= set(family_folders(MODELS))
    bad = cross_family_imports(MODELS)
    assert not bad, ("a family folder (or models/common) imports another family's folder; move what they "
                     "share into models/common/:\n" + "\n".join(bad))


def test_the_check_sees_a_sibling_import(tmp_path):
    """It fails on what it is for: a function-level `from vlm_sdk.models.<sibling> import ...`, a relative
    import of a sibling, and models/common reaching a family."""
    for name in ("alpha", "beta", "common"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
    (tmp_path / "alpha" / "model.py").write_text("from vlm_sdk.models.common.x import y\n"
                                                  "def f():\n    from vlm_sdk.models.beta.model import B\n")
    (tmp_path / "alpha" / "spec.py").write_text("from ..beta import spec\n")
    (tmp_path / "beta" / "model.py").write_text("from vlm_sdk.models.beta.spec import S\n")
    (tmp_path / "common" / "x.py").write_text("import vlm_sdk.models.alpha.model\n")
    assert cross_family_imports(tmp_path) == sorted([
        "models/alpha/model.py:3: vlm_sdk.models.beta.model", "models/alpha/model.py:3: vlm_sdk.models.beta.model.B",
        "models/alpha/spec.py:1: vlm_sdk.models.beta", "models/alpha/spec.py:1: vlm_sdk.models.beta.spec",
        "models/common/x.py:1: vlm_sdk.models.alpha.model"])
