"""`vlm-sdk serve --speculative-config JSON`: the flag reaches the engine, and /metrics shows the drafts,
their acceptance and the draft time (vLLM's spec_decode_* counters)."""
import json

from prometheus_client.parser import text_string_to_metric_families

from server_helpers import API_KEY, get, post
from vlm_sdk.cli import build_parser
from vlm_sdk.server.background import BackgroundServer
from vlm_sdk.server.config import ServerConfig
from vlm_sdk.server.engine_flags import engine_kwargs

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}


def test_the_flag_reaches_the_engine_and_metrics_count_drafts(tiny_ckpt):
    args = build_parser()[1]["serve"].parse_args([str(tiny_ckpt), "--speculative-config", json.dumps(SPEC)])
    kwargs = engine_kwargs(args)
    assert kwargs["speculative_config"] == json.dumps(SPEC)
    with BackgroundServer(tiny_ckpt, ServerConfig(port=0, api_key=API_KEY, served_model_name="x"), **kwargs) as srv:
        assert srv.stats()["spec_method"] == "ngram"
        # the prompt repeats itself: its own tokens are drafts the random model will sometimes follow
        body = {"model": "x", "max_tokens": 40, "temperature": 0, "messages": [
            {"role": "user", "content": "one two one two one two one two one two one two"}]}
        status, out = post(srv.url, body)
        assert status == 200, out
        status, text = get(srv.url, "/metrics", key=None)
        assert status == 200
        values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        stats = srv.stats()
        assert values["vlm_sdk_spec_decode_num_draft_tokens_total"] == stats["spec_draft_tokens"] > 0
        assert values["vlm_sdk_spec_decode_num_accepted_tokens_total"] == stats["spec_accepted_tokens"]
        assert values["vlm_sdk_spec_decode_num_drafts_total"] == stats["spec_verify_steps"] > 0
        assert values["vlm_sdk_spec_decode_mean_accepted_length"] == stats["spec_mean_accepted_length"] >= 1.0
        assert "vlm_sdk_spec_decode_draft_seconds_total" in values


def test_an_eagle3_draft_through_the_flag_the_async_engine_and_metrics(tiny_ckpt, tmp_path):
    from vlm_sdk.testing.eagle3 import write_eagle3_draft
    draft = write_eagle3_draft(tiny_ckpt, tmp_path / "draft", aux_layer_ids=[0, 1, 1])
    spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 2}
    args = build_parser()[1]["serve"].parse_args([str(tiny_ckpt), "--speculative-config", json.dumps(spec)])
    with BackgroundServer(tiny_ckpt, ServerConfig(port=0, api_key=API_KEY, served_model_name="x"),
                          **engine_kwargs(args)) as srv:
        body = {"model": "x", "max_tokens": 12, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
        status, out = post(srv.url, body)
        assert status == 200, out
        status, text = get(srv.url, "/metrics", key=None)
        values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        stats = srv.stats()
        assert stats["spec_method"] == "eagle3" and stats["spec_verify_steps"] > 0
        assert values["vlm_sdk_spec_decode_num_draft_tokens_total"] == stats["spec_draft_tokens"] > 0
        # a counter read before stats(): the drafter's pass after the last step may land between the two reads
        assert 0 < values["vlm_sdk_spec_decode_draft_seconds_total"] <= stats["spec_draft_seconds"]
