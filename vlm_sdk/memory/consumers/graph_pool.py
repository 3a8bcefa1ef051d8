"""The decode CUDA graphs' memory pool, kept for good once captured: about a decode forward of the largest
captured batch (max_num_seqs rows) with its logits (the graphs end with the logits and their argmax:
the product in the model's dtype in the pool, and the graphs' static float32 logits buffer);
eager steps run beside it."""
from __future__ import annotations

from vlm_sdk.memory.consumers.base import MemoryConsumer
from vlm_sdk.memory.inputs import MemoryInputs


class DecodeGraphPool(MemoryConsumer):
    name, title = "decode_graph_pool", "decode CUDA graphs' pool"

    def applies(self, m: MemoryInputs) -> bool:
        return m.on_gpu and m.decode_graphs

    def estimate(self, m: MemoryInputs) -> int:
        rows = m.args.max_num_seqs
        return m.forward_bytes(rows) + rows * m.vocab_size * (m.dtype_bytes + 4)
