"""Issue 20, engine rows: a fix printed by one entry point, pasted into the other, makes the request
run with all its max_tokens. `LLM(...)` takes the printed `name=value` settings, `vlm-sdk serve` the
printed flags (parsed by serve's own argument parser; the server runs in-process).

    row 2   tiny InternVL, --num-blocks 20 --block-size 64, a 1812-token image prompt, max_tokens 64:
            the fix used to be num_blocks=29 (1856 tokens: the request stopped at 44); now 30
    row 4   kv_cache_memory takes units everywhere ("1MiB", --kv-cache-memory 1MiB); a unitless
            string is refused with an example; an int stays bytes in Python
    row 7   a max_model_len that cannot hold the largest allowed image refuses to start, naming the
            image setting and the cache / max_model_len that would; --allow-unfit-images warns instead
    row 11  memory_utilization set on the CPU is refused, not ignored
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import logging
import re
import shlex

import pytest

from helpers import image
from server_helpers import data_url, image_message, post
from vlm_sdk import LLM, SamplingParams
from vlm_sdk.cli import main
from vlm_sdk.errors import InputTooLongError, InvalidRequestError, UnfitImagesError
from vlm_sdk.server.background import BackgroundServer
from vlm_sdk.server.cli import add_serve_arguments, engine_kwargs
from vlm_sdk.server.config import ServerConfig

ROW2 = ["--num-blocks", "20", "--block-size", "64"]
QUESTION = "What is in this image?"


def _conv(img):
    return [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": QUESTION}]}]


def _big():
    return image(900, 600, 7)  # 3:2: six tiles and a thumbnail under max_num 6 = 1792 image tokens


def printed_fixes(message: str) -> tuple[list[dict], list[list[str]]]:
    """The fixes a message prints: as LLM keyword arguments (each `name=value` a dict) and as flags."""
    m = re.search(r"makes it fit[^:]*: (.*?) \(flags: (.*?)\)", message)
    assert m, message
    kwargs = []
    for part in m.group(1).split("; "):
        name, value = part.split("=", 1)
        kwargs.append({name: ast.literal_eval(value)})
    flags = [shlex.split(f) for f in m.group(2).split(" | ")]
    assert len(kwargs) == len(flags)
    return kwargs, flags


@contextlib.contextmanager
def serve(model, flags: list[str]):
    """`vlm-sdk serve MODEL FLAGS` in-process: serve's parser turns the flags into engine arguments."""
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args([str(model), *flags])
    with BackgroundServer(model, ServerConfig(port=0), **engine_kwargs(args)) as srv:
        yield srv


def _ask(srv, img, **body):
    return post(srv.url, {"model": srv.model_name, "messages": image_message(data_url(img), QUESTION),
                          "temperature": 0, "ignore_eos": True, **body}, key=None)


# -- row 2: the fix fits the prompt and its max_tokens ----------------------------------------------

def test_row2_http_400_fix_pasted_into_llm_generates_all_max_tokens(internvl_ckpt):
    with serve(internvl_ckpt, [*ROW2, "--allow-unfit-images"]) as srv:
        status, body = _ask(srv, _big(), max_tokens=64)
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    msg = body["error"]["message"]
    assert "prompt is 1812 tokens" in msg and "with its max_tokens=64 output tokens" in msg
    kwargs, _ = printed_fixes(msg)
    assert {"num_blocks": 30} in kwargs  # 30 x 64 = 1920 >= 1812 + 64 (it was 29: 1856, 44 tokens)
    assert len(kwargs) == 2  # and the image setting
    for fix in kwargs:  # the other settings kept, the flag dropped: every fix also holds the largest image
        llm = LLM(internvl_ckpt, show_progress=False, **{"num_blocks": 20, "block_size": 64, **fix})
        out = llm.chat(_conv(_big()), SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))[0]
        assert out.finish_reason == "length" and len(out.token_ids) == 64, fix


def test_row2_llm_fix_pasted_into_serve_flags_generates_all_max_tokens(internvl_ckpt):
    llm = LLM(internvl_ckpt, num_blocks=20, block_size=64, allow_unfit_images=True, show_progress=False)
    with pytest.raises(InputTooLongError) as info:
        llm.chat(_conv(_big()), SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    assert info.value.fixes["num_blocks"] == 30 and info.value.output_tokens == 64
    _, flags = printed_fixes(str(info.value))
    assert ["--num-blocks", "30"] in flags
    for fix in flags:
        with serve(internvl_ckpt, [*ROW2, *fix]) as srv:  # the pasted flag wins over the earlier one
            status, body = _ask(srv, _big(), max_tokens=64)
        assert status == 200, (fix, body)
        assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 64


def test_row2_unset_max_tokens_fix_says_its_room_and_leaves_it(internvl_ckpt):
    """No max_tokens in the request: the fixes are sized for 256 output tokens and say so; applied,
    the request (still without max_tokens) generates at least that many."""
    with serve(internvl_ckpt, [*ROW2, "--allow-unfit-images"]) as srv:
        status, body = _ask(srv, _big())
    msg = body["error"]["message"]
    assert status == 400 and "with room for 256 output tokens (max_tokens is not set" in msg
    kwargs, flags = printed_fixes(msg)
    assert {"num_blocks": 33} in kwargs  # 33 x 64 = 2112 >= 1812 + 256
    with serve(internvl_ckpt, [*ROW2, "--num-blocks", "33"]) as srv:
        status, body = _ask(srv, _big())
    assert status == 200 and body["usage"]["completion_tokens"] >= 256
    assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] == 33 * 64  # to max_model_len


# -- row 7: start-up refuses settings whose largest image cannot fit ---------------------------------

def test_row7_start_up_refusal_names_image_setting_and_cache_and_each_fix_runs(internvl_ckpt, capsys):
    with pytest.raises(UnfitImagesError) as info:
        LLM(internvl_ckpt, num_blocks=20, block_size=64, show_progress=False)
    err = info.value
    msg = str(err)
    assert err.image_tokens == 1792 and err.max_model_len == 1280 and err.param == "max_dynamic_patch"
    for words in ("1792 tokens", "max_model_len=1280", "--allow-unfit-images", "256 tokens left"):
        assert words in msg
    # 1792 + 256 tokens of room -> 32 blocks of 64; max_dynamic_patch 3: 4 tiles = 1024 <= 1280 - 256
    assert err.fixes == {"max_dynamic_patch": 3, "num_blocks": 32}
    # the serve CLI refuses the same settings with the same message, and exits 2
    assert main(["serve", str(internvl_ckpt), "--port", "0", *ROW2]) == 2
    assert "max_dynamic_patch=3; num_blocks=32" in capsys.readouterr().err
    _, flags = printed_fixes(msg)
    for fix in flags:  # each printed flag, pasted into serve: starts; the largest image runs all 64 tokens
        with serve(internvl_ckpt, [*ROW2, *fix]) as srv:
            status, body = _ask(srv, _big(), max_tokens=64)
        assert status == 200 and body["usage"]["completion_tokens"] == 64, (fix, body)


def test_row7_llm_fix_and_max_model_len_fix_when_user_set(internvl_ckpt):
    with pytest.raises(UnfitImagesError) as info:
        LLM(internvl_ckpt, max_model_len=1500, show_progress=False)
    fixes = info.value.fixes
    assert fixes["max_model_len"] == 1792 + 256 and "max_dynamic_patch" in fixes
    for fix in printed_fixes(str(info.value))[0]:
        llm = LLM(internvl_ckpt, show_progress=False, **{"max_model_len": 1500, **fix})
        out = llm.chat(_conv(_big()), SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))[0]
        assert len(out.token_ids) == 64, fix


def test_row7_allow_unfit_images_warns_and_refuses_only_what_does_not_fit(internvl_ckpt, caplog):
    with caplog.at_level(logging.WARNING, logger="vlm_sdk"):
        with serve(internvl_ckpt, [*ROW2, "--allow-unfit-images"]) as srv:
            small = image(448, 448, 3)  # one tile and no thumbnail: 256 tokens
            status, body = _ask(srv, small, max_tokens=8)
            assert status == 200 and body["usage"]["completion_tokens"] == 8
            status, body = _ask(srv, _big(), max_tokens=8)
            assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert any("cannot fit in max_model_len=1280" in r.getMessage() and "Starting anyway" in r.getMessage()
               for r in caplog.records)


# -- row 4 and the engine half of 3: sizes with units, one spelling everywhere ------------------------

def test_row4_kv_cache_memory_takes_units_in_llm_and_serve(tiny_ckpt, capsys):
    by_int = LLM(tiny_ckpt, kv_cache_memory=1 << 20, show_progress=False).stats()
    by_str = LLM(tiny_ckpt, kv_cache_memory="1MiB", show_progress=False).stats()
    assert by_int["kv_blocks_total"] == by_str["kv_blocks_total"] == (1 << 20) // by_int["kv_bytes_per_block"]
    with serve(tiny_ckpt, ["--kv-cache-memory", "1MiB"]) as srv:
        assert srv.stats()["kv_blocks_total"] == by_int["kv_blocks_total"]
        status, body = _ask(srv, image(200, 150, 1), max_tokens=16)
        assert status == 200 and body["usage"]["completion_tokens"] == 16
    with pytest.raises(InvalidRequestError, match=r"kv_cache_memory='1000000' has no unit.*'1000000B'") as info:
        LLM(tiny_ckpt, kv_cache_memory="1000000", show_progress=False)
    assert info.value.param == "kv_cache_memory" and "--kv-cache-memory 1000000B" in str(info.value)
    assert main(["serve", str(tiny_ckpt), "--port", "0", "--kv-cache-memory", "1000000"]) == 2
    assert "has no unit" in capsys.readouterr().err


def test_kv_cache_memory_fix_prints_with_a_unit_and_pastes_both_ways(tiny_ckpt):
    per_block = LLM(tiny_ckpt, num_blocks=32, show_progress=False).stats()["kv_bytes_per_block"]
    small = f"{6 * per_block}B"  # 6 blocks = 96 tokens, as a size string
    conv = [{"role": "user", "content": "word " * 120}]
    llm = LLM(tiny_ckpt, kv_cache_memory=small, allow_unfit_images=True, show_progress=False)
    with pytest.raises(InputTooLongError) as info:
        llm.chat(conv, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    kwargs, flags = printed_fixes(str(info.value))
    kv = next(k["kv_cache_memory"] for k in kwargs if "kv_cache_memory" in k)
    assert isinstance(kv, str) and kv[-1] == "B"  # a size string with its unit, not a bare number
    # the other settings kept (the flag too: this cache stays below the largest image's 256 tokens)
    out = LLM(tiny_ckpt, kv_cache_memory=kv, allow_unfit_images=True, show_progress=False).chat(
        conv, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 32
    flag = next(f for f in flags if f[0] == "--kv-cache-memory")
    with serve(tiny_ckpt, [*flag, "--allow-unfit-images"]) as srv:
        status, body = post(srv.url, {"model": srv.model_name, "messages": conv, "max_tokens": 32,
                                      "ignore_eos": True, "temperature": 0}, key=None)
    assert status == 200 and body["usage"]["completion_tokens"] == 32


# -- row 11, engine side: memory_utilization on the CPU -----------------------------------------------

def test_row11_memory_utilization_on_the_cpu_is_refused_with_the_alternative(tiny_ckpt, capsys):
    with pytest.raises(InvalidRequestError, match="memory_utilization=0.5 applies to CUDA devices only") as info:
        LLM(tiny_ckpt, device="cpu", memory_utilization=0.5, show_progress=False)
    assert info.value.param == "memory_utilization" and "kv_cache_memory='2GiB'" in str(info.value)
    assert main(["serve", str(tiny_ckpt), "--device", "cpu", "--memory-utilization", "0.5"]) == 2
    assert "applies to CUDA devices only" in capsys.readouterr().err
    # left out, it is the CUDA default 0.9, and the CPU engine starts
    llm = LLM(tiny_ckpt, device="cpu", num_blocks=32, show_progress=False)
    assert llm.engine.args.memory_utilization == 0.9 and not llm.engine.args.memory_utilization_given
