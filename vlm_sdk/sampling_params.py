"""Per-request sampling and stopping settings."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from vlm_sdk.errors import InvalidRequestError

# below this a temperature would overflow float32 logits / T; it means "greedy" in practice
MIN_TEMPERATURE = 1e-5
# the smallest normal float32: the sampler compares top_p as a float32, where a smaller value can
# become 0 (and 0 masks every token); nobody means a nucleus that small
MIN_TOP_P = 1.1754943508222875e-38
# what torch.Generator.manual_seed accepts
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 64 - 1
# output tokens of a request that does not say; None ("not set") runs to max_model_len instead, and the
# too-long error then sizes its fixes for this many
DEFAULT_MAX_TOKENS = 256


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _refuse(name: str, rule: str, value) -> None:
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:80] + "..."  # a megabyte string stays out of the message
    raise InvalidRequestError(f"'{name}' {rule}, got {shown}", param=name)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 (or below 1e-5) is greedy. A `seed` gives this request its own random stream, so
    its samples do not depend on which other requests share the batch."""
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    # parallel samples of one prompt, built (and its image encoded) once; sample i draws from seed + i
    n: int = 1

    def __post_init__(self):
        # accept lists and a single string for convenience, keep the dataclass hashable
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if stop is None:
            stop = ()
        if not isinstance(stop, (list, tuple)) or any(not isinstance(s, str) or not s for s in stop):
            _refuse("stop", "must be a non-empty string or a list of them", self.stop)
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids or ()
        if not isinstance(ids, (list, tuple)) or any(not _is_int(t) or t < 0 for t in ids):
            _refuse("stop_token_ids", "must be a list of token ids (integers >= 0)", self.stop_token_ids)
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            _refuse("max_tokens", "must be an integer >= 1 (or None: up to max_model_len)", self.max_tokens)
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            _refuse("temperature", "must be a finite number >= 0 (0 = greedy)", self.temperature)
        if not _is_number(self.top_p) or not MIN_TOP_P <= self.top_p <= 1.0:
            _refuse("top_p", f"must be a number in (0, 1], at least {MIN_TOP_P:.4g} (below it float32 sampling "
                             f"rounds it to 0)", self.top_p)
        if not _is_int(self.top_k) or self.top_k < -1:
            _refuse("top_k", "must be an integer >= 0 (0 or -1 disables it)", self.top_k)
        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            _refuse("seed", f"must be an integer from {SEED_MIN} to {SEED_MAX} or None", self.seed)
        if not isinstance(self.ignore_eos, bool):
            _refuse("ignore_eos", "must be True or False", self.ignore_eos)
        if not _is_int(self.n) or self.n < 1:
            _refuse("n", "must be an integer >= 1", self.n)

    def sample(self, i: int) -> "SamplingParams":
        """The params of sample i of n: one sample, seed + i (wrapped into the seed range), so n seeded
        samples differ from each other and each is reproducible."""
        seed = self.seed
        if seed is not None and i:
            seed = (seed + i - SEED_MIN) % (SEED_MAX - SEED_MIN + 1) + SEED_MIN
        return replace(self, n=1, seed=seed)

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE
