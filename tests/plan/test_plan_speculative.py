"""`vlm-sdk plan --speculative-config`: the verification step's logits rows counted, and a model the engine
would refuse (state layers) refused the same."""
import pytest

from vlm_sdk.errors import InvalidRequestError
from vlm_sdk.plan import plan


def _sampler_bytes(p) -> int:
    return next(c for c in p.to_dict()["consumers"] if c["name"] == "sampler")["bytes"]


def test_verification_rows_are_counted(tiny_ckpt):
    base = plan(tiny_ckpt, device_memory="24GiB", max_num_seqs=256)
    few = plan(tiny_ckpt, device_memory="24GiB", max_num_seqs=256,
               speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    many = plan(tiny_ckpt, device_memory="24GiB", max_num_seqs=256,
                speculative_config='{"method": "ngram", "num_speculative_tokens": 16}')
    import json
    vocab = json.loads((tiny_ckpt / "config.json").read_text())
    vocab = vocab.get("vocab_size") or vocab["text_config"]["vocab_size"]
    assert _sampler_bytes(few) == _sampler_bytes(base)  # 3 rows of logits weigh less than one row's draw
    # 256 x 17 rows of float32 logits and 17 rows of the sampler's temporaries (one request drawn at a time),
    # against 256 rows of logits + temporaries (4 + 40 bytes an entry)
    fewer = plan(tiny_ckpt, device_memory="24GiB", max_num_seqs=256,
                 speculative_config={"method": "ngram", "num_speculative_tokens": 15})
    assert _sampler_bytes(many) > _sampler_bytes(fewer) > _sampler_bytes(base)
    # one more draft: 256 more rows of float32 logits, one more row of temporaries
    assert _sampler_bytes(many) - _sampler_bytes(fewer) == (256 * 4 + 40) * vocab
    assert many.num_blocks < base.num_blocks


def test_a_model_with_state_layers_is_refused_as_the_engine_refuses_it(tiny_checkpoints):
    from vlm_sdk.models import registry
    refused = 0
    for family in registry.family_names():
        path = tiny_checkpoints(family)
        has_state = plan(path, device_memory="24GiB").to_dict()["state_bytes"] > 0
        spec = {"method": "ngram", "num_speculative_tokens": 2}
        if has_state:
            with pytest.raises(InvalidRequestError, match="has state layers"):
                plan(path, device_memory="24GiB", speculative_config=spec)
            refused += 1
        else:
            plan(path, device_memory="24GiB", speculative_config=spec)
    assert refused  # the registry has a family with state layers (Qwen3.5)


def test_an_eagle3_draft_is_counted_as_the_engine_holds_it(tiny_ckpt, tmp_path):
    """The draft head's weights and its K/V page in every block: the plan's figures are the engine's."""
    from vlm_sdk import LLM
    from vlm_sdk.testing.eagle3 import write_eagle3_draft
    draft = write_eagle3_draft(tiny_ckpt, tmp_path / "draft", aux_layer_ids=[0, 1, 1])
    spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 2}
    base = plan(tiny_ckpt, device="cpu", host_memory="8GiB", kv_cache_memory="4MiB")
    p = plan(tiny_ckpt, device="cpu", host_memory="8GiB", kv_cache_memory="4MiB", speculative_config=spec)
    engine = LLM(str(tiny_ckpt), show_progress=False, kv_cache_memory="4MiB", speculative_config=spec).engine
    report = engine.memory_report
    assert p.weights_draft_bytes == report.weights_draft_bytes > 0
    assert p.weights_bytes == base.weights_bytes + p.weights_draft_bytes
    assert p.kv_bytes_per_block == report.kv_bytes_per_block > base.kv_bytes_per_block
    assert p.num_blocks == report.num_blocks < base.num_blocks
    from vlm_sdk.plan.report import format_plan
    assert "weights: EAGLE-3 draft" in format_plan(p) and "weights: EAGLE-3 draft" not in format_plan(base)
