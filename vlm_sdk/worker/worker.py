"""One rank's share of the engine: its slice of the model, its KV cache and its model runner.

With one rank the engine holds a single `Worker` in its own process. Under tensor parallelism there is
one per rank, each in its own process (vlm_sdk/executor/), and rank 0's executor calls the same method
on every rank in the same order, so the collectives inside (the layers' all-reduces, the logits'
all-gather) line up:

    Worker(...)             build this rank's slice of the model and load it from the checkpoint
    load_report()           what this rank holds (weights by part, KV heads) -> RankLoad
    profile_memory(...)     CUDA: the step-time memory consumers of the worst-case step on this rank
    memory_snapshot()       CUDA: the device's total and in-use bytes (the engine sizes every rank's cache
                            from these with vlm_sdk/memory/ and takes the smallest)
    init_cache(cache, ...)  allocate exactly that cache (every cache group's: worker/kv_cache.py), capture
                            CUDA graphs, build the model runner,
                            compile every Triton kernel variant (CUDA: kernel_warmup.py)
    execute(sched)          one step; only rank 0 samples (the others return an empty output)
    held_state()            requests and image embeddings requests still hold here (tests, leak checks)
"""
from __future__ import annotations

import dataclasses
import time
import torch

from vlm_sdk.config import RankConfig
from vlm_sdk.layers.ops import make_ops
from vlm_sdk.memory.inputs import profile_num_tokens
from vlm_sdk.memory.kv import CacheConfig
from vlm_sdk.memory.weights import weight_bytes
from vlm_sdk.layers.parallel_state import ParallelGroups
from vlm_sdk.model_loader import iter_safetensors, read_checkpoint
from vlm_sdk.models.common.eagle3_draft import load_eagle3_draft
from vlm_sdk.models.registry import resolve
from vlm_sdk.multimodal.inputs import ImageInput
from vlm_sdk.protocol.cache_layout import CacheLayout
from vlm_sdk.protocol.rank import RankLoad
from vlm_sdk.protocol.runner_output import EncoderCacheStats, ModelRunnerOutput, PendingOutput
from vlm_sdk.protocol.scheduler_output import SchedulerOutput
from vlm_sdk.worker.cuda_graphs import DecodeGraphs
from vlm_sdk.worker.eagle_drafter import EagleDrafter
from vlm_sdk.worker.piecewise_graphs import PiecewiseGraphs, piecewise_stack
from vlm_sdk.worker.kernel_warmup import warm_up_kernels
from vlm_sdk.worker.kv_cache import allocate_or_explain
from vlm_sdk.worker.pp_transfer import StageLink
from vlm_sdk.protocol.stage_layout import stage_block_bytes, stage_state_slot_bytes
from vlm_sdk.worker.model_runner import ModelRunner
from vlm_sdk.worker.profiler import profile_peak


class Worker:
    def __init__(self, model_dir: str, config: RankConfig, device: torch.device,
                 parallel: ParallelGroups = ParallelGroups()):
        """Build this rank's slice of the model on `device` and load its weights. `config`: the engine's
        settings, resolved once on the engine side (no default is worked out here); `parallel`: this
        rank's groups (the executor joined them), handed to the model as they are."""
        args = config.args
        tp = parallel.tp
        self.config, self.args, self.device, self.parallel, self.tp = config, args, device, parallel, tp
        self.dtype, self.kv_dtype = config.torch_dtype, config.torch_kv_dtype
        info = read_checkpoint(model_dir)
        family = resolve([info.architecture], args.model_family)
        self.ops = make_ops(config.attention_backend, device, args.small_m_gemm)
        t0 = time.perf_counter()
        before = _allocated(device)
        with torch.device(device):
            self.model = family.model_cls(info.hf_config, dtype=self.dtype, device=device, ops=self.ops,
                                          parallel=parallel, shard_vision=args.shard_vision)
        # only rank 0 shows a progress bar: the others load the same files at the same pace
        self.model.load_weights(iter_safetensors(model_dir, show_progress=args.show_progress and parallel.rank == 0,
                                                 lazy=parallel.world_size > 1),  # a rank reads only its slices
                                source=info.model_dir)
        self.model.eval()
        self.load_seconds = time.perf_counter() - t0
        self.weights_allocated = None if before is None else _allocated(device) - before
        m = self.model
        # what every layer keeps, grouped as the engine groups it (it refused a model whose groups cannot share)
        self.layout = CacheLayout.from_specs(m.cache_specs(self.kv_dtype))
        # pipeline parallelism: this stage's layers (the model built only those); the engine's layout is
        # the whole model's, and this rank allocates what its layers view (protocol/stage_layout.py)
        self.stage_layers = getattr(m, "stage_layers", (0, m.num_layers)) if parallel.pp.size > 1 else None
        self.bytes_per_block = self.layout.block_bytes(args.block_size) if self.stage_layers is None else \
            stage_block_bytes(self.layout, self.stage_layers, args.block_size)
        self.state_slot_bytes = self.layout.state_slot_bytes if self.stage_layers is None else \
            stage_state_slot_bytes(self.layout, self.stage_layers)
        self.piecewise_stack = piecewise_stack(self.model, config.piecewise_graphs, tp.size, self.layout)
        self.draft = None  # EAGLE-3's head (speculative_config method "eagle3"): its page rides in every block
        spec = args.speculative_config
        if spec is not None and spec.method == "eagle3":
            self.draft = load_eagle3_draft(spec.model, m, self.ops, self.dtype, device)
            self.bytes_per_block += self.draft.cfg.page_bytes(args.block_size, self.dtype.itemsize)
        self.caches: list[tuple[torch.Tensor, ...]] = []
        self.runner: ModelRunner | None = None

    def load_report(self) -> RankLoad:
        m = self.model
        layers = m.num_layers if self.stage_layers is None else self.stage_layers[1] - self.stage_layers[0]
        weights = weight_bytes(m)
        if self.draft is not None:
            weights = dataclasses.replace(weights, draft=sum(
                t.numel() * t.element_size() for t in self.draft.state_dict().values()))
        return RankLoad(self.parallel.rank, str(self.device), self.config.dtype, weights,
                        self.weights_allocated, self.load_seconds, layers, m.num_kv_heads, m.head_dim,
                        self.bytes_per_block, str(self.kv_dtype).removeprefix("torch."), self.state_slot_bytes,
                        self.stage_layers)

    def profile_memory(self, largest_image: ImageInput, max_position_embeddings: int,
                       held_tokens: int = 0) -> dict[str, int] | None:
        """CUDA: the step-time memory consumers measured on this rank (name -> bytes, named as in
        vlm_sdk/memory/consumers/): a full `max_num_batched_tokens` step beside the largest image's held
        embeddings (or `held_tokens` rows of a video's, when more), logits and the sampler at max_num_seqs
        rows, the tower, the graph pools. None on the CPU (nothing is carved out of device memory there),
        and for a pipeline stage (the profile runs a whole model's forward; a stage's consumers are then
        estimated, as `vlm-sdk plan` does)."""
        if self.device.type != "cuda" or self.stage_layers is not None:
            return None
        args = self.args
        peak = profile_peak(
            self.model, largest_image,
            num_tokens=profile_num_tokens(args.max_num_batched_tokens, max_position_embeddings),
            num_seqs=args.max_num_seqs, block_size=args.block_size, layout=self.layout,
            dtype=self.dtype, device=self.device, attention=self.ops.attention,
            graph_batch=args.max_num_seqs if self.config.decode_graphs else None,
            piecewise_tokens=args.max_num_batched_tokens if self.piecewise_stack is not None else None,
            held_tokens=held_tokens)
        return peak.parts()

    def memory_snapshot(self) -> tuple[int, int] | None:
        """CUDA: (total device bytes, bytes in use now: this rank's weights, the CUDA context, other
        processes); None on the CPU."""
        if self.device.type != "cuda":
            return None
        free, total = torch.cuda.mem_get_info(self.device)
        return total, total - free

    def init_cache(self, cache: CacheConfig, max_model_len: int, max_vision_patches: int) -> None:
        """Allocate `cache` (the block count every rank agreed on), capture the decode graphs (CUDA)
        and build the model runner. `max_vision_patches`: the profiled image's size, the largest
        vision-tower call a step makes."""
        m, args, pp = self.model, self.args, self.parallel.pp
        self.caches = allocate_or_explain(self.layout, cache, self.device, self.stage_layers)
        graphs = piecewise = None
        if self.config.decode_graphs:
            graphs = DecodeGraphs(m, self.caches, self.layout, max_num_seqs=args.max_num_seqs,
                                  max_model_len=max_model_len, block_size=args.block_size, device=self.device,
                                  attention=self.ops.attention)
            if self.piecewise_stack is not None:  # after the decode graphs' capture
                piecewise = PiecewiseGraphs(self.piecewise_stack, self.caches, device=self.device,
                                            dtype=self.dtype, max_num_batched_tokens=args.max_num_batched_tokens)
        drafter = None
        if self.draft is not None:
            drafter = EagleDrafter(self.draft, args.speculative_config.num_speculative_tokens, args.block_size,
                                   self.device)
            drafter.allocate(cache.num_blocks, self.dtype)
        self.runner = ModelRunner(m, self.caches, self.layout, args.block_size, self.device, self.dtype, args.seed,
                                  max_vision_patches=max_vision_patches, graphs=graphs,
                                  attention=self.ops.attention, samples=self.tp.rank == 0 and pp.is_last,
                                  encoder_cache_bytes=args.encoder_cache_memory if pp.is_first else 0,
                                  keep_sampled=self.config.async_scheduling, piecewise=piecewise,
                                  stage=None if pp.size == 1 else StageLink(pp, m.hidden_size, self.dtype, self.device),
                                  drafter=drafter)
        self.runner.reports_encoder = self.tp.rank == 0 and pp.is_first
        if self.stage_layers is None:  # its synthetic steps run a whole model (a stage compiles on its first steps)
            warm_up_kernels(self.runner, max_model_len=max_model_len,
                            max_num_batched_tokens=args.max_num_batched_tokens)

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(sched)

    def execute_async(self, sched: SchedulerOutput) -> PendingOutput:
        return self.runner.execute_async(sched)

    def encoder_cache_stats(self) -> EncoderCacheStats:
        return self.runner.encoder_cache.stats()

    def held_state(self) -> tuple[int, int]:
        """(requests this rank keeps state for, image embeddings requests hold): both 0 once every
        request has finished or been aborted, on every rank (the encoder cache's reusable entries are
        not held by any request)."""
        return len(self.runner.requests), sum(len(s.image_embeds) for s in self.runner.requests.values())


def _allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None
