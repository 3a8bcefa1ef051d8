"""A vision-language model whose LLM is a `LlamaDecoder`: `DecoderVLM` (the decoder side of the model
contract) and its loading: the tied LM head and the CPU layout.

Shared by every family, because these questions are the decoder's, not the vision tower's:
- a config that ties lm_head to the token embedding may still ship `lm_head.weight`. A copy of the
  embedding is dropped; a different matrix is used as the head, as transformers does (it then leaves
  the two untied). Under tensor parallelism each rank compares only its vocab rows, and the ranks
  all-reduce the verdict so that all untie or none (a head differing only in rank 1's rows must untie
  rank 0 too, or the ranks would compute logits from different matrices);
- on the CPU, Linear weights are re-laid column-major and the LM head pre-packed once loaded
  (`models/cpu_layout.py`).
"""
from __future__ import annotations

import logging
import re
from abc import abstractmethod
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch import nn

from vlm_sdk.attention.metadata import StepMetadata
from vlm_sdk.errors import CheckpointError
from vlm_sdk.layers.linear import kv_head_split
from vlm_sdk.layers.ops import KernelOps
from vlm_sdk.layers.parallel_state import ParallelGroups, TPGroup
from vlm_sdk.weight_loading import ParamSlot, load_checked
from vlm_sdk.models.base import DecoderStack, LayerCache, StepImages, VisionLanguageModel
from vlm_sdk.models.cpu_layout import OneDnnLMHead, PackedLMHead, column_major, use_cpu_weight_layout
from vlm_sdk.models.common.decoder_ends import DecoderEnds
from vlm_sdk.models.common.llama_config import LlamaDecoderConfig
from vlm_sdk.models.common.llama_decoder import LlamaDecoder
from vlm_sdk.models.pipeline import IntermediateTensors, StageWeights

logger = logging.getLogger(__name__)


class DecoderVLM(VisionLanguageModel):
    """The decoder half of `VisionLanguageModel` for families whose LLM is a `LlamaDecoder`: a
    subclass calls `_init_decoder` and names its vision tower and projector in `_vision_parts`.

    `parallel` is this rank's `ParallelGroups` (kept, and its tensor-parallel group as `tp`). Under tensor
    parallelism `num_kv_heads` is this rank's KV head count (what its KV cache holds); `compute_logits`
    returns the whole vocab on every rank. A family builds its vision tower and projector with
    `_build_vision`: sharded over `tp` when `shard_vision`, else (or when the tower's heads or widths do
    not split over the ranks, e.g. InternViT-6B's 25 heads) whole on every rank; `vision_tp` is the group
    it got."""

    def _init_decoder(self, cfg: LlamaDecoderConfig, dtype: torch.dtype, device: torch.device | str,
                      ops: KernelOps | None, parallel: ParallelGroups = ParallelGroups(),
                      shard_vision: bool = True, decoder_cls: type = LlamaDecoder) -> None:
        """`decoder_cls(cfg, dtype, device, ops, parallel)`: the decoder (a `LlamaDecoder`, another
        `DecoderEnds`, or a decoder with the same interface: `embed`, `compute_logits`, `embed_tokens`,
        `lm_head`, `untie_lm_head`, the Gemma decoder) whose config has the size fields num_layers,
        head_dim, num_kv_heads of its attention layers, hidden_size, vocab_size."""
        tp = parallel.tp
        if parallel.pp.size > 1 and not getattr(decoder_cls, "pipeline_stages", False):
            raise ValueError(f"pipeline parallelism is not built for the {decoder_cls.__name__} decoder "
                             f"(pipeline_parallel_size={parallel.pp.size}): serve it with pipeline_parallel_size=1")
        self.decoder_config = cfg
        self.parallel, self.tp, self.shard_vision = parallel, tp, shard_vision
        self.vision_tp = tp if shard_vision else TPGroup()  # `_build_vision` may fall back to TPGroup()
        self.decoder = decoder_cls(cfg, dtype, device, ops, parallel)
        self.num_layers, self.head_dim = cfg.num_layers, cfg.head_dim
        self.num_kv_heads = kv_head_split(cfg.num_kv_heads, tp)[1]  # this rank's: what its KV cache holds
        self.hidden_size, self.vocab_size = cfg.hidden_size, cfg.vocab_size
        self.dtype = dtype

    def _build_vision(self, build: Callable[[TPGroup, torch.device | str], nn.Module],
                      device: torch.device | str) -> nn.Module:
        """`build(group, device)`: the vision tower with its projector. Sharded over `tp` when asked and
        its sizes split over the ranks (tried first on the meta device, which allocates nothing), else
        whole on every rank, logged: a tower that cannot be split still runs, replicated. A pipeline stage
        after the first builds it on the meta device (no memory, its tensors skipped on load): the first
        stage runs it."""
        if not self.parallel.pp.is_first:
            return build(self.vision_tp, "meta")
        if self.vision_tp.size > 1:
            try:
                build(self.vision_tp, "meta")
            except ValueError as e:  # tp.split: heads or a width not divisible by the ranks
                logger.warning("the vision tower is replicated on every tensor-parallel rank, not sharded: %s", e)
                self.vision_tp = TPGroup()
        return build(self.vision_tp, device)

    @abstractmethod
    def _vision_parts(self) -> tuple[nn.Module, nn.Module]:
        """(vision tower, its projector to the LM width)."""

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.embed(input_ids)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, caches: list[LayerCache],
                meta: StepMetadata, images: StepImages | None = None,
                intermediate: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        # [position_rows, N]: the decoder takes 1-D RoPE positions as [N], M-RoPE ones as [3, N]
        if intermediate is not None:  # a later pipeline stage: the image rows are in the hidden states already
            images = None
        return self.decoder(*self.stack_inputs(inputs_embeds, positions, images), caches, meta,
                            intermediate=intermediate)

    @property
    def stage_layers(self) -> tuple[int, int]:
        """The decoder layers this pipeline stage runs, [start, stop) (all of them with one stage)."""
        return self.decoder.start_layer, self.decoder.end_layer

    def decoder_stack(self) -> DecoderStack:
        return self.decoder

    def stack_inputs(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                     images: StepImages | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        if images is not None:
            inputs_embeds[images.rows] = images.embeds.to(inputs_embeds.dtype)  # [n, hidden] rows
        return inputs_embeds, positions[0] if self.position_rows == 1 else positions

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.decoder.compute_logits(hidden, out)

    def set_aux_hidden_layers(self, layers: tuple[int, ...]) -> None:
        if not hasattr(self.decoder, "aux_layers"):  # a decoder other than the Llama-style one
            super().set_aux_hidden_layers(layers)
        self.decoder.aux_layers = tuple(layers)

    def aux_hidden_states(self) -> torch.Tensor | None:
        return self.decoder.aux_hidden if getattr(self.decoder, "aux_layers", ()) else None

    def parameter_groups(self) -> dict[str, list[nn.Parameter]]:
        if not self.parallel.pp.is_first:  # the tower is the first stage's (meta here, no memory)
            return {"language_model": list(self.decoder.parameters()), "projector": [], "vision": []}
        tower, proj = self._vision_parts()
        projector = list(proj.parameters())
        ids = {id(t) for t in projector}
        return {"language_model": list(self.decoder.parameters()), "projector": projector,
                "vision": [t for t in tower.parameters() if id(t) not in ids]}


def load_with_lm_head(model: nn.Module, decoder: DecoderEnds, weights: Iterable[tuple[str, torch.Tensor]],
                      slots: dict[str, ParamSlot], *, lm_head: str, canonical: Callable[[str], str],
                      source: str | Path | None) -> None:
    """`load_checked` into `model`; when `decoder` is tied, a checkpoint tensor named `lm_head` (after
    `canonical`) is checked against the embedding instead of loaded, and unties the decoder if it differs
    (on every rank when it differs on any: the verdict is all-reduced over `decoder.tp`).

    `weights` may hold lazy tensors (`model_loader.iter_safetensors(lazy=True)`): only this rank's rows
    of the head are read. Quantized Linears check what their format constrains once loaded (g_idx).
    A pipeline stage loads only its own tensors (models/pipeline.py: the others' skipped and logged)."""
    pp = getattr(decoder, "pp", None)
    if pp is not None and pp.size > 1:
        slots, weights, stage = _stage_view(model, decoder, slots, weights, lm_head, canonical)
    else:
        stage = None
    if stage is not None and decoder.embed_tokens is None:  # neither embedding nor head here
        load_checked(model, weights, slots, canonical=canonical, source=source)
        _check_quantized(decoder)
        stage.log(pp.rank, pp.size)
        return
    if decoder.lm_head is not None:
        load_checked(model, weights, slots, canonical=canonical, source=source)
        _check_quantized(decoder)
        return
    emb_layer = decoder.embed_tokens
    start, stop = emb_layer.vocab_start, emb_layer.vocab_stop
    expected = (emb_layer.vocab_size, emb_layer.hidden_size)  # the whole tensor; this rank holds its rows
    head: list[torch.Tensor] = []  # this rank's rows of the checkpoint's head

    def without_head():
        for name, tensor in weights:
            if canonical(name) != lm_head:
                yield name, tensor
                continue
            if tuple(tensor.shape) != expected:
                where = f" in {source}" if source is not None else ""
                raise CheckpointError(f"tensor {lm_head}{where} has shape {list(tensor.shape)} but "
                                      f"{type(model).__name__} expects {list(expected)} (tied to the token "
                                      f"embedding): config.json does not match the weights")
            # read now, while a lazy tensor's file is open; checkpoint tensors are on the CPU
            head.append(tensor.narrow(0, start, stop - start))

    load_checked(model, without_head(), slots, canonical=canonical, source=source)
    _check_quantized(decoder)
    if stage is not None:
        stage.log(pp.rank, pp.size)
    if not head:  # the same on every rank: all read the same files
        return
    emb = emb_layer.weight
    differs = torch.tensor([0.0 if torch.equal(head[0].to(emb.device, emb.dtype), emb) else 1.0],
                           device=emb.device)
    if decoder.tp.all_reduce(differs).item() > 0:  # any rank's rows differ: every rank unties
        logger.warning("config.json ties lm_head to the token embedding but the checkpoint's %s differs from it; "
                       "using the checkpoint's %s (as transformers does)", lm_head, lm_head)
        decoder.untie_lm_head(head[0])


def _stage_view(model: nn.Module, decoder: DecoderEnds, slots: dict[str, ParamSlot],
                weights: Iterable[tuple[str, torch.Tensor]], lm_head: str, canonical: Callable[[str], str]):
    """A pipeline stage's slots and weights: the slots of parts built on the meta device (the vision tower
    on a later stage) dropped, and the checkpoint tensors of other stages skipped (`StageWeights`); the
    layer prefix is read from this stage's own layer slots (every stage holds at least one layer)."""
    on_meta = {n for n, p in model.state_dict(keep_vars=True).items() if p.device.type == "meta"}

    def targets(slot):
        return [p.param for p in slot.parts] if hasattr(slot, "parts") else [slot.param]
    meta_names = frozenset(n for n, s in slots.items() if any(t in on_meta for t in targets(s)))
    prefixes = sorted({m.group(1) for n, s in slots.items() if any(t.startswith("decoder.layers.") for t in targets(s))
                       and (m := re.match(r"(.*layers\.)\d+\.", n))})
    others = set(meta_names)
    for p in prefixes:
        if decoder.embed_tokens is None:
            others.add(f"{p.removesuffix('layers.')}embed_tokens.weight")
    if not decoder.pp.is_last:
        others.add(lm_head)
    stage = StageWeights(tuple(prefixes), (decoder.start_layer, decoder.end_layer), other_names=frozenset(others))
    kept = {n: s for n, s in slots.items() if n not in meta_names}
    return kept, stage.filter(weights, canonical), stage


def _check_quantized(decoder: DecoderEnds) -> None:
    for module in decoder.modules():
        check = getattr(module, "check_loaded", None)
        if check is not None:
            check()


def finish_cpu_layout(model: nn.Module, decoder: DecoderEnds) -> None:
    """After loading: CPU weight layout for every Linear, and the packed LM head when it applies."""
    use_cpu_weight_layout(model)
    pp = getattr(decoder, "pp", None)
    if pp is not None and not pp.is_last:  # the LM head is the last stage's
        return
    head = decoder.embed_tokens.weight if decoder.lm_head is None else decoder.lm_head.weight
    if OneDnnLMHead.applies(head):  # row-major, as use_cpu_weight_layout left it
        decoder.packed_head = OneDnnLMHead(head)
        return
    decoder.packed_head = PackedLMHead.create(head)
    if decoder.packed_head is None and decoder.lm_head is None and head.device.type == "cpu":
        # the tied matrix serves the LM head every step and the embedding lookup rarely: favour the head
        decoder.embed_tokens.weight = column_major(head)
