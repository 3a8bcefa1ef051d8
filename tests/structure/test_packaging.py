"""The wheel holds every package: `kernels/` and `models/` (mapped to vlm_sdk.kernels / vlm_sdk.models)
and `vlm_sdk/`, found by setup.py, so a new model family folder cannot be silently left out (an
editable install would still import it)."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from helpers import REPO

ROOT = REPO


def _source_packages() -> set[str]:
    """Every folder holding Python modules, under its installed name."""
    installed = {"vlm_sdk": "vlm_sdk", "kernels": "vlm_sdk/kernels", "models": "vlm_sdk/models"}
    out = set()
    for top, name in installed.items():
        for module in (ROOT / top).rglob("*.py"):
            rel = module.parent.relative_to(ROOT / top)
            out.add(name if rel == Path(".") else f"{name}/{rel.as_posix()}")
    return out


def test_wheel_contains_every_package(tmp_path):
    # built from a copy: an in-tree build would leave build/ behind, whose stale files could pass the check
    src = tmp_path / "src"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("vlm_sdk", "kernels", "models"):
        shutil.copytree(ROOT / name, src / name, ignore=skip)
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, capture_output=True, text=True)
    (wheel,) = (tmp_path / "dist").glob("vlm_sdk-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    in_wheel = {n.rsplit("/", 1)[0] for n in names if n.endswith(".py")}
    inits = {n.rsplit("/", 1)[0] for n in names if n.endswith("/__init__.py")}
    expected = _source_packages()
    assert expected - in_wheel == set(), "folders missing from the wheel (a missing __init__.py?)"
    assert expected - inits == set(), "folders without __init__.py"
    assert "vlm_sdk/models/registry.py" in names and "vlm_sdk/kernels/rms_norm.py" in names
