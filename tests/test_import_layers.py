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

ROOT = Path(__file__).resolve().parents[1]


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
