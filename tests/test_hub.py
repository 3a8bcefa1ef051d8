"""Models named by Hub id, offline, from a hub cache in huggingface_hub's own layout (blobs, snapshots
of symlinks, refs/main) under a temporary HF_HOME: the id resolves, `revision` picks a snapshot, a local
directory wins, and what cannot be found is a typed error that says where it looked."""
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import constants, scan_cache_dir

from vlm_sdk.errors import InvalidRequestError, ModelNotFoundError
from vlm_sdk.hub import display_name, is_hub_id, resolve_model

REPO = "TinyOrg/tiny-vl"
MAIN_SHA = "a" * 40
OLD_SHA = "b" * 40


def add_snapshot(hub_cache: Path, repo: str, sha: str, src: Path, ref: str | None = "main") -> Path:
    """`src`'s files as huggingface_hub stores a downloaded commit: content in blobs/<hash>, the snapshot
    a tree of relative symlinks to them, `ref` pointing at the commit."""
    repo_dir = hub_cache / ("models--" + repo.replace("/", "--"))
    snap = repo_dir / "snapshots" / sha
    for f in sorted(p for p in src.rglob("*") if p.is_file()):
        data = f.read_bytes()
        blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snap / f.relative_to(src)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    if ref:
        (repo_dir / "refs").mkdir(exist_ok=True)
        (repo_dir / "refs" / ref).write_text(sha)
    return snap


@pytest.fixture
def hub(tmp_path, tiny_ckpt, monkeypatch):
    """An offline hub cache under tmp HF_HOME holding REPO at main and at an older commit."""
    cache = tmp_path / "hf_home" / "hub"
    add_snapshot(cache, REPO, MAIN_SHA, tiny_ckpt)
    add_snapshot(cache, REPO, OLD_SHA, tiny_ckpt, ref=None)
    # huggingface_hub reads its environment once, at import: what HF_HOME/HF_HUB_OFFLINE set it to
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_the_cache_is_huggingface_hubs_own_layout(hub):
    repos = {r.repo_id: r for r in scan_cache_dir(hub).repos}
    assert {r.commit_hash for r in repos[REPO].revisions} == {MAIN_SHA, OLD_SHA}


def test_id_resolves_to_its_snapshot_and_revision_picks_another(hub):
    assert resolve_model(REPO) == str(hub / f"models--TinyOrg--tiny-vl/snapshots/{MAIN_SHA}")
    assert resolve_model(REPO, revision=OLD_SHA).endswith(OLD_SHA)
    assert (Path(resolve_model(REPO)) / "config.json").is_file()


def test_missing_id_offline_says_where_it_looked_and_what_to_do(hub):
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model("TinyOrg/not-there")
    msg = str(e.value)
    assert str(hub) in msg and "HF_HUB_OFFLINE" in msg and "hf download TinyOrg/not-there" in msg
    assert (e.value.repo_id, e.value.cache_dir) == ("TinyOrg/not-there", str(hub))
    with pytest.raises(ModelNotFoundError, match="revision 'v9'"):
        resolve_model(REPO, revision="v9")


def test_local_directory_wins_over_an_id_of_the_same_spelling(hub, tmp_path, monkeypatch):
    (tmp_path / "TinyOrg" / "tiny-vl").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not is_hub_id(REPO)
    assert resolve_model(REPO) == REPO
    with pytest.raises(InvalidRequestError, match="local path") as e:
        resolve_model(REPO, revision="main")
    assert e.value.param == "revision"


def test_paths_are_not_ids():
    for path in ("./a/b", "/abs/x", "a/b/c", "~/x/y", "name", "a/../b"):
        assert not is_hub_id(path), path
    assert is_hub_id("Qwen/Qwen2.5-VL-3B-Instruct")
    assert display_name("Qwen/Qwen2.5-VL-3B-Instruct") == "Qwen/Qwen2.5-VL-3B-Instruct"


def test_plan_takes_an_id_and_reads_its_config_only(hub, capsys):
    from vlm_sdk.cli import main
    assert main(["plan", REPO, "--revision", OLD_SHA, "--device-memory", "24GiB", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config_path"].startswith(str(hub / "models--TinyOrg--tiny-vl" / "snapshots" / OLD_SHA))
    assert main(["plan", "TinyOrg/not-cached", "--device-memory", "24GiB"]) == 2
    assert "not in the hub cache" in capsys.readouterr().err


def test_llm_runs_from_an_id(hub):
    from vlm_sdk import LLM, SamplingParams
    with LLM(REPO, revision=OLD_SHA, num_blocks=16, allow_unfit_images=True) as llm:
        assert str(llm.engine.checkpoint.model_dir).endswith(OLD_SHA)
        out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2, temperature=0))
    assert len(out[0].token_ids) == 2


def test_serve_an_id_offline_under_its_name(tmp_path, tiny_ckpt, monkeypatch):
    """`vlm-sdk serve Org/Name` with the real environment variables: served under the id by default."""
    from helpers import start_server
    home = tmp_path / "home"
    add_snapshot(home / "hub", REPO, MAIN_SHA, tiny_ckpt)
    monkeypatch.setenv("HF_HOME", str(home))  # start_server passes this process's environment on
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    proc, url = start_server([sys.executable, "-m", "vlm_sdk.cli", "serve", REPO, "--port", "0",
                              "--num-blocks", "16", "--allow-unfit-images"], timeout=120)
    try:
        import urllib.request
        models = json.load(urllib.request.urlopen(url + "/v1/models", timeout=30))
        assert [m["id"] for m in models["data"]] == [REPO]
        body = {"model": REPO, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        assert json.load(urllib.request.urlopen(req, timeout=60))["usage"]["completion_tokens"] == 2
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_serve_a_missing_id_offline_exits_with_the_typed_message(tmp_path):
    env = {**os.environ, "HF_HOME": str(tmp_path / "empty"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    done = subprocess.run([sys.executable, "-m", "vlm_sdk.cli", "serve", "TinyOrg/not-there", "--port", "0"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert str(tmp_path / "empty" / "hub") in done.stderr and "HF_HUB_OFFLINE" in done.stderr


def test_served_model_name_overrides_the_id():
    from vlm_sdk.server.config import ServerConfig
    from vlm_sdk.server.runner import served_name
    assert served_name(REPO, ServerConfig()) == REPO
    assert served_name(REPO, ServerConfig(served_model_name="m")) == "m"
