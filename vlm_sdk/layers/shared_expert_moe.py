"""A sparse MoE MLP with a gated shared expert (Qwen2-MoE's, Qwen3-Next's and Qwen3.5-MoE's; transformers'
`Qwen3_5MoeSparseMoeBlock`): each token goes through its routed experts (`SparseMoeBlock`, the fused MoE op)
and through one dense SwiGLU expert every token shares, scaled by a sigmoid gate of its own:

    out = routed(x) + sigmoid(x W_g^T) * down_s(silu(gate_s(x)) * up_s(x))      W_g [1, H]

Tensor parallelism: the routed experts as `SparseMoeBlock` splits them (each expert's width, or whole
experts under expert parallelism); the shared expert as a dense MLP over the tensor-parallel ranks (gate|up
column-, down row-parallel; under expert parallelism too: there is one of it); W_g whole on every rank.
Both parts' partial sums are added before ONE all-reduce: the gate scales each token's row by the same
number on every rank, so it commutes with the sum. `shared_expert_intermediate_size` must divide by the
ranks (`ValueError` naming it otherwise, which the engine's size check turns into the sizes that work).

Checkpoint names under the layer's prefix (e.g. `model.language_model.layers.N.mlp.`): `SparseMoeBlock`'s
(gate.weight and the per-expert tensors), shared_expert.{gate,up,down}_proj.weight, shared_expert_gate.weight.
"""
from __future__ import annotations

import torch
from torch import nn

from vlm_sdk.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from vlm_sdk.layers.moe import MoeConfig, SparseMoeBlock
from vlm_sdk.layers.ops import KernelOps
from vlm_sdk.layers.parallel_state import TPGroup
from vlm_sdk.weight_loading import ParamSlot


class SharedExpertMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, moe: MoeConfig, shared_intermediate_size: int, ops: KernelOps,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", tp: TPGroup = TPGroup(),
                 *, ep: TPGroup = TPGroup()):
        super().__init__()
        self.ops, self.tp = ops, tp
        self.routed = SparseMoeBlock(hidden_size, moe, ops, dtype, device, tp, ep=ep)
        inter = shared_intermediate_size
        tp.split(inter, "shared_expert_intermediate_size (the shared expert's MLP width)")
        self.shared_gate_up = MergedColumnParallelLinear(hidden_size, [inter, inter], False, dtype, device, tp)
        self.shared_down = RowParallelLinear(inter, hidden_size, False, dtype, device, tp)
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False, dtype=dtype, device="meta").to_empty(
            device=device)  # whole on every rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, hidden], summed over the ranks
        shared = self.shared_down.partial(self.ops.silu_and_mul(self.shared_gate_up(x)))  # [N, hidden], this rank's
        out = self.routed(x, reduce=False)  # [N, hidden], this rank's
        out += torch.sigmoid(self.shared_expert_gate(x)) * shared  # [N, 1] * [N, hidden]
        return self.tp.all_reduce(out)

    def slots(self, src: str, dst: str) -> dict[str, ParamSlot]:
        """The published names under `src` (`...layers.N.mlp.`) -> this rank's slices under `dst`."""
        out = self.routed.slots(src, f"{dst}routed.")
        shared = f"{src}shared_expert."
        out.update(self.shared_gate_up.slots(f"{dst}shared_gate_up.", [f"{shared}gate_proj.weight",
                                                                         f"{shared}up_proj.weight"]))
        out.update(self.shared_down.slots(f"{dst}shared_down.", f"{shared}down_proj.weight"))
        out[f"{src}shared_expert_gate.weight"] = ParamSlot(f"{dst}shared_expert_gate.weight",
                                                          (1, self.routed.hidden_size))
        return out
