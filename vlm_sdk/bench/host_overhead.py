"""`vlm-sdk bench --host-overhead`: the host time of one decode step, with the model replaced by a no-op.

A real engine on the tiny checkpoint (CPU; the model's size does not matter here) serves `batch` text requests of `--ho-prompt-len` tokens
(greedy, eos ignored) until all of them decode; then `--ho-steps` decode steps are timed, one
`LLMEngine.step()` each. The runner is given the CUDA path's host side: the Triton backend's
`prepare` (host ints only) and the decode graphs' buffers (`DecodeGraphs(capture=False)`: the same
copies into the static buffers as a replay), with a no-op standing in for each captured graph: on a
GPU a replay is one launch whose attention metadata was prepared at capture, so neither the
forward's Python nor the backend's per-size `prepare` runs on a graph step.

What a step includes: the scheduler (`schedule`, `worker_input`), the runner's `_update_states`,
the packing of the step's inputs (ids / positions / slots / block tables; `_prepare` on eager steps,
`_run_graph` on graph steps) and their host-to-device copy, the attention backend's `prepare` (eager
steps), the writes into the graph buffers (`graph_run`), the sampler's Python path on
logits of `LOGITS_WIDTH` columns (greedy argmax, its tokens read back), and the engine's
`_postprocess` (append, stop checks). What it does not include: the model (embedding, layers,
lm_head are no-ops returning preallocated tensors), the vocabulary-wide sampler math (device work
on a GPU), detokenization and the output processor (outside `LLMEngine.step`), and any real
device time or launch latency (there is no device here: "host-to-device" copies are CPU copies).

    vlm-sdk bench --host-overhead [--ho-batches 1,64,256] [--ho-steps 50] [--json]

The figure is the median wall time per decode step, and the mean of each part (ms); the targets are
issue 19's (< 0.25 ms at batch 64, < 1 ms at batch 256).
"""
from __future__ import annotations

import json
import logging
import statistics
import time

import torch

from vlm_sdk.testing.hooks import local_worker
from vlm_sdk.errors import InvalidRequestError

TARGETS_MS = {64: 0.25, 256: 1.0}  # issue 19: host time per decode step
LOGITS_WIDTH = 64  # the no-op lm_head's width: the sampler's Python path, not vocabulary-wide math
BLOCK_SIZE = 16



def reject_without_host_overhead(args) -> None:
    given = [f"--{n.replace('_', '-')}" for n in ("ho_batches", "ho_steps", "ho_prompt_len")
             if getattr(args, n, None) is not None]
    if given:
        raise InvalidRequestError(f"{', '.join(given)} only apply with --host-overhead")


class _Timers:
    """Seconds spent in named callables, wrapped on their instances for this run only."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.active = False

    def wrap(self, owner, attr: str, name: str) -> None:
        fn = getattr(owner, attr)
        self.seconds[name] = 0.0

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                if self.active:
                    self.seconds[name] += time.perf_counter() - t0
        setattr(owner, attr, timed)


def _no_op_model(model, batch: int, max_tokens: int) -> None:
    """Embedding, forward and lm_head return preallocated tensors of the right shapes."""
    states = torch.zeros(max_tokens, model.hidden_size)  # [max_tokens, hidden]
    logits = torch.zeros(max(batch, 1), LOGITS_WIDTH)  # [batch, LOGITS_WIDTH]
    model.embed_tokens = lambda ids: states[:ids.shape[0]]  # [num_tokens, hidden]
    model.forward = lambda embeds, *a, **k: embeds  # [num_tokens, hidden]
    model.compute_logits = lambda h: logits[:h.shape[0]]  # [num_sampled, LOGITS_WIDTH]


def _engine(model_dir: str, batch: int, prompt_len: int, steps: int, async_scheduling: bool):
    from vlm_sdk.config import EngineArgs
    from vlm_sdk.engine.llm_engine import LLMEngine
    budget = max(8192, prompt_len)
    # the first requests decode while the last ones still prefill: room for those tokens too
    max_len = prompt_len + steps + 16 + -(-batch * prompt_len // budget)
    blocks = batch * (-(-max_len // BLOCK_SIZE)) + 8
    args = EngineArgs(device="cpu", max_num_seqs=batch, num_blocks=blocks, block_size=BLOCK_SIZE,
                      max_model_len=max_len, max_num_batched_tokens=budget, show_progress=False,
                      allow_unfit_images=True, async_scheduling=async_scheduling)  # text requests only
    quiet = logging.getLogger("vlm_sdk")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the start-up report and the unfit-image warning are not the bench's
    try:
        return LLMEngine(model_dir, args)
    finally:
        quiet.setLevel(level)


def _cuda_host_path(engine, batch: int) -> None:
    """The CUDA path's host side on the CPU: Triton's `prepare` and the decode graphs' buffers."""
    from vlm_sdk.attention.triton_backend import TritonBackend
    from vlm_sdk.worker.cuda_graphs import DecodeGraphs
    runner = local_worker(engine).runner
    backend = TritonBackend()  # its prepare reads host ints only: no kernel runs here
    runner.attention = backend
    graphs = DecodeGraphs(runner.model, runner.caches, runner.layout, max_num_seqs=batch,
                          max_model_len=engine.scheduler_config.max_model_len, block_size=BLOCK_SIZE,
                          device=torch.device("cpu"), attention=backend, capture=False)
    for size in graphs.sizes:  # "captured": a replay that does nothing, its output preallocated
        graphs.graphs[size] = _NoOpGraph()
        graphs.outputs[size] = torch.zeros(size, runner.model.hidden_size)  # [size, hidden]
    runner.graphs = graphs


class _NoOpGraph:
    """Stands in for a captured CUDA graph: the model is a no-op here, so its replay is too."""

    def replay(self) -> None:
        pass


def measure(model_dir: str, batch: int, steps: int, prompt_len: int, async_scheduling: bool = False) -> dict:
    """Median / mean ms per decode step at `batch` and the mean ms of each part. `async_scheduling`:
    the engine as it runs on CUDA (ids of the last step taken from the device, its output read one
    step later); here nothing runs in between, so the figure is the host work itself."""
    from vlm_sdk import SamplingParams
    from vlm_sdk.multimodal.inputs import PromptInputs
    engine = _engine(model_dir, batch, prompt_len, steps + 8, async_scheduling)
    try:
        _no_op_model(local_worker(engine).model, batch, engine.scheduler_config.max_num_batched_tokens)
        _cuda_host_path(engine, batch)
        runner, sched = local_worker(engine).runner, engine.scheduler
        timers = _Timers()
        timers.wrap(sched, "schedule", "schedule")
        timers.wrap(sched, "worker_input", "worker_input")
        timers.wrap(runner, "_update_states", "runner_update_states")
        timers.wrap(runner, "_prepare", "runner_prepare")  # eager steps' packing (prefill, mixed)
        if hasattr(runner, "_run_graph"):  # decode steps packed straight into the graphs' inputs
            timers.wrap(runner, "_run_graph", "runner_graph_step")  # graph_run included
        timers.wrap(runner.graphs, "run", "graph_run")
        timers.wrap(runner.sampler, "sample_on_device", "sampler")
        timers.wrap(engine, "_postprocess", "engine_postprocess")
        params = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)  # up to max_model_len
        for i in range(batch):
            ids = [(7 * i + 13 * j) % 900 + 10 for j in range(prompt_len)]  # ordinary text token ids
            engine.add_request(PromptInputs(token_ids=ids), params)
        while any(s.num_tokens - s.num_computed_tokens > 1 for s in sched.running) or sched.waiting:
            engine.step()  # prefill (no-op forward): every request then decodes one token a step
        for _ in range(5):
            engine.step()  # warm-up
        timers.active = True
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            outs = engine.step()
            times.append(time.perf_counter() - t0)
            if len(outs) != batch:
                raise AssertionError(f"a decode step of batch {batch} returned {len(outs)} tokens")
        return {"batch": batch, "async_scheduling": async_scheduling, "steps": steps, "prompt_len": prompt_len,
                "median_ms_per_step": 1e3 * statistics.median(times), "mean_ms_per_step": 1e3 * statistics.mean(times),
                "parts_mean_ms": {k: 1e3 * v / steps for k, v in timers.seconds.items()}}
    finally:
        engine.shutdown()


def run_host_overhead(args) -> int:
    from vlm_sdk.demo_checkpoint import tiny_model_dir
    # the model is a no-op: the tiny checkpoint keeps the (untouched) KV cache small at batch 256
    model_dir = args.model or str(tiny_model_dir("tiny", args.family))
    try:
        batches = [int(b) for b in (args.ho_batches or "1,64,256").split(",")]
    except ValueError:
        raise InvalidRequestError(f"--ho-batches takes comma-separated ints, got {args.ho_batches!r}") from None
    steps, prompt_len = args.ho_steps or 50, args.ho_prompt_len or 512
    if min(batches) < 1 or steps < 1 or prompt_len < 1:
        raise InvalidRequestError("--ho-batches, --ho-steps and --ho-prompt-len must be positive")
    # one intra-op thread: the few small torch ops here (device work on a GPU) otherwise wait on a
    # second thread of a busy shared CPU, milliseconds of noise that is not host overhead
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = [measure(model_dir, b, steps, prompt_len, mode) for b in batches for mode in (False, True)]
    finally:
        torch.set_num_threads(threads)
    for r in results:
        target = TARGETS_MS.get(r["batch"])
        r["target_ms"] = target
        r["meets_target"] = None if target is None else r["median_ms_per_step"] < target
    report = {"model": model_dir, "device": "cpu", "torch_threads": 1,
              "logits_width": LOGITS_WIDTH, "results": results}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"host time per decode step, model a no-op ({model_dir}, cpu, 1 torch thread, "
          f"prompts of {prompt_len} tokens, {steps} timed steps)")
    for r in results:
        parts = ", ".join(f"{k} {v:.3f}" for k, v in r["parts_mean_ms"].items())
        target = "" if r["target_ms"] is None else \
            f"  target < {r['target_ms']} ms: {'met' if r['meets_target'] else 'not met'}"
        mode = "async" if r["async_scheduling"] else "sync "
        print(f"  batch {r['batch']:4d} {mode}: median {r['median_ms_per_step']:.3f} ms/step{target}")
        print(f"              mean parts (ms): {parts}")
    return 0
