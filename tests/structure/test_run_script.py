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
    """What `run` promises of the venv, whatever the machine's python3 has installed: it is created in
    .venv, it is the interpreter `run python` uses, it has a working pip, it sees the system's
    site-packages (so a package already installed there is not downloaded again), and it is reused."""
    shutil.copy(REPO / "run", tmp_path / "run")
    probe = ("import site, sys, sysconfig; from pip import __version__ as pip; "
             "base = sysconfig.get_paths(vars={'base': sys.base_prefix, 'platbase': sys.base_prefix})['purelib']; "
             "print(sys.prefix, sys.prefix != sys.base_prefix, base in sys.path, pip)")
    first = _run(tmp_path, "python", "-c", probe)
    assert first.returncode == 0, first.stderr
    prefix, in_venv, sees_system, pip_version = first.stdout.split()
    assert os.path.realpath(prefix) == os.path.realpath(tmp_path / ".venv") and in_venv == "True"
    assert sees_system == "True", "the venv must see the system's site-packages (--system-site-packages)"
    assert pip_version
    assert "include-system-site-packages = true" in (tmp_path / ".venv" / "pyvenv.cfg").read_text()
    again = _run(tmp_path, "python", "-c", "import sys; print(sys.prefix)")  # reused, not recreated
    assert again.returncode == 0 and os.path.realpath(again.stdout.strip()) == os.path.realpath(tmp_path / ".venv")


def test_an_active_environment_or_PYTHON_is_used_instead(tmp_path):
    shutil.copy(REPO / "run", tmp_path / "run")
    chosen = sys.executable  # a real interpreter (a pyenv shim on PATH would report another path)
    out = _run(tmp_path, "python", "-c", "import sys; print(sys.executable)", env={"PYTHON": chosen})
    assert out.returncode == 0 and not (tmp_path / ".venv").exists()
    assert os.path.realpath(out.stdout.strip()) == os.path.realpath(chosen)


def test_ci_runs_the_readme_test_command_in_an_isolated_venv():
    """CI (`.ci/run`) calls the README's test command, in a .venv that does not see the system's packages:
    a test leaning on something installed on the CI image fails there, not on a user's fresh machine."""
    ci = (REPO / ".ci" / "run").read_text()
    readme = (REPO / "README.md").read_text()
    assert "./run test" in readme and ci.rstrip().splitlines()[-1] == "./run test"
    creates = [line.strip() for line in ci.splitlines() if "-m venv" in line]
    assert creates == ["python3 -m venv .venv"], creates  # no --system-site-packages
