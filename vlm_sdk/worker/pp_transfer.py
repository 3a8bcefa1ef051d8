"""Hidden states between pipeline stages: point-to-point send / recv, in a fixed order with the compute.

Each step, stage s > 0 receives the previous stage's `IntermediateTensors` (hidden, then residual, both
`[num_tokens, hidden]`) before its first layer, and stage s < last sends its own after its last layer;
tensor-parallel rank t of a stage talks only to rank t of the next (`PPGroup.prev` / `next`). Every stage
runs the same `SchedulerOutput`, so the receiver knows the token count and allocates the buffers itself:
no shape message, nothing else on the wire. The operations are blocking (`dist.send` / `dist.recv` on
the world group), issued on the thread that runs the model:

    stage 0   compute step k ─ send(k) ─ compute step k+1 ─ send(k+1) ...
    stage 1            recv(k) ─ compute step k ─ recv(k+1) ─ compute step k+1 ...

CUDA (NCCL): no side stream of ours. The field report this project was founded on
(shared/seeds/vllm_pipeline_parallel_illegal_memory.md) sent metadata under `torch.cuda.stream(side)`
with no `wait_stream`: the side stream read tensors the compute stream had not finished writing (or that
the allocator had already reused), and died with an illegal memory access unless CUDA_LAUNCH_BLOCKING
serialised everything. Here the send is issued on the current (compute) stream's thread after the
producing kernels were queued; ProcessGroupNCCL makes its communication stream wait on the current
stream before the send and records the tensor on its stream (so the allocator does not reuse it early),
and a blocking recv makes the current stream wait on the communication before any consumer kernel is
queued. That is the `wait_stream` / `record_stream` pairing done by the process group, in program order;
we add no stream. On gloo (the CPU) send and recv complete before they return.

`StageLink.log` records every transfer (step number, "send"/"recv", peer rank, token count), bounded:
the CPU tests match it against the engine's schedule (tests/executor/test_pipeline_parallel.py).
`StageLink.busy` records when this rank computed each step (monotonic seconds, the machine's clock: comparable
across the ranks of one machine), from after its receive to before its send, bounded: whether stages run
concurrently with pipeline micro-batches shows in how those intervals overlap.
"""
from __future__ import annotations

from collections import deque

import time

import torch
import torch.distributed as dist

from vlm_sdk.layers.parallel_state import PPGroup
from vlm_sdk.models.pipeline import IntermediateTensors

LOG_STEPS = 4096  # transfers kept in `StageLink.log`


class StageLink:
    """This rank's links to the stage before and after it (module docstring)."""

    def __init__(self, pp: PPGroup, hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.pp, self.hidden_size, self.dtype, self.device = pp, hidden_size, dtype, device
        self.log: deque[tuple[int, str, int, int]] = deque(maxlen=LOG_STEPS)
        self.step = 0  # steps with tokens run on this rank
        self.busy: deque[tuple[float, float]] = deque(maxlen=LOG_STEPS)  # (start, end) of each step's compute
        self._started = 0.0

    def computing(self) -> None:
        """This step's compute starts (after the receive, if any)."""
        self._started = time.monotonic()

    def computed(self) -> None:
        """This step's compute is done (before the send, if any)."""
        self.busy.append((self._started, time.monotonic()))

    @property
    def is_first(self) -> bool:
        return self.pp.is_first

    @property
    def is_last(self) -> bool:
        return self.pp.is_last

    def recv(self, num_tokens: int) -> IntermediateTensors:
        """The previous stage's tensors of this step (blocking)."""
        out = []
        for _ in range(2):  # hidden, then residual: the order `send` writes them in
            t = torch.empty(num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)  # [N, hidden]
            dist.recv(t, src=self.pp.prev, group=self.pp.group)
            out.append(t)
        self.log.append((self.step, "recv", self.pp.prev, num_tokens))
        return IntermediateTensors(*out)

    def send(self, tensors: IntermediateTensors) -> None:
        """This stage's tensors of this step to the next stage (blocking)."""
        for t in (tensors.hidden, tensors.residual):  # [N, hidden] each
            dist.send(t.contiguous(), dst=self.pp.next, group=self.pp.group)
        self.log.append((self.step, "send", self.pp.next, tensors.hidden.shape[0]))

    def step_done(self) -> None:
        self.step += 1
