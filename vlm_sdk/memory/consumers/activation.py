"""The worst step's activations: a full token budget through the decoder beside the largest image's
embeddings (held by a request across the chunks of its prefill), or the largest image through the vision
tower, whichever is larger (the tower's buffers are freed before the decoder runs).

    decoder:  forward(min(max_num_batched_tokens, max_position_embeddings)) + image tokens x hidden x e
    vision:   vision rows of the largest image x (4 x vision hidden + 2 x vision MLP width) x e
              (attention runs in fused kernels: no rows x rows scores)
"""
from __future__ import annotations

from vlm_sdk.memory.consumers.base import MemoryConsumer
from vlm_sdk.memory.inputs import MemoryInputs


def decoder_step_bytes(m: MemoryInputs) -> int:
    return m.forward_bytes(m.profile_tokens) + m.image.tokens * m.hidden_size * m.dtype_bytes


def vision_bytes(m: MemoryInputs) -> int:
    return m.image.patches * (4 * m.vision_hidden + 2 * m.vision_intermediate) * m.dtype_bytes


class Activation(MemoryConsumer):
    name, title = "activation", "activation peak"

    def estimate(self, m: MemoryInputs) -> int:
        return max(decoder_step_bytes(m), vision_bytes(m))
