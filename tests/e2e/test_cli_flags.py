"""The command line as a new user meets it (issue 52): help that answers without importing torch, short
and grouped for `serve` and `chat`, every flag with its help and default and no internal issue number;
vLLM's flag names where the meaning is the same (the README table is VLLM_NAMES); an unknown flag answered
with the closest known ones; `chat`'s engine flags are `serve`'s (one definition)."""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import pytest

from helpers import REPO
from vlm_sdk.cli import build_parser, main
from vlm_sdk.server.engine_flags import engine_kwargs
from vlm_sdk.server.parser import COMMON, parse_with_hints
from vlm_sdk.server.vllm_names import VLLM_NAMES, apply_vllm_names

COMMANDS = ("chat", "serve", "plan", "bench", "bench-serve")


def _imported(argv: list[str]) -> tuple[int, set[str], str]:
    """(exit status, modules imported, stdout) of `python -X importtime -m vlm_sdk.cli ARGV` in a child."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "vlm_sdk.cli", *argv], capture_output=True,
                         text=True, timeout=120, cwd=REPO)
    modules = {line.rsplit("|", 1)[1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    return out.returncode, modules, out.stdout


@pytest.mark.parametrize("argv", [["--help"], *[[c, "--help"] for c in COMMANDS], ["serve", "--help", "all"],
                                  ["serve", "--bogus-flag"], ["chat", "--image", "/nonexistent.png", "hi"]])
def test_help_and_refusals_import_no_torch(argv):
    """What makes `--help` take 7-13 s (torch, transformers) is not imported for it, nor for a refused
    flag or a missing input file (-X importtime lists every module the process imported)."""
    code, modules, out = _imported(argv)
    assert code == (0 if "--help" in argv else 2), out
    heavy = sorted(m for m in modules if m.split(".")[0] in ("torch", "transformers", "triton", "ray", "numpy"))
    assert not heavy, heavy[:10]


def _parsers() -> dict[str, argparse.ArgumentParser]:
    return build_parser()[1]


def test_every_flag_has_help_with_its_default_and_no_issue_number():
    for name, parser in _parsers().items():
        for action in parser._actions:
            if not action.option_strings or action.dest == "help":
                continue
            flag = action.option_strings[0]
            assert action.help and action.help != argparse.SUPPRESS, f"{name} {flag} has no help"
            assert not re.search(r"\bissues? \d", action.help), f"{name} {flag}: {action.help}"
            # a switch too: "(default off)" is what tells a mode switch from one that is on unless turned off
            assert "default" in action.help, f"{name} {flag}'s help does not say its default: {action.help}"
        for group in parser._action_groups:
            assert not re.search(r"\bissues? \d", group.title or ""), f"{name}: group {group.title!r}"


def test_serve_help_is_short_grouped_and_all_of_it_is_one_flag_away(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    brief = capsys.readouterr().out
    assert len(brief.splitlines()) < 90, len(brief.splitlines())
    assert "--host" in brief and "127.0.0.1" in brief and "every interface" in brief
    assert "--port" in brief and "default 8000" in brief
    assert "more options, by group" in brief and "engine: memory and KV cache" in brief
    with pytest.raises(SystemExit):
        main(["serve", "--help", "all"])
    full = capsys.readouterr().out
    for action in _parsers()["serve"]._actions:
        assert all(s in full for s in action.option_strings), action.option_strings
    with pytest.raises(SystemExit):
        main(["serve", "--help", "media"])
    media = capsys.readouterr().out
    assert "--allowed-media-domains" in media and "--num-blocks" not in media


def test_chat_takes_the_engine_flags_of_serve():
    """One definition: every engine flag of `serve` is a flag of `chat` (the request's --seed aside)."""
    parsers = _parsers()

    def engine_flags(parser):
        return {s for a in parser._actions if a.dest.startswith("engine_") for s in a.option_strings}
    assert engine_flags(parsers["serve"]) - {"--seed"} == engine_flags(parsers["chat"]) - {"--seed"}
    assert {"--num-blocks", "--max-model-len", "--revision", "--kv-cache-dtype"} <= engine_flags(parsers["chat"])
    args = parse_with_hints(build_parser()[0], ["chat", "--num-blocks", "9", "--max-model-len", "512", "--system",
                                                "Be brief.", "--quiet", "hi"], parsers)
    assert engine_kwargs(args) == {"num_blocks": 9, "max_model_len": 512}
    assert args.system == "Be brief." and args.quiet and args.seed is None


def test_vllm_names_mean_ours():
    parser, commands = build_parser()
    args = parse_with_hints(parser, [
        "serve", "--model", "m", "--gpu-memory-utilization", "0.5", "-tp", "2", "--num-gpu-blocks-override", "8",
        "--kv-cache-memory-bytes", "1048576", "--mm-processor-kwargs", '{"max_pixels": 200704}',
        "--limit-mm-per-prompt", "image=3,video=0", "-dp", "2", "--trust-remote-code"], commands)
    apply_vllm_names(args)
    assert args.model_flag == "m" and args.data_parallel_size == 2
    assert (args.limit_images, args.limit_videos) == (3, 0)
    assert engine_kwargs(args) == {"memory_utilization": 0.5, "tensor_parallel_size": 2, "num_blocks": 8,
                                   "kv_cache_memory": "1048576B", "mm_processor_kwargs": {"max_pixels": 200704}}
    json_limits = parse_with_hints(parser, ["serve", "--limit-mm-per-prompt", '{"image": 1}'], commands)
    apply_vllm_names(json_limits)
    assert json_limits.limit_images == 1 and json_limits.limit_videos == 2  # the other keeps its default
    planned = parse_with_hints(parser, ["plan", "m", "--gpu-memory-utilization", "0.5", "-tp", "2",
                                        "--num-gpu-blocks-override", "8", "--kv-cache-memory-bytes", "4096"], commands)
    assert (planned.memory_utilization, planned.tp, planned.num_blocks, planned.kv_cache_memory) == (0.5, 2, 8, "4096B")
    # the values reach the engine's own parsing unchanged in meaning
    from vlm_sdk.models import registry
    engine = registry.engine_args(**engine_kwargs(args))
    assert engine.kv_cache_memory == 1048576 and dict(engine.mm_processor_kwargs) == {"max_pixels": 200704}


@pytest.mark.parametrize("argv, hint", [
    (["serve", "--chat-template", "t.jinja"], "--chat-template is vLLM's; the checkpoint's own chat template"),
    (["serve", "-q", "awq"], "quantization_config: nothing to set"),
    (["serve", "--gpu-memory-utilisation", "0.5"], "did you mean --gpu-memory-utilization or --memory-utilization?"),
    (["chat", "--port", "8000", "hi"], "--port is a flag of `vlm-sdk serve`, not of `vlm-sdk chat`"),
    (["chat", "--enable-auto-tool-choice", "hi"], "is vLLM's, for `vlm-sdk serve`"),
    (["plan", "m", "--device-memory", "8GiB", "--max-num-seq", "4", "--prompt-tokns", "9"],
     "--prompt-tokns: did you mean --prompt-tokens"),
    (["serve", "--frobnicate"], "--frobnicate: no such flag; --help lists them"),
])
def test_an_unknown_flag_is_answered_with_what_to_use(argv, hint, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments" in err and hint in err, err


def test_the_readme_table_is_vllm_names():
    """One row per VLLM_NAMES entry, in order, its kind and commands as the code has them; each name is a
    flag of exactly the commands its row lists (a refused one of none), and the `ours` of an alias is a
    flag of the same action."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("### vLLM's flag names", 1)[1].split("\n#", 1)[0]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| `")]
    assert [row[0].strip("`") for row in rows] == [n.flag for n in VLLM_NAMES]
    parsers = _parsers()
    for (_, here, kind, on, note), name in zip(rows, VLLM_NAMES):
        assert kind == name.kind and on == "/".join(name.commands), (name.flag, kind, on)
        assert _words(note) == _words(name.note), (note, name.note)
        for command in ("serve", "chat", "plan"):
            listed = command in name.commands and name.kind != "refused"
            own = f"`{command}` has `{name.flag}` itself" in here  # ours too there, with our meaning
            assert (name.flag in _options(parsers[command])) == (listed or own), (name.flag, command)
        if name.kind == "alias" and here.startswith("`--"):
            ours = here.split("`")[1]
            for command in name.commands:
                action = next(a for a in parsers[command]._actions if name.flag in a.option_strings)
                assert ours in action.option_strings, (name.flag, command, action.option_strings)


def _words(text: str) -> str:
    """A note as the README writes it (code in backticks, JSON in double quotes) or as the code does."""
    return " ".join(re.sub("[`'\"]", "", text).split())


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def test_chat_inputs_are_checked_before_the_model_loads(tmp_path, capsys):
    assert main(["chat", "--image", str(tmp_path / "missing.png"), "hi"]) == 2
    assert "image file not found" in capsys.readouterr().err
    assert main(["chat", "--video", str(tmp_path), "hi"]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert main(["chat", "--url", "localhost:8000", "hi"]) == 2
    assert "is not an http(s) URL" in capsys.readouterr().err
    assert main(["chat", "--url", "http://127.0.0.1:9", "--num-blocks", "4", "hi"]) == 2
    assert "--num-blocks has no effect with --url" in capsys.readouterr().err


def test_chat_system_and_quiet(tiny_ckpt, capsys):
    """--system reaches the prompt (more prompt tokens, the same greedy tokens for the same prompt);
    --quiet prints the answer alone; the engine's flags apply (the cache of --num-blocks)."""
    base = ["chat", "--model", str(tiny_ckpt), "--max-tokens", "4", "--num-blocks", "32"]
    assert main([*base, "hi"]) == 0
    plain = capsys.readouterr()
    system_text = "You are a terse assistant for a shop's catalogue team: answer every question in one word only."
    assert main([*base, "--system", system_text, "hi"]) == 0
    system = capsys.readouterr()
    tokens = [int(re.search(r"prompt tokens (\d+)", e).group(1)) for e in (plain.err, system.err)]
    assert tokens[1] > tokens[0] + 10, tokens  # the template's default system prompt is replaced by a longer one
    assert "KV blocks used" in plain.err and "/32 at peak" in plain.err
    assert "memory report" in plain.err and "ready" in plain.err
    assert main([*base, "--quiet", "hi"]) == 0
    quiet = capsys.readouterr()
    assert quiet.out == plain.out and "[vlm-sdk]" not in quiet.err, quiet.err


def test_no_effect_names_say_so(capsys):
    args = parse_with_hints(build_parser()[0], ["serve", "--trust-remote-code", "--enable-auto-tool-choice"],
                            _parsers())
    apply_vllm_names(args)
    err = capsys.readouterr().err
    assert "--trust-remote-code has no effect here" in err and "--enable-auto-tool-choice has no effect here" in err


def test_kv_cache_memory_bytes_takes_vllm_bytes_and_units():
    parser, commands = build_parser()
    for value, expected in (("4096", "4096B"), ("8GiB", "8GiB")):
        args = parse_with_hints(parser, ["serve", "--kv-cache-memory-bytes", value], commands)
        assert engine_kwargs(args)["kv_cache_memory"] == expected
    with pytest.raises(SystemExit):
        parse_with_hints(parser, ["serve", "--limit-mm-per-prompt", "audio=1"], commands)
    with pytest.raises(SystemExit):
        parse_with_hints(parser, ["serve", "--mm-processor-kwargs", json.dumps([1])], commands)


def test_common_groups_hold_the_common_flags():
    for name in ("serve", "chat"):
        parser = _parsers()[name]
        common = next(g for g in parser._action_groups if g.title == COMMON)
        flags = {s for a in common._group_actions for s in a.option_strings}
        assert {"--max-model-len", "--num-blocks", "--device"} <= flags, (name, flags)


def test_serve_inputs_are_checked_before_the_model_loads(tmp_path):
    """A port in use or out of range, a model path that is not there (serve, chat, the benchmarks), a media
    directory that is not one, a URL given as a media domain, bench-serve's URL and image: each refused
    before torch is imported (so before anything loads)."""
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = [(["serve", "--port", str(port)], f"cannot listen on 127.0.0.1:{port}"),
                 (["serve", str(tmp_path / "nowhere")], "no such file or directory, and not a Hugging Face Hub id"),
                 (["serve", str(tmp_path)], "is a directory without config.json"),
                 (["serve", "--allowed-local-media-path", str(tmp_path / "x")], "is not a directory"),
                 (["serve", "--allowed-media-domains", "https://example.com"], "takes host names"),
                 (["chat", "--model", str(tmp_path / "nowhere"), "hi"], "no such file or directory"),
                 (["serve", "--port", "70000"], "a TCP port is 0-65535"),  # was OverflowError after loading
                 (["bench", "--model", str(tmp_path / "nowhere")], "no such file or directory"),
                 (["bench-serve", "--model", str(tmp_path / "nowhere")], "no such file or directory"),
                 (["bench-serve", "--url", "localhost:8000"], "is not an http(s) URL"),
                 (["bench-serve", "--image", str(tmp_path / "x.png")], "image file not found")]
        for argv, message in cases:
            out = subprocess.run([sys.executable, "-X", "importtime", "-m", "vlm_sdk.cli", *argv],
                                 capture_output=True, text=True, timeout=120, cwd=REPO)
            errors = [line for line in out.stderr.splitlines() if not line.startswith("import time:")]
            imported = {line.rsplit("|", 1)[1].strip().split(".")[0] for line in out.stderr.splitlines()
                        if line.startswith("import time:")}
            assert out.returncode == 2 and any(message in line for line in errors), (argv, errors)
            assert "torch" not in imported, argv
