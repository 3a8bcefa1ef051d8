"""The worst step's activations: a full token budget through the decoder beside the vision embeddings a
request holds across the chunks of its prefill (the largest image, or a chunk's reach of a video's
items: `MemoryInputs.held_vision_tokens`), or the largest image through the vision tower, whichever is
larger (the tower's buffers are freed before the decoder runs).

    decoder:  forward(min(max_num_batched_tokens, max_position_embeddings)) + held vision tokens x hidden x e
              held vision tokens = max(largest image, min(step tokens + 2 x largest video item,
                                                                   max_position_embeddings))
    vision:   vision rows of the largest image x ((5 x vision hidden + 3 x vision MLP width) x e
              + pixel values per row x (e + 1))
              what is alive at a block's MLP: the residual stream, its norm and the patch embedding's
              output (kept by the tower), the MLP's gate|up and its activation; the pixels on the device
              (the uint8 upload and their values in the model's dtype); attention runs in fused kernels
              (no rows x rows scores). On the one GPU record (Qwen2.5-VL-3B shape, 65,536 rows: 2,518 MB
              measured) this gives 2,415 MB, 4% under; the previous 4 x hidden + 2 x MLP gave 1,568 MB
"""
from __future__ import annotations

from vlm_sdk.memory.consumers.base import MemoryConsumer
from vlm_sdk.memory.inputs import MemoryInputs


def held_image_bytes(m: MemoryInputs) -> int:
    """The vision embeddings a request holds across the chunks of its prefill (the largest image, or a
    video's items within a chunk's reach)."""
    return m.held_vision_tokens * m.hidden_size * m.dtype_bytes


def decoder_step_bytes(m: MemoryInputs) -> int:
    return m.forward_bytes(m.profile_tokens) + held_image_bytes(m)


def vision_bytes(m: MemoryInputs) -> int:
    e = m.dtype_bytes
    per_row = (5 * m.vision_hidden + 3 * m.vision_intermediate) * e + m.vision_patch_inputs * (e + 1)
    return m.image.patches * per_row


class Activation(MemoryConsumer):
    name, title = "activation", "activation peak"

    def estimate(self, m: MemoryInputs) -> int:
        return max(decoder_step_bytes(m), vision_bytes(m))
