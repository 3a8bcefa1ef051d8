"""`vlm-sdk plan --speculative-config`: the verification step's logits rows and the drafts' state slots counted,
and a model the engine would refuse (state layers without draft states) refused the same."""
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


def test_state_layers_count_a_slot_per_draft_and_one_without_draft_states_is_refused(tiny_checkpoints, tmp_path):
    """Qwen3.5 (Gated DeltaNet keeps each draft's state) plans with speculation: max_num_seqs x k more state
    slots, as the engine sizes them (memory/kv.state_slots); a state layer that keeps no state per draft (the
    mixed-cache test model's) is refused as the engine refuses it (tests/e2e/test_speculative_decoding.py)."""
    from vlm_sdk.models import registry
    from vlm_sdk.testing.mixed_cache import make_mixed_checkpoint
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    planned = 0
    for family in registry.family_names():
        path = tiny_checkpoints(family)
        base = plan(path, device_memory="24GiB", max_num_seqs=8).to_dict()
        if base["state_bytes"] == 0:
            continue
        with_drafts = plan(path, device_memory="24GiB", max_num_seqs=8, speculative_config=spec).to_dict()
        # a live slot and a checkpoint per sequence (prefix caching), then 3 drafts' slots
        assert (base["num_state_slots"], with_drafts["num_state_slots"]) == (16, 40)
        assert with_drafts["state_bytes"] == base["state_bytes"] * 40 // 16
        planned += 1
    assert planned  # the registry has families with state layers (Qwen3.5)
    mixed = make_mixed_checkpoint(tmp_path / "mixed")
    with pytest.raises(InvalidRequestError, match="has state layers") as e:
        plan(mixed, device_memory="24GiB", model_family="vlm_sdk.testing.mixed_cache", block_size=4,
             speculative_config=spec)
    assert "keep no state per draft" in str(e.value) and e.value.param == "speculative_config"
