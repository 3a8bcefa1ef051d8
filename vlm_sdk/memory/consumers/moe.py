"""The sparse MoE layers' step buffers (vlm_sdk/layers/moe.py and the kernel set's `fused_moe`), for the
worst step's tokens on one rank; the layers run one after another, so one layer's buffers are the peak.
The experts' weights are parameters (the weights consumer counts them); the dense MLP's term of the
activation peak counts only when some layer is dense (`MemoryInputs.intermediate_size`).

    n tokens, K experts per token (P = n K pairs), E experts, H hidden, I' = moe_intermediate_size / tp,
    e the dtype's bytes; under expert parallelism E = num_experts / tp (a rank's) and I' = the whole
    width (a rank computes only its experts' pairs; P still bounds them):

    routing       n E (e + 4)              the router's logits and their float32 softmax
                  P 16 + P 40              top-k weights (float32, renormalised) and ids; the sort's int64s
    Triton set    P (I' + H) e             gate_up with SiLU-and-mul, then down, one row per pair
                  4 (P + E (64 - 1))       the sorted pairs, each expert's run padded to 64 rows
                  n H (4 + e)              the sum over the K choices (float32) and its cast
    torch set     P H (2 e + 4) + P 2 I' 4 each pair's row of x, down, its weighted float32 copy, gate|up
                  n H (4 + e)
                  E I' H max(24, 3 e)      block-wise FP8 experts: the layer's experts dequantized for the
                                           step (gate|up: the float32 weights, scales and product, 2 x 12;
                                           then all three in the dtype); the Triton set reads FP8 tiles

With decode CUDA graphs, their pool also keeps a decode step's buffers (max_num_seqs tokens). On a GPU
the profile's measured "activation" step and graph pool run the same layers, so they hold these
buffers: counted there, this consumer then counts nothing (`measured`).
"""
from __future__ import annotations

from typing import Mapping

from vlm_sdk.memory.consumers.base import MemoryConsumer
from vlm_sdk.memory.inputs import MemoryInputs

_BLOCK_M = 64  # kernels/fused_moe.py's larger row block: the padding bound


def moe_step_bytes(m: MemoryInputs, tokens: int) -> int:
    moe, e, h = m.moe, m.dtype_bytes, m.hidden_size
    pairs = tokens * moe.top_k
    if m.args.enable_expert_parallel:
        local_experts, inter = moe.num_experts // m.tp, moe.intermediate_size
    else:
        local_experts, inter = moe.num_experts, moe.intermediate_size // m.tp
    routing = tokens * moe.num_experts * (e + 4) + pairs * (16 + 40)
    if torch_set(m):
        experts = pairs * h * (2 * e + 4) + pairs * 2 * inter * 4
        if m.moe_fp8:
            experts += local_experts * inter * h * max(24, 3 * e)
    else:
        experts = pairs * (inter + h) * e + 4 * (pairs + local_experts * (_BLOCK_M - 1))
    return routing + experts + tokens * h * (4 + e)


def torch_set(m: MemoryInputs) -> bool:
    """Whether the engine runs the torch kernel set (the CPU, or attention_backend="torch")."""
    return not m.on_gpu or m.args.attention_backend == "torch"


class MoeActivation(MemoryConsumer):
    name, title = "moe_activation", "MoE experts' step buffers"

    def applies(self, m: MemoryInputs) -> bool:
        return m.moe is not None

    def estimate(self, m: MemoryInputs) -> int:
        graphs = moe_step_bytes(m, m.args.max_num_seqs) if m.on_gpu and m.decode_graphs else 0
        return moe_step_bytes(m, m.profile_tokens) + graphs

    def measured(self, m: MemoryInputs, profile: Mapping[str, int]) -> int | None:
        return 0 if "activation" in profile else None  # inside the measured step
