"""The cache layout a model's per-layer specs give (protocol/cache_layout.py): groups of group_size layers
sharing one block pool, each layer's group and KV tensor, what one sequence holds, the refusals (attention
layers of different page shapes; a backend without kernels for a kind), and prefix reuse said per kind."""
import pytest

from vlm_sdk.attention.selector import check_layers
from vlm_sdk.errors import InvalidRequestError
from vlm_sdk.protocol.cache_layout import CacheLayout, LayoutError
from vlm_sdk.protocol.cache_spec import AttentionSpec, StateSpec, StateTensor

F = AttentionSpec(2, 8, "bfloat16")
S = AttentionSpec(2, 8, "bfloat16", window=6)
STATE = StateSpec((StateTensor("conv", (16, 3), "bfloat16"), StateTensor("recurrent", (2, 8, 8), "float32")))


def test_the_docstring_layout_groups_and_tensors():
    """S S F S S F: S has 4 layers, F 2, so group_size 2 and S is cut in two chunks."""
    layout = CacheLayout.from_specs([S, S, F, S, S, F])
    assert layout.group_size == 2 and [g.layers for g in layout.groups] == [(0, 1), (2, 5), (3, 4)]
    assert [g.spec.kind for g in layout.groups] == ["sliding_window", "full", "sliding_window"]
    assert layout.layer_group == (0, 0, 1, 2, 2, 1) and layout.layer_tensor == (0, 1, 0, 0, 1, 1)
    assert layout.wasted_layers == 0 and layout.kinds == ("sliding_window", "full")
    # a block is a page in each of the two KV tensors: 2 x (K, V) x 4 tokens x 2 heads x 8 x 2 bytes
    assert layout.block_bytes(4) == 2 * 2 * 4 * 2 * 8 * 2


def test_a_short_last_chunk_wastes_its_missing_layers_and_state_layers_group_apart():
    layout = CacheLayout.from_specs([S, STATE, S, F, S, F, STATE])
    assert layout.group_size == 2  # F's 2 layers; S's 3 make a chunk of 2 and one of 1
    assert [g.layers for g in layout.groups] == [(0, 2), (3, 5), (4,), (1, 6)]
    assert layout.wasted_layers == 1 and layout.num_attention_groups == 3 and layout.has_state
    assert layout.layer_tensor[1] == 0 and layout.layer_tensor[6] == 1  # places among the state layers
    assert layout.state_slot_bytes == 2 * (16 * 3 * 2 + 2 * 8 * 8 * 4)


def test_one_full_attention_kind_is_todays_cache():
    layout = CacheLayout.uniform(28, F)
    assert layout.group_size == 28 and len(layout.groups) == 1 and layout.layer_tensor == tuple(range(28))
    assert layout.block_bytes(16) == 28 * 2 * 16 * 2 * 8 * 2
    assert layout.capacity_tokens(100, 16, 8192, 10_000) == 1600 and layout.blocks_for_tokens(1601, 16, 8192) == 101


def test_a_sequence_holds_its_window_in_a_sliding_group():
    layout = CacheLayout.from_specs([S, F])  # W 6, block_size 4: (6 - 1 + chunk - 1) // 4 + 2 blocks at most
    assert layout.blocks_for_tokens(100, 4, 8) == 25 + (5 + 7) // 4 + 2
    assert layout.blocks_for_tokens(3, 4, 8) == 1 + 1  # shorter than a window: every block in both groups
    cap = layout.capacity_tokens(30, 4, 8, 1000)
    assert layout.blocks_for_tokens(cap, 4, 8) <= 30 < layout.blocks_for_tokens(cap + 1, 4, 8)


def test_attention_layers_of_different_page_shapes_are_refused_naming_them():
    with pytest.raises(LayoutError, match=r"layers \[0\]: 2 KV heads x 8 x bfloat16; layers \[1\]: 4 KV heads x 8"):
        CacheLayout.from_specs([F, AttentionSpec(4, 8, "bfloat16")])
    with pytest.raises(LayoutError, match="without attention layers"):
        CacheLayout.from_specs([STATE, STATE])


def test_the_triton_backend_is_refused_for_sliding_layers_naming_the_setting():
    windowed = CacheLayout.from_specs([S, F, S])
    refused = r"layers \[0, 2\] attend within a window of \[6\].*attention_backend='torch'"
    with pytest.raises(InvalidRequestError, match=refused):
        check_layers("triton", windowed)
    check_layers("torch", windowed)
    check_layers("triton", CacheLayout.from_specs([F, STATE, F]))  # full and state layers: nothing refused


def test_prefix_reuse_is_said_per_kind_and_when_the_state_slots_leave_no_checkpoint():
    layout = CacheLayout.from_specs([S, STATE, F])
    assert set(layout.prefix_reuse(False).values()) == {"off: enable_prefix_caching=False"}
    reuse = layout.prefix_reuse(True, num_state_slots=128, max_num_seqs=64)
    assert reuse["sliding_window"].endswith("whose window is intact") and "only while" not in reuse["state"]
    tight = layout.prefix_reuse(True, num_state_slots=64, max_num_seqs=64)["state"]
    assert "only while fewer than num_state_slots=64 requests run" in tight and "max_num_seqs=64" in tight
