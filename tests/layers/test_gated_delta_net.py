"""The Gated DeltaNet layer (vlm_sdk/layers/gated_delta_net.py) against transformers'
`Qwen3_5GatedDeltaNet` on random weights of a tiny config made with transformers' own config class:
a whole prompt, the same prompt split into steps (the state carried through its slots), decode steps,
two requests packed in one step with different slots, a mixed step (a decode row beside a prompt), a
verification step of speculative decoding (the state after each draft in its own slot, equal to running only
the tokens up to it), and tensor parallelism on two gloo ranks equal to one rank. transformers runs each request's whole token
sequence without a cache (its outputs are causal), which is the reference of every step."""
from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

from tolerance import assert_reduction_close
from vlm_sdk.attention.metadata import StateMetadata
from vlm_sdk.config import ParallelConfig
from vlm_sdk.models.parallel_split import check_tensor_parallel_size
from vlm_sdk.layers.gated_delta_net import GatedDeltaNet, GatedDeltaNetConfig
from vlm_sdk.layers.ops import TorchOps
from vlm_sdk.layers.parallel_state import TPGroup
from vlm_sdk.errors import InvalidRequestError
from vlm_sdk.protocol.cache_spec import StateSpec, StateTensor
from vlm_sdk.testing.distributed import run_on_ranks
from vlm_sdk.weight_loading import load_checked

SLOTS = 6


def _config(**kw) -> Qwen3_5TextConfig:
    base = dict(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=1,
                layer_types=["linear_attention"], rms_norm_eps=1e-6, hidden_act="silu")
    return Qwen3_5TextConfig(**{**base, **kw})


def _hf_layer(cfg: Qwen3_5TextConfig, seed: int = 0) -> Qwen3_5GatedDeltaNet:
    torch.manual_seed(seed)
    layer = Qwen3_5GatedDeltaNet(cfg, 0).eval()
    with torch.no_grad():  # weights large enough that the outputs spread (transformers' 0.02 std is tiny)
        for name, p in layer.named_parameters():
            if name == "A_log":
                p.copy_(torch.empty_like(p).uniform_(0.5, 8).log())
            elif name == "norm.weight":
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.5))
    return layer


def _ours(cfg, hf: Qwen3_5GatedDeltaNet, tp: TPGroup = TPGroup()) -> GatedDeltaNet:
    layer = GatedDeltaNet(GatedDeltaNetConfig.from_hf(cfg), TorchOps(), tp=tp)
    load_checked(layer, [(f"model.layers.0.linear_attn.{n}", t) for n, t in hf.state_dict().items()],
                 layer.slots("model.layers.0.linear_attn."))
    return layer


def _state(layer: GatedDeltaNet) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots full of NaN, as a reused slot may hold: a request that starts at token 0 must not read its
    slot (a NaN would reach every output)."""
    return tuple(torch.full((SLOTS, *t.shape), float("nan"), dtype=getattr(torch, t.dtype))
                 for t in layer.cache_spec().tensors)


def _meta(lens: list[int], slots: list[int], has_init: list[bool]) -> StateMetadata:
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return StateMetadata(starts, list(lens), torch.tensor(slots), torch.tensor(has_init), list(has_init), max(lens))


def _terms(cfg, tokens: int) -> int:
    """in_proj, the conv, the rule (a state over the tokens read over Dk), the norm, out_proj."""
    return (cfg.hidden_size + cfg.linear_conv_kernel_dim + cfg.linear_key_head_dim + tokens + 128
            + cfg.linear_value_head_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim)


def _steps(layer, x: torch.Tensor, steps: list[list[tuple[int, int, int]]]) -> dict[int, list[torch.Tensor]]:
    """Run steps of (request, first token, tokens) rows packed together; each request in slot 2 * id + 1.
    Returns every request's outputs in order."""
    state = _state(layer)
    outs: dict[int, list[torch.Tensor]] = {}
    for rows in steps:
        tokens = torch.cat([x[r][a:a + n] for r, a, n in rows])
        meta = _meta([n for _, _, n in rows], [2 * r + 1 for r, _, _ in rows], [a > 0 for _, a, _ in rows])
        with torch.no_grad():
            y = layer(tokens, state, meta)
        start = 0
        for r, _, n in rows:
            outs.setdefault(r, []).append(y[start:start + n])
            start += n
    return outs


def test_cache_spec_is_this_ranks_state():
    cfg = _config()
    spec = GatedDeltaNet(GatedDeltaNetConfig.from_hf(cfg), TorchOps(), dtype=torch.bfloat16).cache_spec()
    assert spec == StateSpec((StateTensor("conv", (2 * 32 + 32, 3), "bfloat16"), StateTensor("recurrent", (4, 16, 8),
                                                                                                "float32")),
                             draft_states=True)  # speculative decoding: the state after each draft kept
    assert spec.slot_bytes == 96 * 3 * 2 + 4 * 16 * 8 * 4
    half = GatedDeltaNet(GatedDeltaNetConfig.from_hf(cfg), TorchOps(), device="meta", tp=TPGroup(1, 2)).cache_spec()
    assert [t.shape for t in half.tensors] == [(48, 3), (2, 16, 8)]


def test_prompt_whole_split_and_decode_equal_transformers():
    cfg = _config()
    hf = _hf_layer(cfg)
    ours = _ours(cfg, hf)
    x = torch.randn(1, 150, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf(x)[0]  # [150, hidden]
    prompt, decode = 147, 3
    whole = _steps(ours, {0: x[0]}, [[(0, 0, prompt)]] + [[(0, prompt + i, 1)] for i in range(decode)])[0]
    split = _steps(ours, {0: x[0]}, [[(0, 0, 50)], [(0, 50, 1)], [(0, 51, 70)], [(0, 121, 26)]]
                   + [[(0, prompt + i, 1)] for i in range(decode)])[0]
    for got in (whole, split):
        assert_reduction_close(torch.cat(got), want, _terms(cfg, 150))
    assert float(want.std()) > 0.1


def test_requests_packed_in_one_step_with_different_slots():
    """Request 0's prompt in two steps, request 1 starting beside its second step, then both decoding in
    one step, then request 1 decoding beside request 2's prompt (a mixed step: the varlen path takes the
    decode row)."""
    cfg = _config()
    hf = _hf_layer(cfg, seed=3)
    ours = _ours(cfg, hf)
    g = torch.Generator().manual_seed(4)
    x = {r: torch.randn(n, cfg.hidden_size, generator=g) for r, n in ((0, 90), (1, 41), (2, 20))}
    outs = _steps(ours, x, [[(0, 0, 60)], [(0, 60, 29), (1, 0, 39)], [(0, 89, 1), (1, 39, 1)],
                            [(1, 40, 1), (2, 0, 20)]])
    for r, seq in x.items():
        with torch.no_grad():
            want = hf(seq[None])[0]
        assert_reduction_close(torch.cat(outs[r]), want, _terms(cfg, len(seq)), msg=f"request {r}")


def test_a_verification_step_keeps_the_state_after_each_draft_in_its_slot():
    """Request 0 verifies 3 drafts (rows 20..23), request 1 one draft (rows 9, 10), beside request 2's prompt
    (no drafts) in one step: each draft's slot then holds the conv and recurrent state after the rows up to it,
    equal to a run of only those tokens (what the engine keeps when the draft after it is rejected); the live
    slots hold the state after every row, and the outputs are the step's without drafts."""
    import dataclasses
    from types import SimpleNamespace
    import numpy as np
    from vlm_sdk.worker.spec_verify import draft_states
    cfg = _config()
    ours = _ours(cfg, _hf_layer(cfg, seed=5))
    g = torch.Generator().manual_seed(6)
    x = {0: torch.randn(24, cfg.hidden_size, generator=g), 1: torch.randn(11, cfg.hidden_size, generator=g),
         2: torch.randn(7, cfg.hidden_size, generator=g)}
    live, drafts = {0: 1, 1: 3, 2: 5}, {"0": (8, 2, 11), "1": (6,)}

    def fresh():
        return tuple(torch.full((12, *t.shape), float("nan"), dtype=getattr(torch, t.dtype))
                     for t in ours.cache_spec().tensors)

    def run(state, rows, with_drafts=None):  # rows: (request, first token, tokens); its live slot
        meta = _meta([n for _, _, n in rows], [live[r] for r, _, _ in rows], [a > 0 for _, a, _ in rows])
        if with_drafts:
            q_start = np.concatenate([[0], np.cumsum([n for _, _, n in rows])])
            reqs = [(SimpleNamespace(request_id=str(r), state_slot=live[r]), n) for r, _, n in rows]
            meta = dataclasses.replace(meta, drafts=draft_states(reqs, q_start, with_drafts, torch.device("cpu")))
        with torch.no_grad():
            return ours(torch.cat([x[r][a:a + n] for r, a, n in rows]), state, meta)

    state = fresh()
    run(state, [(0, 0, 20), (1, 0, 9)])
    verified = run(state, [(0, 20, 4), (1, 9, 2), (2, 0, 7)], drafts)
    plain = fresh()
    run(plain, [(0, 0, 20), (1, 0, 9)])
    assert_reduction_close(verified, run(plain, [(0, 20, 4), (1, 9, 2), (2, 0, 7)]), _terms(cfg, 24))
    for r, start, slots in ((0, 20, drafts["0"]), (1, 9, drafts["1"])):
        for j, slot in enumerate(slots + (live[r],)):  # after rows start .. start + j (the live slot: all)
            want = fresh()
            run(want, [(r, 0, start + j + 1)])
            conv, rec = (t[live[r]] for t in want)
            assert_reduction_close(state[0][slot], conv, cfg.hidden_size, msg=f"conv, request {r}, row {j}")
            assert_reduction_close(state[1][slot], rec, _terms(cfg, start + j + 1), msg=f"state, request {r}, row {j}")
            assert float(rec.std()) > 0.01
    assert torch.isnan(state[1][[0, 4, 7, 9, 10]]).all()  # no other slot written


def _tp_run(tp: TPGroup, cfg_kw: dict, state_dict: dict, x: torch.Tensor) -> torch.Tensor:
    """One rank: its slice loaded, a prompt in two steps, then a decode step."""
    cfg = _config(**cfg_kw)
    layer = GatedDeltaNet(GatedDeltaNetConfig.from_hf(cfg), TorchOps(), tp=tp)
    load_checked(layer, state_dict.items(), layer.slots())
    return torch.cat(_steps(layer, {0: x}, [[(0, 0, 40)], [(0, 40, 30)], [(0, 70, 1)]])[0])


def test_tensor_parallel_two_ranks_equal_one():
    cfg = _config()
    hf = _hf_layer(cfg, seed=5)
    x = torch.randn(71, cfg.hidden_size, generator=torch.Generator().manual_seed(6))
    sd = {n: t.clone() for n, t in hf.state_dict().items()}
    full = _tp_run(TPGroup(), {}, sd, x)
    ranks = run_on_ranks(_tp_run, 2, {}, sd, x, timeout_s=300)
    for out in ranks:
        assert_reduction_close(out, full, _terms(cfg, 71))


def test_sizes_that_do_not_split_the_heads_are_refused_naming_those_that_do():
    cfg = _config(linear_num_key_heads=2, linear_num_value_heads=6)
    with pytest.raises(ValueError, match=r"linear_num_key_heads\) \(2\) is not divisible by the tensor-parallel size 3"):
        GatedDeltaNet(GatedDeltaNetConfig.from_hf(cfg), TorchOps(), device="meta", tp=TPGroup(0, 3))

    class OneLayerFamily:  # the engine's size check builds the family's model on the meta device
        @staticmethod
        def model_cls(hf_config, dtype, device, parallel, shard_vision):
            return GatedDeltaNet(GatedDeltaNetConfig.from_hf(hf_config), TorchOps(), dtype, device, parallel.tp)
    with pytest.raises(InvalidRequestError, match=r"tensor_parallel_size=3 does not split.*Sizes that work: 1, 2$"):
        check_tensor_parallel_size(OneLayerFamily, cfg, ParallelConfig(3))


def test_the_triton_kernel_set_gives_the_torch_sets_layer():
    """The same steps through the Triton set (the interpreter on the CPU, float32): a prompt in two steps,
    a packed step with a new request, a decode-only step."""
    import os
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1")
    from vlm_sdk.attention.selector import make_backend
    from vlm_sdk.layers.ops import TritonOps
    cfg = _config()
    hf = _hf_layer(cfg, seed=7)
    torch_layer = _ours(cfg, hf)
    triton_layer = GatedDeltaNet(GatedDeltaNetConfig.from_hf(cfg), TritonOps(make_backend("triton", torch.device("cpu"))))
    triton_layer.load_state_dict(torch_layer.state_dict())
    g = torch.Generator().manual_seed(8)
    x = {0: torch.randn(80, cfg.hidden_size, generator=g), 1: torch.randn(9, cfg.hidden_size, generator=g)}
    steps = [[(0, 0, 70)], [(0, 70, 9), (1, 0, 8)], [(0, 79, 1), (1, 8, 1)]]
    want, got = _steps(torch_layer, x, steps), _steps(triton_layer, x, steps)
    for r in x:
        assert_reduction_close(torch.cat(got[r]), torch.cat(want[r]), _terms(cfg, 80), msg=f"request {r}")


def test_a_recurrent_state_narrower_than_float32_is_refused_naming_the_setting():
    from dataclasses import replace
    with pytest.raises(ValueError, match="mamba_ssm_dtype 'bfloat16'.*float32"):
        GatedDeltaNet(replace(GatedDeltaNetConfig.from_hf(_config()), state_dtype="bfloat16"), TorchOps(),
                      device="meta")
