"""A sparse mixture-of-experts MLP (Qwen3-MoE's, which Qwen3-VL-MoE uses): a router picks `top_k` of
`num_experts` SwiGLU experts per token and the token's output is their routing-weighted sum.

    logits  = x W_router^T                                 [N, E]   (the model's dtype)
    probs   = softmax(logits, float32)                     [N, E]
    w, ids  = top_k(probs)                                 [N, K]   (w / sum(w) when norm_topk_prob)
    out[t]  = sum_j w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)),  e = ids[t, j]

The experts run in one call of the kernel set (`KernelOps.fused_moe`: tokens sorted by expert, one
grouped product for gate | up with SiLU-and-mul, one for down with the routing weights); the routing is
torch's softmax and top-k on the tokens' device (no host sync).

Parameters, one tensor per kind for all experts (the kernel's operands), in transformers 5's orientation:

    w13  [E * 2I', H]  expert e's rows [e*2I', e*2I' + I') = its gate_proj, the next I' rows its up_proj
    w2   [E * H, I']   expert e's rows [e*H, (e+1)*H) = its down_proj
    gate [E, H]        the router (an `nn.Linear`)

Tensor parallelism (`tp`) splits every expert along its intermediate dim, as the dense MLP is split:
rank r holds I' = I / tp columns [r*I', (r+1)*I') of each gate and up (rows of w13) and the same
columns of each down (w2), computes every routed pair on its slice and all-reduces the partial sums:
one all-reduce per layer. The router is whole on every rank, so all ranks route alike. The weights are
2-D so that each checkpoint tensor of one expert (`slots`: the published per-expert names) fills a
row range, which is what `load_checked` places.

Expert parallelism (`ep`, a group of the tensor-parallel ranks themselves: `ParallelGroups.ep` under
vLLM's `enable_expert_parallel`, with its linear placement): rank r holds E' = E / tp whole experts, [r*E', (r+1)*E') (I' = I), the parameters above with E' for E.
Every rank routes every token over all E experts (the router is whole), keeps the pairs whose expert it
holds (the others become id -1, which the kernel set's fused_moe skips) and computes their weighted
sum; the same one all-reduce per layer adds the ranks' parts. num_experts must divide by tp.

Block-wise FP8 experts (`quant`: an `FP8BlockScheme`, the Qwen3-VL-*-FP8 checkpoints, whose experts are
per-expert tensors with a `weight_scale_inv` each): w13 and w2 are held as float8_e4m3fn and beside
them their float32 block scales, stacked the same way (B0 x B1 = weight_block_size):

    w13_scale_inv  [E * 2I' / B0, ceil(H / B1)]   expert e's gate block rows, then its up block rows
    w2_scale_inv   [E * ceil(H / B0), I' / B1]

which the kernel set's fused_moe dequantizes per tile. The block rows of gate and up may not straddle
(I' a multiple of B0) and a rank's columns of down must be whole blocks (I' a multiple of B1): else
the layer is refused at construction naming the sizes, as vLLM refuses them. The router stays float
(vLLM builds it unquantized; the FP8 checkpoints keep it so).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vlm_sdk.kernels.fused_moe_torch import ExpertScales
from vlm_sdk.layers.ops import KernelOps
from vlm_sdk.layers.parallel_state import TPGroup
from vlm_sdk.layers.quantization import QuantScheme
from vlm_sdk.layers.quantization.fp8 import FP8BlockScheme
from vlm_sdk.weight_loading import ParamSlot, Shard


@dataclass(frozen=True)
class MoeConfig:
    """The experts of a Qwen3-MoE style decoder (transformers' `Qwen3MoeConfig` / `Qwen3VLMoeTextConfig`
    fields). A layer is sparse when it is not in `mlp_only_layers` and (index + 1) is a multiple of
    `decoder_sparse_step`; the other layers keep the dense MLP of `intermediate_size`."""
    num_experts: int
    top_k: int  # num_experts_per_tok
    intermediate_size: int  # moe_intermediate_size: each expert's
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self):
        if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) must be from 1 to num_experts ({self.num_experts})")
        if self.intermediate_size < 1 or self.decoder_sparse_step < 1:
            raise ValueError(f"moe_intermediate_size ({self.intermediate_size}) and decoder_sparse_step "
                             f"({self.decoder_sparse_step}) must be positive")

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


def route(router_logits: torch.Tensor,  # [N, E]
          top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [N, K] float32, expert ids [N, K] int64): softmax over the experts in float32, the top k,
    divided by their sum when `renormalize` (transformers' `Qwen3VLMoeTextTopKRouter`)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [N, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [N, K]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, moe: MoeConfig, ops: KernelOps, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", tp: TPGroup = TPGroup(), quant: QuantScheme | None = None,
                 *, ep: TPGroup = TPGroup()):
        super().__init__()
        if ep.size > 1 and (ep.size, ep.rank) != (tp.size, tp.rank):
            raise ValueError(f"expert-parallel rank {ep.rank} of {ep.size} must be the tensor-parallel rank "
                             f"{tp.rank} of {tp.size}: experts are spread over the tensor-parallel ranks")
        self.ops, self.tp, self.moe = ops, tp, moe
        self.hidden_size = hidden_size
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.intermediate_size = moe.intermediate_size  # the whole expert's
        self.expert_parallel = ep.size > 1
        if self.expert_parallel:  # whole experts, E' of them
            self.local_experts = ep.split(moe.num_experts, "num_experts (whole experts per rank under expert "
                                                           "parallelism)")
            self.local_intermediate = moe.intermediate_size
        else:  # every expert, I' of its width
            self.local_experts = moe.num_experts
            self.local_intermediate = tp.split(moe.intermediate_size, "moe_intermediate_size (each expert's MLP width)")
        self.expert_start = ep.rank * self.local_experts if self.expert_parallel else 0
        e, i, h = self.local_experts, self.local_intermediate, hidden_size
        self.block = _fp8_block(quant, i, tp.size)
        weight_dtype = dtype if self.block is None else torch.float8_e4m3fn
        self.gate = nn.Linear(h, self.num_experts, bias=False, dtype=dtype, device="meta")
        # allocated where it belongs, as _Linear's weights (to_empty would run torch's reference kernels)
        self.gate.weight = nn.Parameter(torch.empty(self.num_experts, h, device=device, dtype=dtype))
        self.w13 = nn.Parameter(torch.empty(e * 2 * i, h, dtype=weight_dtype, device=device), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e * h, i, dtype=weight_dtype, device=device), requires_grad=False)
        if self.block is not None:
            b0, b1 = self.block
            self.w13_scale_inv = nn.Parameter(torch.empty(e * 2 * i // b0, -(-h // b1), device=device),
                                              requires_grad=False)
            self.w2_scale_inv = nn.Parameter(torch.empty(e * -(-h // b0), i // b1, device=device),
                                             requires_grad=False)

    def forward(self, x: torch.Tensor,  # [N, hidden]
                reduce: bool = True) -> torch.Tensor:  # [N, hidden], summed over the ranks (this rank's part
        # when not `reduce`: a layer that adds more partial sums before one all-reduce)
        weights, ids = route(self.gate(x), self.top_k, self.moe.norm_topk_prob)  # [N, K] x 2
        e = self.local_experts
        if self.expert_parallel:  # this rank's experts numbered from 0; the others' pairs -1 (skipped)
            ids = ids - self.expert_start
            ids = torch.where((ids >= 0) & (ids < e), ids, -1)  # [N, K]
        scales = None if self.block is None else ExpertScales(
            self.w13_scale_inv.view(e, -1, self.w13_scale_inv.shape[1]),  # [E, 2I' / B0, ceil(H / B1)]
            self.w2_scale_inv.view(e, -1, self.w2_scale_inv.shape[1]), self.block)  # [E, ceil(H / B0), I' / B1]
        out = self.ops.fused_moe(x, *self.experts(), weights, ids, scales)  # [N, hidden]
        return self.tp.all_reduce(out) if reduce else out

    def experts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2I', H], w2 [E, H, I']): the kernel's operands, views of the parameters (3-D already
        after `use_cpu_layout`)."""
        if self.w13.dim() == 3:
            return self.w13, self.w2
        e, i, h = self.local_experts, self.local_intermediate, self.hidden_size
        return self.w13.view(e, 2 * i, h), self.w2.view(e, h, i)

    @torch.no_grad()
    def use_cpu_layout(self) -> None:
        """After loading, for the torch kernel set on the CPU: each expert's weights stored transposed
        (storage [E, H, 2I'] and [E, I', H], the same logical [E, 2I', H] and [E, H, I']), as
        models/cpu_layout.py stores every Linear: a product of a few rows by an [in, out] weight runs
        up to 2x faster on the CPU than by [out, in] (the bench shape's layer at 64 tokens: 2.6 ms vs
        5.8 ms on one core; at 16, ~4 rows per expert, no gain: BENCHMARKS.md). Float experts only (FP8
        ones are dequantized per call); no-op elsewhere."""
        if self.block is not None or self.w13.device.type != "cpu" or self.ops.name != "torch":
            return
        self.w13, self.w2 = (nn.Parameter(w.transpose(1, 2).contiguous().transpose(1, 2), requires_grad=False)
                             for w in self.experts())

    def expert_range(self) -> range:
        """The experts whose weights this rank holds (all but under expert parallelism)."""
        return range(self.expert_start, self.expert_start + self.local_experts)

    def slots(self, src: str, dst: str) -> dict[str, ParamSlot]:
        """The published per-expert names under `src` (`model.language_model.layers.N.mlp.`) -> this
        rank's slices of the parameters under `dst`: `gate.weight` [E, H], and per expert e
        `experts.e.{gate,up}_proj.weight` [I, H] (rows I' of each) and `experts.e.down_proj.weight` [H, I]
        (columns I'); under expert parallelism only this rank's experts, whole (the model drops the
        other ranks' expert tensors before loading)."""
        e_all, inter, i, h = self.num_experts, self.intermediate_size, self.local_intermediate, self.hidden_size
        split = self.tp.size > 1 and not self.expert_parallel
        rows = Shard(0, self.tp.rank * i, i) if split else None
        cols = Shard(1, self.tp.rank * i, i) if split else None
        out = {f"{src}gate.weight": ParamSlot(f"{dst}gate.weight", (e_all, h))}
        for e in self.expert_range():
            expert, local = f"{src}experts.{e}.", e - self.expert_start
            out[f"{expert}gate_proj.weight"] = ParamSlot(f"{dst}w13", (inter, h), local * 2 * i, rows)
            out[f"{expert}up_proj.weight"] = ParamSlot(f"{dst}w13", (inter, h), local * 2 * i + i, rows)
            out[f"{expert}down_proj.weight"] = ParamSlot(f"{dst}w2", (h, inter), local * h, cols)
        if self.block is not None:
            out.update(self._scale_slots(src, dst))
        return out

    def _scale_slots(self, src: str, dst: str) -> dict[str, ParamSlot]:
        """Each expert's `weight_scale_inv` [ceil(rows / B0), ceil(cols / B1)] -> its block rows of the
        stacked scales, this rank's I' / B block rows (gate, up) or columns (down)."""
        (b0, b1), h = self.block, self.hidden_size
        inter, si0, si1, sh0, sh1 = self.intermediate_size, self.local_intermediate // b0, \
            self.local_intermediate // b1, -(-h // b0), -(-h // b1)
        split = self.tp.size > 1 and not self.expert_parallel
        rows = Shard(0, self.tp.rank * si0, si0) if split else None
        cols = Shard(1, self.tp.rank * si1, si1) if split else None
        out = {}
        for e in self.expert_range():
            expert, local = f"{src}experts.{e}.", e - self.expert_start
            for k, name in enumerate(("gate_proj", "up_proj")):
                out[f"{expert}{name}.weight_scale_inv"] = ParamSlot(f"{dst}w13_scale_inv", (-(-inter // b0), sh1),
                                                                    (2 * local + k) * si0, rows)
            out[f"{expert}down_proj.weight_scale_inv"] = ParamSlot(f"{dst}w2_scale_inv", (sh0, -(-inter // b1)),
                                                                   local * sh0, cols)
        return out


def _fp8_block(quant: QuantScheme | None, local_intermediate: int, tp_size: int) -> tuple[int, int] | None:
    """The experts' FP8 block (B0, B1), None for float experts; `ValueError` for another format or an
    expert width (per rank) that cuts a block."""
    if quant is None:
        return None
    if not isinstance(quant, FP8BlockScheme):
        raise ValueError(f"{quant.description} experts are not supported: quantized experts are read in block-wise "
                         f"FP8 only (quant_method fp8 with weight_block_size)")
    b0, b1 = quant.block
    if local_intermediate % b0 or local_intermediate % b1:
        raise ValueError(f"moe_intermediate_size per rank ({local_intermediate} at tensor_parallel_size {tp_size}) "
                         f"is not a multiple of the FP8 weight_block_size {list(quant.block)}: each rank's gate, up "
                         f"and down must hold whole blocks")
    return b0, b1

