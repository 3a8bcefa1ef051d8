"""tools/gpu_check.sh, the device check, as far as a machine without a GPU can run it: its arguments,
the package staged outside the checkout (as on a bare device machine), and the folder it fills (what
the device tool brings back: at most 8 plain files, no subfolders, plain names)."""
import json
import os
import re
import subprocess
import sys

import pytest

from helpers import REPO

SCRIPT = REPO / "tools" / "gpu_check.sh"


def _run(*args, timeout=300, **env):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env={**os.environ, "PYTHON": sys.executable, **env})


@pytest.mark.parametrize("args, message", [
    (["--frobnicate"], "unknown argument '--frobnicate'"),
    (["--budget", "soon"], "--budget takes whole seconds, got 'soon'"),
    (["--budget", "30"], "--budget must be at least 60 seconds, got 30"),
    (["--only", "bench,lunch"], "unknown stage 'lunch' in --only; stages: env,bench,tests,multiturn,host"),
    (["--out"], "--out needs a folder")])
def test_bad_arguments_are_refused_with_what_to_give(tmp_path, args, message):
    run = _run(*args, "--out", str(tmp_path)) if args != ["--out"] else _run(*args)
    assert run.returncode == 2 and message in run.stderr, run.stderr
    assert not list(tmp_path.iterdir())  # nothing ran


def test_help_lists_the_stages_and_files():
    run = _run("--help")
    assert run.returncode == 0
    for word in ("--out", "--budget", "--only", "--wheels", "--cpu", "bench.json", "profile.txt", "cuda_tests.log"):
        assert word in run.stderr, word


def test_cpu_run_fills_one_flat_folder(tmp_path):
    out = tmp_path / "out"
    (tmp_path / "whl").mkdir()
    (tmp_path / "whl" / "broken-1.0-py3-none-any.whl").write_text("not a zip")
    run = _run("--cpu", "--only", "env,bench,host", "--budget", "300", "--out", str(out), "--wheels",
               str(tmp_path / "whl"))
    assert run.returncode == 0, run.stdout + run.stderr
    files = sorted(p.name for p in out.iterdir())
    assert files == ["bench.err", "bench.json", "env.log", "extra.log", "profile.txt", "summary.txt"]
    assert all(p.is_file() and re.fullmatch(r"[A-Za-z0-9._-]+", p.name) for p in out.iterdir())
    summary = (out / "summary.txt").read_text()
    for stage in ("env", "bench", "host"):
        assert re.search(rf"^{stage}: exit 0 in \d+ s$", summary, re.M), summary
    assert "wheels: pip could not install" in summary and "tests:" not in summary
    assert re.search(r"^total \d+ s of a 300 s budget", summary, re.M)
    env = (out / "env.log").read_text()
    staged = re.search(r"^vlm_sdk staged at (\S+)", env, re.M).group(1)
    assert not staged.startswith(str(REPO)) and "missing dependencies:" in env
    assert not os.path.exists(os.path.dirname(os.path.dirname(staged)))  # the staging folder is removed
    report = json.loads((out / "bench.json").read_text())
    assert report["preset"] == "tiny" and report["profile"]["path"] == str(out / "profile.txt")
    assert (out / "profile.txt").read_text().count("=== ") == 3
    assert "== host: vlm-sdk bench --host-overhead" in (out / "extra.log").read_text()
    # the short table comes last on stdout (a device call returns the end of the output)
    assert run.stdout.rstrip().splitlines()[-1].startswith("total ")
    assert "prefill, 224x224 image + text, cold" in run.stdout
