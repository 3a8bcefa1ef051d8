"""Every registered family through the user's entry points on its tiny checkpoint: `vlm-sdk chat
--family F` (the demo checkpoint it builds) and the HTTP server answering an image request, with the
usage and cached tokens of a follow-up. A new family gets these by its registry line alone."""
import pytest

from helpers import SAMPLE_IMAGE, image
from server_helpers import data_url, post
from vlm_sdk.cli import main
from vlm_sdk.models import registry
from vlm_sdk.server.background import BackgroundServer
from vlm_sdk.server.config import ServerConfig


@pytest.mark.parametrize("family", registry.family_names())
def test_chat_builds_and_answers_on_the_familys_tiny_checkpoint(family, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VLM_SDK_CACHE", str(tmp_path))
    assert main(["chat", "--family", family, "--image", str(SAMPLE_IMAGE), "--max-tokens", "4", "What is it?"]) == 0
    err = capsys.readouterr().err
    assert "RANDOM weights" in err and "generated " in err
    assert (tmp_path / f"tiny-{family}" / "config.json").exists()


def test_server_answers_an_image_request_and_its_follow_up(family_ckpt):
    family, ckpt = family_ckpt
    with BackgroundServer(ckpt, ServerConfig(port=0, api_key=None, served_model_name=family)) as srv:
        messages = [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(image(320, 200, 21))}},
            {"type": "text", "text": "What is in this image?"}]}]
        body = {"model": family, "messages": messages, "max_tokens": 6, "temperature": 0}
        status, first = post(srv.url, body, key=None)
        assert status == 200, first
        assert first["usage"]["completion_tokens"] == 6 or first["choices"][0]["finish_reason"] == "stop"
        messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "And the colours?"}]
        status, second = post(srv.url, {**body, "messages": messages}, key=None)
        assert status == 200, second
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert 0 < cached < second["usage"]["prompt_tokens"]  # the first turn, image included, came from the cache
