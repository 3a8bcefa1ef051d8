"""Issue 20 row 8: `vlm-sdk chat` and samples/image_qa.py write model text to the terminal with control
characters escaped (newlines and tabs kept), never raw bytes such as \\x1c, \\x05 or U+FFFD."""
from __future__ import annotations

import importlib.util

import pytest

import vlm_sdk.async_llm
from helpers import REPO, SAMPLE_IMAGE
from vlm_sdk.cli import main
from vlm_sdk.outputs import terminal_text

NASTY = "a\x1cb\x05c\ufffd\x1b[2J\r\u202e"
SHOWN = "a\\x1cb\\x05c\\ufffd\\x1b[2J\\x0d\\u202e"


def test_terminal_text_escapes_controls_and_keeps_text():
    assert terminal_text(NASTY) == SHOWN
    kept = "line one\n\tindented: é, 中文, emoji 😀, ½ and a ~ tilde"
    assert terminal_text(kept) == kept
    assert terminal_text("\x7f\x85\x00") == "\\x7f\\x85\\x00"  # DEL, C1 NEL, NUL
    for ch in map(chr, range(0x20)):
        if ch not in "\n\t":
            assert terminal_text(ch).startswith("\\x")


@pytest.fixture
def nasty_model_text(monkeypatch):
    """The real engine, its streamed text prefixed with control characters (a random-weight model
    emits them by chance; this makes it certain)."""
    real = vlm_sdk.async_llm.AsyncLLM

    class Nasty(real):
        async def chat_stream(self, *args, **kwargs):
            first = True
            async for out in super().chat_stream(*args, **kwargs):
                if first:
                    out.delta_text = NASTY + out.delta_text
                    first = False
                yield out
    monkeypatch.setattr(vlm_sdk.async_llm, "AsyncLLM", Nasty)


def _assert_clean(text: str) -> None:
    assert SHOWN in text
    for raw in ("\x1c", "\x05", "\ufffd", "\x1b", "\r", "\u202e"):
        assert raw not in text, repr(raw)


def test_chat_cli_writes_escaped_text(tiny_ckpt, nasty_model_text, capsys):
    assert main(["chat", "--model", str(tiny_ckpt), "--device", "cpu", "--max-tokens", "6", "hello"]) == 0
    _assert_clean(capsys.readouterr().out)


def test_image_qa_sample_writes_escaped_text(tiny_ckpt, nasty_model_text, capsys):
    spec = importlib.util.spec_from_file_location("image_qa_sample", REPO / "samples" / "image_qa.py")
    sample = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sample)
    assert sample.main(["--model", str(tiny_ckpt), "--image", str(SAMPLE_IMAGE), "--max-tokens", "6", "What?"]) == 0
    _assert_clean(capsys.readouterr().out)
