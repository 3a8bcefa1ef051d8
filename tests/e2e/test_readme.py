"""The README is true: its examples are run, and what it shows is what the code prints (issue 52).

- `>>>` blocks run as written (from the repository root) and raise exactly the error shown;
- Python blocks run on the tiny checkpoint with the README's placeholders (model paths, cat.jpg, clip.mp4,
  the server's URL) swapped for the tiny model, the sample image, a short clip and a server of the tiny
  model; those that need GPUs or a Ray cluster are named in NOT_RUN with the test that covers them;
- a plain block that starts with a `vlm-sdk plan` command shows an excerpt of that command's output;
- every `vlm-sdk` command line in a bash block or an inline code span parses with the command line's own
  parser (its flags exist), and those that run on the tiny models run;
- figures the prose quotes are computed here the same way;
- every link points inside the repository.
"""
from __future__ import annotations

import ast
import asyncio
import re
import shlex

import pytest

from helpers import REPO
from vlm_sdk.cli import build_parser, main
from vlm_sdk.errors import VLMError
from vlm_sdk.plan import plan
from vlm_sdk.server.parser import parse_with_hints

README = (REPO / "README.md").read_text()
CONFIGS = REPO / "tests" / "configs"
# blocks that need more than one CPU machine holds, by a phrase of theirs, and what covers them instead
NOT_RUN = {
    "Qwen2.5-VL-72B-Instruct-AWQ": "40 GiB of weights (its plan is the next block, checked below)",
    "tensor_parallel_size=4": "4 GPUs (tests/executor/test_tensor_parallel.py runs 2 ranks on the CPU)",
    "pipeline_parallel_size=2": "8 GPUs (tests/executor/test_pipeline_parallel.py runs 2 stages x 2 ranks on the CPU)",
    "serve_replicas(model": "a Ray cluster (tests/replicas/test_replicas.py serves 3 replicas on the CPU)",
}
# the tiny-model runs of the README's bash lines, besides parsing every one
RUN_LINES = ('vlm-sdk chat --family internvl --image samples/shapes.png "What is it?"',
             'vlm-sdk chat --family qwen3_vl --image samples/shapes.png "What is it?"')


def _blocks() -> list[tuple[str, str]]:
    return re.findall(r"^```(\w*)\n(.*?)^```", README, re.S | re.M)


def _normal(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture(scope="module")
def readme_env(tmp_path_factory):
    """The tiny model (the demo's own, built once), a clip, and the names the examples use."""
    mp = pytest.MonkeyPatch()
    cache = tmp_path_factory.mktemp("readme_cache")
    mp.setenv("VLM_SDK_CACHE", str(cache))
    mp.chdir(REPO)  # the examples' relative paths (samples/shapes.png)
    from vlm_sdk.demo_checkpoint import tiny_model_dir
    from vlm_sdk.testing.videos import write_video
    clip = cache / "clip.mp4"
    write_video(clip, frames=16, fps=8, width=96, height=64)
    yield {"tiny": str(tiny_model_dir()), "clip": str(clip)}
    mp.undo()


def test_doctest_blocks_raise_what_they_show(readme_env):
    """In order, in one namespace (the first defines `tiny`, as a reader's session would)."""
    from vlm_sdk import LLM
    namespace = {"LLM": LLM}
    shown = [body for lang, body in _blocks() if body.lstrip().startswith(">>> ")]
    assert len(shown) == 2
    for body in shown:
        code, expected = [], []
        for line in body.splitlines():
            if line.startswith((">>> ", "... ")):
                code.append(line[4:])
            elif line.strip():
                expected.append(line)
        statements = ast.parse("\n".join(code)).body
        exec(compile(ast.Module(statements[:-1], []), "README", "exec"), namespace)
        with pytest.raises(VLMError) as raised:
            exec(compile(ast.Module(statements[-1:], []), "README", "exec"), namespace)
        got = f"{type(raised.value).__name__}: {raised.value}"
        assert _normal(got) == _normal("\n".join(expected)), got


@pytest.fixture(scope="module")
def server(readme_env):
    """The server the client example talks to: the tiny model, with the README's api key."""
    from vlm_sdk.server.background import BackgroundServer
    from vlm_sdk.server.config import ServerConfig
    with BackgroundServer(readme_env["tiny"], ServerConfig(port=0, api_key="sk-local"), show_progress=False) as s:
        yield s


def test_python_blocks_run_on_the_tiny_model(readme_env, server, capsys):
    from vlm_sdk import LLM
    tiny, shapes = readme_env["tiny"], str(REPO / "samples" / "shapes.png")
    swaps = {'"/models/Qwen2.5-VL-3B-Instruct"': repr(tiny), '"cat.jpg"': repr(shapes),
             '"clip.mp4"': repr(readme_env["clip"]), '"http://127.0.0.1:8000"': repr(server.url),
             "[9707, 11]": "[97, 11]"}  # Qwen's ids of "Hello," -> ids inside the tiny model's vocabulary
    shared = LLM(tiny, show_progress=False)  # one engine for every block that makes an LLM of the tiny model

    def llm(model, **kwargs):
        return shared if model == tiny and not kwargs else LLM(model, **kwargs)
    namespace = {"model": tiny, "messages": [{"role": "user", "content": "Hello"}],
                 "conversation": [{"role": "user", "content": [{"type": "image", "image": shapes},
                                                               {"type": "text", "text": "What is in it?"}]}]}
    ran = 0
    for lang, body in _blocks():
        if lang != "python" or body.lstrip().startswith(">>> "):
            continue
        if any(phrase in body for phrase in NOT_RUN):
            continue
        for old, new in swaps.items():
            body = body.replace(old, new)
        assert "/models/" not in body, body  # a placeholder left that would not run
        code = compile(body, "README", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        namespace["LLM"] = llm
        result = eval(code, namespace)
        if asyncio.iscoroutine(result):
            asyncio.run(result)
        ran += 1
    assert ran == 4  # the API (LLM and AsyncLLM), video, prefix caching, the client
    assert namespace["outs"][0].finish_reason in ("stop", "length")
    assert namespace["second"].num_cached_tokens > 0  # the follow-up was served from the prefix cache
    assert namespace["done"].text and namespace["result"].text is not None
    assert len([b for lang, b in _blocks() if lang == "python" and any(p in b for p in NOT_RUN)]) == len(NOT_RUN)
    capsys.readouterr()


def _command(lines: list[str]) -> tuple[list[str], list[str]]:
    """(the command's argv, the rest) of a block that starts with a command (continued by backslashes)."""
    text, rest = "", list(lines)
    while rest:
        line = rest.pop(0)
        text += line.rstrip("\\").split("  #")[0] + " "
        if not line.rstrip().endswith("\\"):
            break
    return shlex.split(text), rest


def _entries(lines: list[str]) -> list[str]:
    """An output excerpt's entries: a line that starts a row or a list item, with its continuation lines."""
    out: list[str] = []
    for line in lines:
        if out and (line.startswith("    ") or (line.startswith(" ") and not line.lstrip().startswith("- "))):
            out[-1] += " " + line
        else:
            out.append(line)
    return out


def test_plan_excerpts_are_the_plan_s_output(capsys):
    shown = [body for lang, body in _blocks() if not lang and body.startswith("vlm-sdk plan ")]
    assert len(shown) == 4
    for body in shown:
        argv, excerpt = _command(body.splitlines())
        main(argv[1:])
        out = _normal(capsys.readouterr().out)
        for entry in _entries(excerpt):
            for piece in _normal(entry).split("..."):
                assert piece.strip() in out, f"{argv}: {piece.strip()!r} is not in its output"


def _readme_commands() -> list[str]:
    """`vlm-sdk ...` command lines of the bash blocks and the inline code spans (not the ones with
    placeholders: [optional] parts, a|b choices, ...)."""
    lines = []
    for lang, body in _blocks():
        if lang == "bash":
            joined = body.replace("\\\n", " ")
            lines += [line.split("  #")[0].strip() for line in joined.splitlines()]
    lines += re.findall(r"`(vlm-sdk [^`]+)`", README)
    return [line for line in lines if line.startswith("vlm-sdk ") and len(line.split()) > 2  # not `vlm-sdk plan`
            and not re.search(r"[\[|]|\.\.\.", line)]


def test_every_vlm_sdk_command_line_parses():
    parser, commands = build_parser()
    lines = _readme_commands()
    assert len(lines) >= 25
    for line in lines:
        argv = shlex.split(line)[1:]
        if argv[-1:] == ["--help"]:
            continue
        parse_with_hints(parser, argv, commands)  # an unknown flag exits (SystemExit) naming it


@pytest.mark.parametrize("line", RUN_LINES)
def test_the_tiny_model_lines_run(line, readme_env, capsys):
    assert line in _readme_commands()
    assert main(shlex.split(line)[1:]) == 0
    assert "RANDOM weights" in capsys.readouterr().err


def test_the_figures_the_prose_quotes():
    """Each figure is computed as the README says it was."""
    internvl = plan(CONFIGS / "internvl2_8b.json", device_memory="24GiB", block_size=64, prompt_tokens=118,
                    images=1, output_tokens=0)
    moe = plan(CONFIGS / "qwen3_vl_30b_a3b.json", device_memory="80GiB")
    claims = {
        f"the plan gives {internvl.num_blocks} blocks = {internvl.capacity_tokens:,}\ntokens, "
        f"{internvl.max_concurrent_requests} such requests at once, and no problems": not internvl.problems,
        f"is {moe.weights_bytes / 2e9:.2f}B parameters = {moe.weights_bytes / 1e9:.1f} GB in bf16": True,
        f"with {moe.capacity_tokens:,} tokens of KV cache": not moe.problems,
    }
    for text, holds in claims.items():
        assert _normal(text) in _normal(README) and holds, text


def test_every_link_points_inside_the_repository():
    links = re.findall(r"\]\(([^)]+)\)", README)
    assert links
    for target in links:
        assert not re.match(r"[a-z]+://", target), target
        path = (REPO / target.split("#")[0]).resolve()
        assert path.is_relative_to(REPO) and path.exists(), target
    assert "../" not in README
