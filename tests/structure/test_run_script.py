"""`./run` works in a project virtual environment (issue 20, row 10: a Debian/Ubuntu system python3
refuses pip installs under PEP 668): without an active one and without PYTHON, it creates `.venv`
(seeing the system's packages, with a pip) and runs everything with its python."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

from helpers import REPO


def _run(cwd, *args, env=None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHON")}
    return subprocess.run(["bash", str(cwd / "run"), *args], cwd=cwd, env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=120)


def test_run_creates_and_uses_a_project_venv(tmp_path):
    shutil.copy(REPO / "run", tmp_path / "run")
    probe = ("import sys, torch; from pip import __version__ as pip; "
             "print(sys.prefix, sys.prefix != sys.base_prefix, torch.__version__, pip)")
    first = _run(tmp_path, "python", "-c", probe)
    assert first.returncode == 0, first.stderr
    prefix, in_venv, torch_version, pip_version = first.stdout.split()
    assert os.path.realpath(prefix) == os.path.realpath(tmp_path / ".venv") and in_venv == "True"
    assert torch_version and pip_version  # the system's torch is seen, and pip works inside
    again = _run(tmp_path, "python", "-c", "import sys; print(sys.prefix)")  # reused, not recreated
    assert again.returncode == 0 and os.path.realpath(again.stdout.strip()) == os.path.realpath(tmp_path / ".venv")


def test_an_active_environment_or_PYTHON_is_used_instead(tmp_path):
    shutil.copy(REPO / "run", tmp_path / "run")
    chosen = sys.executable  # a real interpreter (a pyenv shim on PATH would report another path)
    out = _run(tmp_path, "python", "-c", "import sys; print(sys.executable)", env={"PYTHON": chosen})
    assert out.returncode == 0 and not (tmp_path / ".venv").exists()
    assert os.path.realpath(out.stdout.strip()) == os.path.realpath(chosen)
