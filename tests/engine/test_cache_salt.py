"""`cache_salt` (vLLM's field): requests with different salts never share a prefix-cache block or an
encoder-cache entry, requests with the same salt do, and unsalted requests keep sharing among
themselves. Checked on the block hashes and block manager directly, then through `LLM` (stats) and the
server (usage.cached_tokens, the same counters in stats)."""
import pytest
import torch

from helpers import image, full_attention_cache
from server_helpers import data_url, post
from vlm_sdk import LLM, SamplingParams
from vlm_sdk.engine.core.sequence import Sequence
from vlm_sdk.multimodal.image_key import salted_key
from vlm_sdk.multimodal.inputs import ImageInput, PromptInputs
from vlm_sdk.server.background import BackgroundServer
from vlm_sdk.server.config import ServerConfig


def _seq(name, salt, ids=range(13), key=b"k" * 16):
    prompt = PromptInputs(token_ids=list(ids), images=[ImageInput(torch.zeros(1, 1), 3, key=key)],
                          image_positions=[2], cache_salt=salt)
    return Sequence(name, prompt, SamplingParams(max_tokens=10))


def _start(bm, seq):
    n = bm.start(seq, 1000)
    seq.num_computed_tokens += n
    return seq.num_computed_tokens - n  # tokens found in the cache


def test_salts_never_share_a_block_and_the_same_salt_does():
    bm = full_attention_cache(32, 4, True)
    seqs = {name: _seq(name, salt) for name, salt in
            [("a1", "tenant-a"), ("b", "tenant-b"), ("none1", None), ("a2", "tenant-a"), ("none2", None)]}
    assert _start(bm, seqs["a1"]) == 0
    assert _start(bm, seqs["b"]) == 0  # same tokens and image, another salt: nothing shared
    assert _start(bm, seqs["none1"]) == 0  # nor with an unsalted request
    assert _start(bm, seqs["a2"]) == 12  # the same salt shares every full block
    assert _start(bm, seqs["none2"]) == 12  # unsalted requests share among themselves
    a, b, n = seqs["a1"].block_hashes, seqs["b"].block_hashes, seqs["none1"].block_hashes
    assert len(a) == 3 and not set(a) & set(b) and not set(a) & set(n) and not set(b) & set(n)
    assert seqs["a2"].block_hashes == a and seqs["a2"].block_ids[0][:3] == seqs["a1"].block_ids[0][:3]
    assert not set(seqs["b"].block_ids[0]) & set(seqs["a1"].block_ids[0])  # no physical block in common either


def test_salted_image_keys_differ_per_salt():
    key = b"k" * 16
    assert salted_key(key, "a") == salted_key(key, "a")
    assert len({key, salted_key(key, "a"), salted_key(key, "b"), salted_key(b"j" * 16, "a")}) == 4


def _image_chat(text):
    return [{"role": "user", "content": [{"type": "image", "image": image(200, 150, 3)}, {"type": "text", "text": text}]}]


def test_llm_salts_keep_prefix_and_encoder_caches_apart(tiny_ckpt):
    llm = LLM(tiny_ckpt, show_progress=False, encoder_cache_memory="64MiB")
    params = SamplingParams(max_tokens=2, temperature=0)

    def run(salt, text):
        before = llm.stats()
        out = llm.chat(_image_chat(text), params, cache_salt=salt)[0]
        after = llm.stats()
        return (out.num_cached_tokens, after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"],
                after["encoder_cache_hits"] - before["encoder_cache_hits"])

    assert run("tenant-a", "Describe it.") == (0, 0, 0)
    assert run("tenant-b", "Describe it.") == (0, 0, 0)  # another tenant: no block, no image entry
    assert run(None, "Describe it.") == (0, 0, 0)
    cached, hits, enc = run("tenant-a", "What colour?")  # the same tenant: the image and the text before it
    assert cached > 0 and hits == cached and enc == 1
    cached, hits, enc = run(None, "What colour?")  # unsalted requests share with each other only
    assert cached > 0 and hits == cached and enc == 1
    assert llm.stats()["kv_blocks_used"] == 0


@pytest.fixture(scope="module")
def srv(tiny_ckpt):
    with BackgroundServer(tiny_ckpt, ServerConfig(port=0)) as s:
        yield s


def test_server_cache_salt(srv):
    url = data_url(image(200, 150, 4))

    def cached(salt, text):
        body = {"model": srv.model_name, "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]}]}
        if salt is not None:
            body["cache_salt"] = salt
        status, resp = post(srv.url, body, key=None)
        assert status == 200, resp
        return resp["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("s1", "Describe it.") == 0
    assert cached("s2", "Describe it.") == 0
    assert cached("s1", "And the colour?") > 0
    status, resp = post(srv.url, {"model": srv.model_name, "messages": [{"role": "user", "content": "x"}],
                                  "cache_salt": ""}, key=None)
    assert status == 400 and resp["error"]["param"] == "cache_salt"
