"""What the engine measured at start-up, in the same terms (and JSON keys) as `vlm-sdk plan`.

    weights     bytes of the loaded parameters by part (and, on CUDA, what loading allocated)
    consumers   every memory consumer (vlm_sdk/memory/consumers/), measured by the profiling forward on
                CUDA (`max_memory_allocated`), estimated otherwise; on the CPU the cache is not carved out
                of device memory, so the activation peak is not measured
    encoder     encoder_cache_memory: the most bytes of vision embeddings kept for reuse (on CUDA set
                aside from the memory_utilization budget before the KV cache is sized)
    KV cache    bytes per token and per block, the blocks allocated, their token capacity; a model of
                several cache groups: each group's kind, layers and blocks of one max_model_len sequence,
                and the state slots (`cache_group_rows`, shared with `vlm-sdk plan`)

The engine logs `format()` once the cache is allocated; `LLM.memory_report` keeps it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from fractions import Fraction

from vlm_sdk.memory.kv_dtypes import kv_dtype_rows
from vlm_sdk.protocol.cache_layout import CacheLayout


def format_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit} ({n:,} B)"
    return f"{n:,} B"


def table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def consumer_rows(consumers) -> list[tuple[str, str]]:
    """One report row per memory consumer (`memory.breakdown.ConsumerBytes`), the same in `vlm-sdk plan`
    and the start-up report."""
    return [(f"  {c.title}", f"{format_bytes(c.bytes)} ({'measured' if c.measured else 'estimated'})")
            for c in consumers]


def encoder_cache_text(num_bytes: int, cache_source: str) -> str:
    """The encoder cache's line, shared with `vlm-sdk plan`. A KV cache sized by memory_utilization
    (`memory.kv.size_cache` names the rule first in `cache_source`) had the bound set aside first."""
    if num_bytes == 0:
        return "off (encoder_cache_memory=0: every image goes through the vision tower)"
    where = ("set aside from the memory_utilization budget before sizing the KV cache"
             if cache_source.startswith("memory_utilization=") else "taken as images arrive, beside the KV cache")
    return f"up to {format_bytes(num_bytes)} of vision embeddings kept for reuse (encoder_cache_memory); {where}"


def kv_token_text(per_token: int, layers: int, kv_heads: int, head_dim: int, kv_dtype: str) -> str:
    """The KV-per-token line, shared with `vlm-sdk plan`: its arithmetic and the cache's dtype (an FP8
    cache names its per-layer scales). `layers`: those a block holds pages of (group_size; every layer
    for a model of one attention kind)."""
    if kv_dtype in ("int8", "int4"):  # codes plus a float32 scale and zero a token and head
        width = head_dim if kv_dtype == "int8" else f"{head_dim}/2"
        return (f"{per_token:,} B ({layers} layers x 2 x {kv_heads} KV heads x ({width} code bytes + 8 B scale and "
                f"zero)) (kv_cache_dtype='{kv_dtype}': per-token, per-head asymmetric, LMDeploy's quant_policy "
                f"{8 if kv_dtype == 'int8' else 4})")
    fp8 = " (kv_cache_dtype='fp8': e4m3 with per-layer K and V scales)" if kv_dtype.startswith("float8") else ""
    size = {"float32": 4, "bfloat16": 2, "float16": 2}.get(kv_dtype, 1)
    extra = per_token - layers * 2 * kv_heads * head_dim * size  # an EAGLE-3 draft's page rides in every block
    draft = f" + {extra:,} B of the EAGLE-3 draft layer's K and V" if extra > 0 else ""
    return f"{per_token:,} B ({layers} layers x 2 x {kv_heads} KV heads x {head_dim} x {kv_dtype}{draft}){fp8}"


def cache_groups(layout: CacheLayout | None, block_size: int, chunk_tokens: int, max_model_len: int) -> tuple[dict, ...]:
    """Each cache group's share, plain data (reports and JSON): kind, layers, window, the bytes of a block
    its layers use, and the blocks one max_model_len sequence holds in it; a state group's bytes per
    slot. () for a model of one full-attention group."""
    if layout is None or len(layout.groups) == 1:
        return ()
    page = layout.page_spec.page_bytes(block_size)
    out = []
    for g in layout.groups:
        s = g.spec
        if s.kind == "state":
            out.append({"kind": "state", "layers": list(g.layers), "slot_bytes": s.slot_bytes})
            continue
        one = CacheLayout.from_specs([s])  # this group alone: its blocks for one sequence
        out.append({"kind": s.kind, "layers": list(g.layers), "window": s.window,
                    "block_bytes_used": len(g.layers) * page,
                    "blocks_per_sequence": one.blocks_for_tokens(max_model_len, block_size, chunk_tokens)})
    return tuple(out)


def at_once_text(at_once: tuple, max_model_len: int) -> str:
    """The start-up capacity line: requests at once by their tokens, images counted as the plan counts them."""
    out = []
    for tokens, images, per_image, count in at_once:
        what = f"{count:,} request{'' if count == 1 else 's'} of {tokens:,} tokens"
        if images:
            what += (f", each with {images} image{'s' if images > 1 else ''} at the largest allowed size "
                     f"({per_image:,} tokens each) + {tokens - images * per_image:,} text and output")
        elif tokens == max_model_len:
            what += " (max_model_len)"
        out.append(what)
    return "; ".join(out)


def cache_group_rows(groups: tuple[dict, ...], group_size: int, num_state_slots: int, state_slot_bytes: int,
                     max_model_len: int) -> list[tuple[str, str]]:
    """The report rows of `cache_groups` (the same in `vlm-sdk plan` and the start-up report)."""
    if not groups:
        return []
    rows = []
    for i, g in enumerate(groups):
        if g["kind"] == "state":
            rows.append((f"  group {i}: state", f"layers {g['layers']}: {format_bytes(g['slot_bytes'])} per slot"))
            continue
        what = "full attention" if g["kind"] == "full" else f"sliding window {g['window']}"
        wasted = "" if len(g["layers"]) == group_size else \
            f" (the block's pages of {group_size - len(g['layers'])} missing layers unused)"
        rows.append((f"  group {i}: {what}", f"layers {g['layers']}: {format_bytes(g['block_bytes_used'])} of each "
                     f"of its blocks{wasted}; one {max_model_len:,}-token sequence holds {g['blocks_per_sequence']:,} "
                     f"of them"))
    if num_state_slots:
        rows.append(("state slots", f"{num_state_slots:,} x {format_bytes(state_slot_bytes)} = "
                     f"{format_bytes(num_state_slots * state_slot_bytes)}, carved out before the blocks: a live "
                     f"slot per running request, the rest prefix-cache checkpoints (num_state_slots)"))
        attending = sum(len(g["layers"]) for g in groups if g["kind"] != "state")
        every = sum(len(g["layers"]) for g in groups)
        share = Fraction(attending, every)
        rows.append(("a token, a request", f"a token's KV is that of the {attending} attending layers of {every} "
                     f"({share.numerator}/{share.denominator} of a same-size model attending in every layer); a "
                     f"request's state is a fixed {format_bytes(state_slot_bytes)}, whatever its length"))
    return rows


class MemoryTotals:
    """Totals shared by the plan (`MemoryPlan`) and the measured start-up (`StartupMemory`)."""
    weights_language_model_bytes: int
    weights_vision_bytes: int
    weights_projector_bytes: int
    num_blocks: int
    block_size: int
    kv_bytes_per_block: int
    encoder_cache_bytes: int  # the encoder cache's bound (encoder_cache_memory); 0: no encoder cache
    cache_capacity_tokens: int | None  # the longest sequence the blocks hold; None: num_blocks * block_size
    num_state_slots: int
    state_slot_bytes: int

    weights_draft_bytes: int = 0  # a speculative draft's (EAGLE-3); the dataclasses below may set it

    @property
    def weights_bytes(self) -> int:
        return self.weights_language_model_bytes + self.weights_vision_bytes + self.weights_projector_bytes \
            + self.weights_draft_bytes

    @property
    def capacity_tokens(self) -> int:
        if self.cache_capacity_tokens is not None:
            return self.cache_capacity_tokens
        return self.num_blocks * self.block_size

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.kv_bytes_per_block

    @property
    def state_bytes(self) -> int:
        return self.num_state_slots * self.state_slot_bytes


@dataclass(frozen=True)
class RankMemory:
    """One tensor-parallel rank at start-up."""
    rank: int
    device: str
    weights_bytes: int  # its slice of the model
    activation_peak_bytes: int | None  # CUDA: its profiled peak
    num_blocks_possible: int  # the KV blocks it could hold alone (every rank gets the smallest of these)
    layers: tuple[int, int] | None = None  # pipeline parallelism: the decoder layers [start, stop) it holds
    kv_bytes_per_block: int | None = None  # pipeline parallelism: its share of a block (its layers' pages)


@dataclass(frozen=True)
class StartupMemory(MemoryTotals):
    device: str
    dtype: str
    weights_language_model_bytes: int
    weights_vision_bytes: int
    weights_projector_bytes: int
    weights_allocated_bytes: int | None  # CUDA: memory_allocated growth while building and loading
    activation_peak_bytes: int | None  # CUDA: the profiling forward's peak; None when not measured
    device_memory_bytes: int | None  # CUDA: total device memory
    device_in_use_bytes: int | None  # CUDA: in use before the cache (this process and others)
    memory_utilization: float
    encoder_cache_bytes: int  # encoder_cache_memory; on CUDA set aside before the KV cache is sized
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    kv_bytes_per_token: int
    kv_bytes_per_block: int
    num_blocks: int
    cache_source: str
    max_model_len: int
    max_model_len_source: str
    max_position_embeddings: int
    image_tokens_per_image: int  # tokens of the largest image the image settings allow
    load_seconds: float
    tensor_parallel_size: int = 1  # the figures above are per rank (rank 0's) when > 1
    ranks: tuple[RankMemory, ...] = ()  # under tensor parallelism: every rank's own figures
    consumers: tuple = ()  # rank 0's memory consumers (`memory.breakdown.ConsumerBytes`), as `vlm-sdk plan` lists them
    weight_format: str = "float"  # the LLM's Linear weights: "float" or the checkpoint's quantized format
    held_vision: str = ""  # vision embeddings a prefilling request holds, in words (MemoryInputs.held_vision_text)
    # requests at once (memory.capacity.requests_at_once): ((tokens, images, tokens per image, count), ...): one
    # of max_model_len tokens, one with an image at the largest allowed size and the default max_tokens
    at_once: tuple = ()
    kv_cache_dtype: str = ""  # the KV cache's dtype ("bfloat16", "float8_e4m3fn", ...); "": the model's
    cache_groups: tuple = ()  # each cache group's share (`cache_groups`); (): one full-attention group
    group_size: int = 0  # layers per attention group: the KV tensors a block is a page of
    cache_capacity_tokens: int | None = None
    num_state_slots: int = 0  # a model with state layers: its state slots and one slot's bytes
    state_slot_bytes: int = 0
    prefix_reuse: tuple = ()  # (kind, whether and how it reuses cached prefixes) when several kinds
    kv_dtype_fits: tuple = ()  # the same settings under each kv_cache_dtype that runs (`memory.kv_dtypes`)
    weights_draft_bytes: int = 0  # speculative_config method "eagle3": the draft head's weights

    def to_dict(self) -> dict:
        out = asdict(self) | {"weights_bytes": self.weights_bytes, "capacity_tokens": self.capacity_tokens,
                              "kv_cache_bytes": self.kv_cache_bytes, "state_bytes": self.state_bytes}
        out["consumers"] = [c.to_dict() for c in self.consumers]
        return out

    def format(self) -> str:
        loaded = (f"; {format_bytes(self.weights_allocated_bytes)} allocated by loading"
                  if self.weights_allocated_bytes is not None else "")
        peak = (format_bytes(self.activation_peak_bytes) + " (profiled: a full max_num_batched_tokens step "
                "beside the vision embeddings a request holds, logits and sampler temporaries (top-k/top-p, "
                "penalties, logprobs) at max_num_seqs rows, the largest image through the vision tower, "
                "the decode CUDA graphs' pool, and the piecewise graphs' buffers and pool when on)"
                if self.activation_peak_bytes is not None else
                "not measured (the CPU cache is not carved out of device memory)")
        rows = [
            ("device / dtype", f"{self.device}, {self.dtype}"
             + (f"; {self.tensor_parallel_size} ranks (pipeline stages x tensor parallel): figures are rank 0's, "
                f"every rank's below" if any(r.layers for r in self.ranks) else
                f"; tensor parallel over {self.tensor_parallel_size} ranks: figures are per rank (rank 0's)"
                if self.tensor_parallel_size > 1 else "")),
            ("weights", f"{format_bytes(self.weights_bytes)}: language model "
             f"{format_bytes(self.weights_language_model_bytes)}, vision tower {format_bytes(self.weights_vision_bytes)}, "
             f"projector {format_bytes(self.weights_projector_bytes)}"
             f"{f', EAGLE-3 draft {format_bytes(self.weights_draft_bytes)}' if self.weights_draft_bytes else ''}"
             f"{loaded}; loaded in {self.load_seconds:.1f} s"),
            ("weight format", self.weight_format),
            ("activation peak", peak),
            *consumer_rows(self.consumers),
        ]
        if self.device_memory_bytes is not None:
            rows.append(("device memory", f"{format_bytes(self.device_memory_bytes)} x memory_utilization "
                         f"{self.memory_utilization}; {format_bytes(self.device_in_use_bytes)} in use before the cache"))
        rows.append(("encoder cache", encoder_cache_text(self.encoder_cache_bytes, self.cache_source)))
        rows += [
            ("KV per token", kv_token_text(self.kv_bytes_per_token, self.group_size if self.cache_groups else
                                           self.num_layers, self.num_kv_heads, self.head_dim,
                                           self.kv_cache_dtype or self.dtype)),
            ("KV blocks", f"{self.num_blocks:,} x {self.kv_bytes_per_block:,} B ({self.block_size} tokens) = "
             f"{format_bytes(self.kv_cache_bytes)}; {self.cache_source}"),
            *cache_group_rows(self.cache_groups, self.group_size, self.num_state_slots, self.state_slot_bytes,
                              self.max_model_len),
            ("KV capacity", f"{self.capacity_tokens:,} tokens" + (" in one sequence" if self.cache_groups else "")),
            *kv_dtype_rows(self.kv_dtype_fits, self.max_model_len),
            *[(f"  prefix caching, {k}", v) for k, v in self.prefix_reuse],
            ("max_model_len", f"{self.max_model_len:,} ({self.max_model_len_source}"
             + ("" if "max_position" in self.max_model_len_source
                else f"; max_position_embeddings {self.max_position_embeddings:,}") + ")"),
            ("largest image", f"{self.image_tokens_per_image:,} tokens"),
        ]
        if self.held_vision:
            rows.append(("vision held per request", self.held_vision))
        if self.at_once:
            rows.append(("requests at once", at_once_text(self.at_once, self.max_model_len)))
        for r in self.ranks:
            peak = "" if r.activation_peak_bytes is None else f", activation peak {format_bytes(r.activation_peak_bytes)}"
            stage = "" if r.layers is None else (f" (layers {r.layers[0]}..{r.layers[1] - 1}, "
                                                 f"{r.kv_bytes_per_block:,} B per block)")
            rows.append((f"rank {r.rank}{stage}", f"{r.device}: weights {format_bytes(r.weights_bytes)}{peak}; could hold "
                         f"{r.num_blocks_possible:,} blocks" + (" (the smallest: every rank holds this many)"
                                                               if r.num_blocks_possible == self.num_blocks else "")))
        return "KV cache and memory at start-up:\n" + table(rows)

