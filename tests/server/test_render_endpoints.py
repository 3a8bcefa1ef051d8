"""The dry-run endpoints (server/render.py): vLLM's fields (token_ids, features' hashes and placeholder
ranges) and ours, against what the chat and completions endpoints then run (usage, cached tokens);
/tokenize counting images as they do; a request that never fits answered 200 with the too-long error's
fixes, and refused (400) by the generating endpoint."""
import json
import urllib.error
import urllib.request

import pytest

from helpers import image
from server_helpers import API_KEY, data_url
from vlm_sdk.server.background import BackgroundServer
from vlm_sdk.server.config import ServerConfig


@pytest.fixture(scope="module")
def srv(tiny_ckpt):
    with BackgroundServer(tiny_ckpt, ServerConfig(port=0, api_key=API_KEY, served_model_name="tiny"),
                          num_blocks=96, block_size=4, show_progress=False) as s:
        yield s


def _post(srv, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(srv.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _messages(seed: int, width: int = 96, height: int = 64) -> list[dict]:
    url = data_url(image(width, height, seed))
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is in this image?"}]}]


def test_chat_render_then_chat(srv):
    body = {"model": "tiny", "messages": _messages(5), "max_tokens": 3, "temperature": 0}
    status, cold = _post(srv, "/v1/chat/completions/render", body)
    assert status == 200, cold
    assert cold["request_id"].startswith("chatcmpl-") and cold["model"] == "tiny"
    assert cold["sampling_params"]["max_tokens"] == 3
    (place,) = cold["features"]["mm_placeholders"]["image"]
    (img,) = cold["parts"]["images"]
    assert place == {"offset": img["offset"], "length": img["length"]}
    assert cold["features"]["mm_hashes"]["image"] == [img["hash"]]
    assert (img["width"], img["height"]) == (96, 64) and cold["num_tokens"] == len(cold["token_ids"])
    assert cold["parts"]["text_tokens"] + img["tokens"] == cold["num_tokens"]
    assert cold["fits"]["now"] and cold["fits"]["ever"] and cold["error"] is None
    assert cold["prefix_cache"]["hit_tokens"] == 0
    assert cold["kv"]["tokens"] == cold["num_tokens"] + 3 and cold["kv"]["blocks"] == -(-cold["kv"]["tokens"] // 4)
    status, out = _post(srv, "/v1/chat/completions", {**body, "return_token_ids": True})
    assert status == 200 and out["prompt_token_ids"] == cold["token_ids"]
    assert out["usage"]["prompt_tokens"] == cold["num_tokens"]
    _, warm = _post(srv, "/v1/chat/completions/render", body)
    _, again = _post(srv, "/v1/chat/completions", body)
    assert warm["prefix_cache"]["hit_tokens"] == again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    status, tok = _post(srv, "/tokenize", {"model": "tiny", "messages": body["messages"]})
    assert status == 200 and tok["tokens"] == cold["token_ids"] and tok["parts"] == cold["parts"]


def test_a_video_is_rendered_and_tokenized_as_chat_runs_it(srv):
    import base64
    from vlm_sdk.testing.videos import write_video
    url = "data:video/mp4;base64," + base64.b64encode(write_video(frames=16, fps=8, width=64, height=48)).decode()
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "What happens?"}]}]}
    status, rendered = _post(srv, "/v1/chat/completions/render", body)
    assert status == 200, rendered
    (video,) = rendered["parts"]["videos"]
    assert rendered["parts"]["images"] == [] and video["frames"] == 2 * video["items"] and video["grid"][0] == video["items"]
    assert rendered["features"]["mm_placeholders"]["video"] == [{"offset": video["offset"], "length": video["length"]}]
    # the server's vision budget on the CPU (SERVING_STEP_SHARES: 256) holds one of its two 140-token frame groups
    # a step: the render counts the steps as the scheduler cuts them (tests/engine/test_render.py, against the engine)
    assert rendered["fits"]["max_num_encoder_tokens_per_step"] == 256 and video["tokens"] == 280 and video["items"] == 2
    assert rendered["fits"]["prefill_steps"] == 2
    _, tok = _post(srv, "/tokenize", {"model": "tiny", "messages": body["messages"]})
    _, out = _post(srv, "/v1/chat/completions", body)
    assert tok["parts"] == rendered["parts"] and out["usage"]["prompt_tokens"] == rendered["num_tokens"] == tok["count"]


def test_completions_render_is_one_object_per_prompt(srv):
    status, out = _post(srv, "/v1/completions/render", {"model": "tiny", "prompt": ["Once upon", "a time there"],
                                                       "max_tokens": 2})
    assert status == 200 and len(out) == 2 and all(o["request_id"].startswith("cmpl-") for o in out)
    assert [o["features"] for o in out] == [None, None] and out[0]["parts"]["images"] == []
    _, tok = _post(srv, "/tokenize", {"prompt": "Once upon"})
    assert out[0]["token_ids"] == tok["tokens"] and out[0]["kv"]["tokens"] == tok["count"] + 2


def test_a_request_that_never_fits_is_answered_with_its_fixes(srv):
    body = {"model": "tiny", "messages": _messages(6, 448, 448), "max_tokens": 4}  # 256 image tokens > 384 - ...
    body["messages"][0]["content"][1]["text"] = "Describe it. " * 40
    status, out = _post(srv, "/v1/chat/completions/render", body)
    assert status == 200 and not out["fits"]["ever"] and not out["fits"]["now"]
    assert out["num_tokens"] > out["fits"]["max_model_len"] and out["error"]["code"] == "context_length_exceeded"
    assert out["error"]["fixes"] and "max_pixels" in out["error"]["fixes"]
    status, refused = _post(srv, "/v1/chat/completions", body)
    assert status == 400 and refused["error"]["code"] == "context_length_exceeded"
    assert refused["error"]["message"] == out["error"]["message"]
    status, tok = _post(srv, "/tokenize", {"model": "tiny", "messages": body["messages"]})
    assert status == 400 and tok["error"]["code"] == "context_length_exceeded"
