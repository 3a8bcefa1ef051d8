"""The layers hold (`.importlinter`, docs/ARCHITECTURE.md): imports run from the API down to the kernels,
siblings import without cycles, and no shared part imports a model family.

import-linter reads the package as it is installed: `kernels/` and `models/` become `vlm_sdk.kernels` and
`vlm_sdk.models` only through the install's package-dir mapping, which its static import graph cannot
follow, so the test assembles that layout in a temporary directory and lints it there."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO

ROOT = REPO


@pytest.fixture(scope="module")
def installed_layout(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("layout")
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "vlm_sdk", root / "vlm_sdk", ignore=skip)
    shutil.copytree(ROOT / "kernels", root / "vlm_sdk" / "kernels", ignore=skip)
    shutil.copytree(ROOT / "models", root / "vlm_sdk" / "models", ignore=skip)
    return root


def _run(code: str, root: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(root))  # the assembled copy is found before the editable install
    return subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True)


def test_import_linter_contracts_hold(installed_layout):
    code = ("import sys; from importlinter.cli import lint_imports; "
            f"sys.exit(lint_imports(config_filename={str(ROOT / '.importlinter')!r}))")
    result = _run(code, installed_layout)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_shared_modules_reach_no_family(installed_layout):
    """No module outside a family folder imports a registered family, directly or through others: the
    registry imports families by module path at run time only. (The CLI may reach the GPU benchmark,
    a Qwen2.5-VL-3B figure by design, and the fixtures in vlm_sdk.testing build any family: both are
    held to direct imports.)"""
    code = """
import grimp
from vlm_sdk.models import registry
graph = grimp.build_graph("vlm_sdk", cache_dir=None)
families = sorted({entry.module.rsplit(".", 1)[0] for entry in registry.FAMILIES})
def under(module, package):
    return module == package or module.startswith(package + ".")
direct_only = ("vlm_sdk.cli", "vlm_sdk.testing")
for module in sorted(graph.modules):
    if any(under(module, p) or p.startswith(module + ".") for p in families + ["vlm_sdk.bench"]):
        continue  # a family, the benchmarks, or a package holding them (vlm_sdk, vlm_sdk.models)
    for family in families:
        if any(under(module, p) for p in direct_only):
            hits = [m for m in graph.find_modules_directly_imported_by(module) if under(m, family)]
            if hits:
                print(module, "->", hits)
        else:
            chain = graph.find_shortest_chain(importer=module, imported=family, as_packages=True)
            if chain:
                print(" -> ".join(chain))
print("checked", len(graph.modules), "modules against", families)
"""
    result = _run(code, installed_layout)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[-1].startswith("checked") and "qwen2_5_vl" in lines[-1], result.stdout
    assert lines[:-1] == [], "\n".join(lines[:-1])
