"""The worker's structured-output mask on the CPU equals the bitmask kernel's torch reference: only the
constrained rows change, and exactly the tokens whose bit is clear (llguidance's layout) become -inf."""
import torch

from vlm_sdk.kernels.token_bitmask import apply_token_bitmask_ref
from vlm_sdk.sample.token_mask import apply_token_bitmask, forbidden_tokens


def test_mask_equals_the_kernel_reference_on_the_constrained_rows_only():
    gen = torch.Generator().manual_seed(0)
    vocab = 1000  # not a multiple of 32: the last word is partly past the vocabulary
    logits = torch.randn(6, vocab, generator=gen)  # [6, vocab]
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, (vocab + 31) // 32), dtype=torch.int32, generator=gen)
    rows = [4, 0, 3]
    ours, ref = logits.clone(), logits.clone()
    apply_token_bitmask(ours, rows, bitmask)
    apply_token_bitmask_ref(ref, torch.tensor(rows), bitmask)
    assert torch.equal(ours, ref)
    assert torch.equal(ours[[1, 2, 5]], logits[[1, 2, 5]])  # free rows untouched
    # bit t of word w is token 32w + t
    forbidden = forbidden_tokens(bitmask, vocab)
    for j in range(3):
        for token in (0, 31, 32, 517, vocab - 1):
            allowed = (int(bitmask[j, token // 32]) >> (token % 32)) & 1
            assert bool(forbidden[j, token]) == (not allowed)


def test_logits_wider_than_the_grammar_vocabulary_forbid_the_rest():
    logits = torch.zeros(2, 70)  # [2, 70]: the bitmask covers 64 tokens
    bitmask = torch.full((1, 2), -1, dtype=torch.int32)  # every covered token allowed
    apply_token_bitmask(logits, [1], bitmask)
    assert torch.isinf(logits[1, 64:]).all() and (logits[1, :64] == 0).all() and (logits[0] == 0).all()
