"""Float tolerances from the arithmetic, not from one machine.

Two computations of one value that add the same terms in another order (tensor-parallel partial sums,
split-K, a chunked prefill against a whole one, a kernel against its torch reference, our model against
transformers') differ by rounding alone. A sum of n terms rounds at most n times, each time by at most
half an ulp of the running sum: two orders' results lie within about n * eps * sum|t_i| of each other
(Higham, *Accuracy and Stability of Numerical Algorithms*, 3.1). Terms of mixed sign make sum|t_i|
larger than the result, by about sqrt(n) for random signs, while rounding errors of random sign add up
to about sqrt(n) * eps * sum|t_i|, not n * eps: the two sqrt(n) cancel, and n * eps * |result| bounds
the gap. Reductions that feed each other (a matmul, then attention over its output, layer after layer)
add their errors to first order, so n is the number of additions along the longest chain: the sum of
each chained reduction's length. Values stored in a narrower dtype between operations (float16 or
bfloat16 inputs, probabilities cast down before the second product) add one rounding of that dtype per
term: sqrt(n) * eps(storage) for random signs, or at most 2 * eps(storage) * max|v| for a convex
combination such as attention's softmax-weighted sum of values (the weights sum to 1; the output is
rounded once more). So

    atol = max|expected| * (n * eps(accumulate) + r * eps(storage))

with r = sqrt(n) storage roundings for random-sign terms, or the count a chain makes whatever n (2 for
attention's convex combination; 2 for a normalised row rounded, then scaled and rounded again).

whatever the CPU's vector width, the BLAS blocking or the GPU's tile sizes. `accumulate` is float32
(every kernel and matmul here accumulates in it), `storage` the values' own dtype. A real defect (a
wrong shard, a wrong position, a dropped term) moves values by a fraction of max|expected|, orders of
magnitude above this in float32; the tests also check that the expected values spread.
"""
from __future__ import annotations

import math

import torch


def reduction_atol(expected: torch.Tensor, terms: int, storage: torch.dtype | None = None,
                   roundings: float | None = None, accumulate: torch.dtype = torch.float32) -> float:
    """The largest gap between two summation orders of a chain of `terms` additions whose result is the
    size of `expected`, with `roundings` to `storage` on the way (default sqrt(terms)); see the module
    docstring."""
    storage_eps = torch.finfo(storage or expected.dtype).eps
    roundings = math.sqrt(terms) if roundings is None else roundings
    per_unit = terms * torch.finfo(accumulate).eps + roundings * storage_eps
    return per_unit * float(expected.detach().abs().max())


def attention_terms(head_dim: int, seq_len: int) -> int:
    """Additions along attention's chain: the scores over head_dim, then the values over seq_len keys."""
    return head_dim + seq_len


def assert_reduction_close(actual: torch.Tensor, expected: torch.Tensor, terms: int,
                           storage: torch.dtype | None = None, roundings: float | None = None,
                           msg: str = "") -> None:
    """assert_close with `reduction_atol`'s bound (rtol 0: the bound is absolute by construction)."""
    atol = reduction_atol(expected, terms, storage, roundings)
    torch.testing.assert_close(
        actual, expected, atol=atol, rtol=0,
        msg=lambda m: f"{msg}{': ' if msg else ''}{m} (bound for a chain of {terms} additions: {atol:.3g})")


def layer_terms(hidden: int, intermediate: int, tokens: int, head_dim: int = 0) -> int:
    """Additions along one transformer layer's longest chain: q/k/v (hidden terms), scores (head_dim),
    probabilities times values (tokens), o_proj (hidden), the MLP's up (hidden) and down (intermediate)."""
    return 3 * hidden + head_dim + tokens + intermediate


def forward_terms(*, layers: int, hidden: int, intermediate: int, tokens: int, head_dim: int = 0,
                  vision_layers: int = 0, vision_hidden: int = 0, vision_intermediate: int = 0,
                  vision_tokens: int = 0, patch: int = 0, merger: int = 0) -> int:
    """Additions along a vision-language model's longest chain: the patch embedding (`patch` inputs per
    patch), the vision blocks, the projector (`merger`: the sum of its matmuls' input widths), the
    decoder layers and the LM head."""
    vision = vision_layers * layer_terms(vision_hidden, vision_intermediate, vision_tokens)
    return patch + vision + merger + layers * layer_terms(hidden, intermediate, tokens, head_dim) + hidden
