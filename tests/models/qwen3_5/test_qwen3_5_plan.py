"""`vlm-sdk plan` of a Qwen3.5 checkpoint from its config.json alone: a token's KV is that of the
full-attention quarter of the layers, a request's Gated DeltaNet state a fixed slot, and the plan says
so (plan == engine for these families: tests/e2e/test_family_capacity.py)."""
from __future__ import annotations

import json

from vlm_sdk.plan import plan
from vlm_sdk.plan.report import format_plan


def test_a_token_costs_the_attending_quarter_and_a_request_a_fixed_state(tiny_checkpoints):
    ckpt = tiny_checkpoints("qwen3_5")
    text = json.loads((ckpt / "config.json").read_text())["text_config"]
    p = plan(ckpt, device="cpu")
    full = text["layer_types"].count("full_attention")
    assert full * 4 == text["num_hidden_layers"]
    assert p.kv_bytes_per_token == full * 2 * text["num_key_value_heads"] * text["head_dim"] * 4  # float32 K and V
    # per Gated DeltaNet layer: the conv state over q, k and v's channels, the recurrent state per value head
    conv = (2 * text["linear_num_key_heads"] * text["linear_key_head_dim"]
            + text["linear_num_value_heads"] * text["linear_value_head_dim"]) * (text["linear_conv_kernel_dim"] - 1)
    recurrent = text["linear_num_value_heads"] * text["linear_key_head_dim"] * text["linear_value_head_dim"]
    assert p.state_slot_bytes == (text["num_hidden_layers"] - full) * (conv + recurrent) * 4
    shown = format_plan(p)
    assert "a token's KV is that of the 1 attending layers of 4 (1/4 of a same-size model" in shown
    assert f"a request's state is a fixed 5.25 KiB ({p.state_slot_bytes:,} B), whatever its length" in shown
