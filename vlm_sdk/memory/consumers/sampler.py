"""The logits of max_num_seqs rows and the sampler's temporaries for its worst row (penalties, top-k and
top-p, logprobs), beside the held image: what that phase of the step adds over the activation peak
(the decoder's activations are freed before the logits are computed, the vision tower's before the
decoder runs), as the profile measures it, so that the consumers add up to the step's peak:

    max(0, held image + max_num_seqs x vocab x (4 + WORST_BYTES_PER_ENTRY) - activation peak)

The sampler's [rows, vocab] temporaries at their peak, bytes per row and vocabulary entry (float32;
`vlm-sdk bench --sampler` measures them): a draw holds the probabilities and the exponentials (8),
penalties add the edited copy (4), logprobs their log-softmax and the drawn rows' log (8), a top-p
row whose nucleus passes the candidates its full sort (~20); the race kernel, on CUDA, needs no
exponentials. The logits themselves are float32 (4 more).
"""
from __future__ import annotations

from vlm_sdk.memory.consumers.activation import Activation, held_image_bytes
from vlm_sdk.memory.consumers.base import MemoryConsumer
from vlm_sdk.memory.inputs import MemoryInputs

WORST_BYTES_PER_ENTRY = 40  # the sum above, per row and entry (measured 34-40 B on the CPU)
LOGITS_BYTES_PER_ENTRY = 4  # float32 logits


class Sampler(MemoryConsumer):
    name, title = "sampler", "logits + sampler (max_num_seqs rows)"

    def estimate(self, m: MemoryInputs) -> int:
        return max(0, held_image_bytes(m) + rows_bytes(m) - Activation().estimate(m))


def rows_bytes(m: MemoryInputs) -> int:
    """The logits and the sampler's temporaries at max_num_seqs rows. Speculative decoding: a verification
    scores 1 + k rows per sequence (within the step's token budget), their float32 logits all at once, and
    draws one request's rows at a time (worker/spec_verify.py), before the plain rows' logits exist."""
    per_entry = LOGITS_BYTES_PER_ENTRY + WORST_BYTES_PER_ENTRY
    plain = m.args.max_num_seqs * m.vocab_size * per_entry
    spec = m.args.speculative_config
    if spec is None:
        return plain
    k1 = 1 + spec.num_speculative_tokens
    rows = min(m.args.max_num_seqs * k1, m.args.max_num_batched_tokens)
    return max(plain, rows * m.vocab_size * LOGITS_BYTES_PER_ENTRY + k1 * m.vocab_size * WORST_BYTES_PER_ENTRY)
