"""One vocabulary (issue 20, point 3, rows 3 and 9 of its table): `plan`'s options are the engine's
settings (InternVL's image option is `--max-dynamic-patch`, as in `vlm-sdk serve` and `LLM(...)`), a fix
`plan` prints pastes into the serve parser and `LLM(...)` and the request then generates all its
max_tokens; `plan --help` describes every option."""
import argparse
import re
import shlex

import pytest

from helpers import TESTS, image
from vlm_sdk import LLM, SamplingParams
from vlm_sdk.cli import main
from vlm_sdk.models import registry
from vlm_sdk.plan import plan
from vlm_sdk.plan.flags import add_plan_parser
from vlm_sdk.server.cli import add_serve_parser, engine_kwargs

INTERNVL2_8B = TESTS / "configs" / "internvl2_8b.json"
TEXT = "What is it?"


def _parser(add) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlm-sdk")
    add(parser.add_subparsers(dest="command"))
    return parser


def _printed_fixes(message: str) -> list[list[str]]:
    """The `--flag value` alternatives of a plan problem ("fix with one of: --a 1; --b 2")."""
    return [shlex.split(alt) for alt in message.split("fix with one of: ")[1].split(";")]


def _conv():
    return [{"role": "user", "content": [{"type": "image", "image": image(1800, 300, 4)},
                                         {"type": "text", "text": TEXT}]}]


def test_internvl_plan_option_is_the_engine_setting(capsys):
    for family in registry.families():
        option, setting = family.plan_setting
        assert option == setting
    assert main(["plan", str(INTERNVL2_8B), "--device-memory", "24GiB", "--block-size", "64",
                 "--kv-cache-memory", "172MiB", "--max-dynamic-patch", "4", "--json"]) == 0
    assert '"largest_image": "max_dynamic_patch 4: 5 tiles' in capsys.readouterr().out
    with pytest.raises(SystemExit):  # not a plan option any more: max_num is only an image part's field
        _parser(add_plan_parser).parse_args(["plan", "m", "--max-num", "4"])


def test_a_printed_image_fix_pastes_into_serve_and_llm_and_the_request_generates_all_its_tokens(internvl_ckpt):
    """Plan a tiny InternVL with a 40-block cache and a request of 1 wide image + text + 32 output tokens:
    the image (7 tiles, 1,792 tokens) does not fit; plan prints `--max-dynamic-patch 1`. That flag,
    parsed by the serve parser, starts an engine on which the request generates all 32 tokens."""
    llm = LLM(internvl_ckpt, device="cpu", show_progress=False, num_blocks=512)
    prompt = llm.engine.inputs.build_prompt(_conv())
    text_tokens = len(prompt.token_ids) - sum(prompt.image_tokens)
    assert prompt.image_tokens == [1792] and text_tokens + 32 < 40 * 16 < 1792  # the image alone does not fit
    p = plan(internvl_ckpt, device="cpu", num_blocks=40, prompt_tokens=text_tokens, images=1, output_tokens=32)
    [problem] = [pr for pr in p.problems if "does not fit: the longest request" in pr.message]
    assert problem.fixes["max_dynamic_patch"] == 1
    [flags] = [alt for alt in _printed_fixes(problem.message) if alt[0] == "--max-dynamic-patch"]
    assert flags == ["--max-dynamic-patch", "1"]

    args = _parser(add_serve_parser).parse_args(["serve", str(internvl_ckpt), "--num-blocks", "40", *flags])
    kwargs = engine_kwargs(args)
    assert kwargs == {"num_blocks": 40, "max_dynamic_patch": 1}
    assert registry.engine_args(**kwargs).mm_processor_kwargs == {"max_dynamic_patch": 1}
    fixed = LLM(internvl_ckpt, device="cpu", show_progress=False, **kwargs)
    out = fixed.chat(_conv(), SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 32 and out.finish_reason == "length"
    assert not plan(internvl_ckpt, device="cpu", prompt_tokens=text_tokens, images=1, output_tokens=32,
                    **problem.fixes | {"num_blocks": 40}).problems


def test_every_printed_cache_fix_is_accepted_by_serve_and_the_engine():
    """The LMDeploy seed in plan: each alternative it prints is an engine setting that parses with the
    serve parser and passes the engine's argument check; --kv-cache-memory (432MiB) also gives plan the
    fixed cache."""
    p = plan(INTERNVL2_8B, device_memory="24GiB", block_size=64, kv_cache_memory="180709785B",
             prompt_tokens=118, images=1, output_tokens=0)
    [problem] = [pr for pr in p.problems if "3446 tokens" in pr.message]
    alternatives = _printed_fixes(problem.message)
    assert [a[0] for a in alternatives] == ["--kv-cache-memory", "--num-blocks", "--kv-cache-dtype",
                                            "--max-dynamic-patch"]
    serve = _parser(add_serve_parser)
    for flag, value in alternatives:
        name = flag[2:].replace("-", "_")
        kwargs = engine_kwargs(serve.parse_args(["serve", "m", flag, value]))
        args = registry.engine_args(**kwargs)  # accepted by the engine's own argument check
        if name == "kv_cache_memory":
            assert value == "432MiB" and args.kv_cache_memory == problem.fixes[name] == 432 << 20
            assert plan(INTERNVL2_8B, device_memory="24GiB", block_size=64, kv_cache_memory=value,
                        prompt_tokens=3446).max_concurrent_requests == 1
        elif name == "kv_cache_dtype":  # a lower-precision cache in the same bytes (int4: 74 blocks >= 54)
            assert kwargs == {name: value} == {name: problem.fixes[name]} == {name: "int4"}
        else:
            assert kwargs == {name: int(value)} == {name: problem.fixes[name]}


def test_plan_help_describes_every_option(capsys):
    parser = _parser(add_plan_parser)
    plan_cmd = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["plan"]
    undescribed = [a.option_strings or a.dest for a in plan_cmd._actions if not (a.help or "").strip()]
    assert undescribed == []
    by_flag = {s: a.help for a in plan_cmd._actions for s in a.option_strings}
    assert "TEXT tokens" in by_flag["--prompt-tokens"] and "largest allowed size" in by_flag["--prompt-tokens"]
    assert "largest allowed size" in by_flag["--images"]
    assert "unit" in by_flag["--device-memory"] and "unit" in by_flag["--kv-cache-memory"]
    assert "share of TOTAL device memory" in by_flag["--memory-utilization"]
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = re.sub(r"\s+", " ", capsys.readouterr().out)
    for piece in ("--max-dynamic-patch", "--max-pixels", "--device-memory 24GiB", "--device cpu",
                  "counted at the largest allowed size", "no GPU"):
        assert piece in text, piece
