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


def test_run_help_installs_nothing(tmp_path):
    shutil.copy(REPO / "run", tmp_path / "run")
    out = _run(tmp_path, "--help")
    assert out.returncode == 0 and "./run demo" in out.stdout and "./run test" in out.stdout
    assert not (tmp_path / ".venv").exists()  # no environment made, nothing installed
    assert _run(tmp_path, "nonsense").returncode == 2


def _deps(monkeypatch=None, stamps=None):
    """tools/deps.py as a module (its stamps in `stamps` when given)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("run_deps", REPO / "tools" / "deps.py")
    deps = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(deps)
    if stamps is not None:
        monkeypatch.setattr(deps, "STAMPS", stamps)
    return deps


def test_the_dependency_check_reads_metadata_and_a_stamp(monkeypatch, tmp_path):
    """What `./run` asks before installing: a stamp keyed by pyproject.toml, setup.py, the interpreter
    and the level (a higher level's stamp covers the lower ones), and every requirement installed in a
    version that satisfies it, from metadata alone."""
    deps = _deps(monkeypatch, tmp_path)
    assert deps.check("demo") == "first install"
    deps.stamp("test")
    assert deps.check("test") is None and deps.check("core") is None and deps.check("demo") is None
    (tmp_path / "installed-test").write_text("an older pyproject.toml")
    assert deps.check("demo") == "pyproject.toml or setup.py changed since the last install"
    deps.stamp("demo")
    assert deps.check("demo") is None  # the demo's stamp is not the tests'
    assert deps.check("test") == "only the demo packages are installed here, not the test ones"
    monkeypatch.setattr(deps, "requirements", lambda level: ["pillow", "no-such-distribution-x", "torch<1"])
    why = deps.check("demo")
    assert "no-such-distribution-x is not installed" in why and "does not satisfy <1" in why
    assert "pillow" not in why


def _closure(requirements: list[str]) -> set[str]:
    """The distributions `requirements` bring, as installed here (names normalised)."""
    import importlib.metadata as md

    from pip._vendor.packaging.requirements import Requirement
    found, todo = set(), [(Requirement(r), "") for r in requirements]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            continue
        name = dist.metadata["Name"].lower().replace("_", "-")
        if name in found and not req.extras:
            continue
        found.add(name)
        todo += [(Requirement(text), e) for text in dist.requires or [] for e in ("", *req.extras)]
    return found


def test_the_demo_runs_without_the_dependencies_it_does_not_install():
    """`./run demo` installs pyproject's demo-dependencies and vlm-sdk without its other dependencies. The
    demo (an image question on the tiny model) runs here with every module of those others made
    unimportable, as in an environment that lacks them (a package some dependency imports only when it
    is present falls back as it would there)."""
    import importlib.metadata as md
    import json
    deps = _deps()
    left_out = _closure(deps.requirements("test")) - _closure(deps.requirements("demo")) - {"vlm-sdk"}
    blocked = sorted(top for top, dists in md.packages_distributions().items()
                     if any(d.lower().replace("_", "-") in left_out for d in dists) and not top.startswith("_"))
    assert {"triton", "av", "llguidance", "aiohttp", "ray", "playwright"} <= set(blocked)
    probe = f"""
import importlib.abc, json, sys
BLOCKED = set({blocked!r})
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Absent())
from vlm_sdk.cli import main
print(json.dumps(main(["chat", "--max-tokens", "3", "--image", "samples/shapes.png", "What is it?"])))
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0 and json.loads(out.stdout.strip().splitlines()[-1]) == 0, out.stderr[-3000:]
    assert "generated 3" in out.stderr
