"""The scheduler's waiting queue: which waiting sequence is admitted next, fair between requests.

A request is a group of sequences (`Sequence.group`: the n samples of one AsyncLLM call, or every
sample of every prompt of one /v1/completions request; by default a sequence is a group of its own).
Admission order:

  1. preempted sequences first, the last preempted at the front (as the plain deque had them: the
     scheduler puts each back with `appendleft`), whatever their group;
  2. then one sequence per request in turn (round-robin across requests, in the order each request's
     first waiting sequence arrived; a request's own sequences in the order they came), so a request
     with 512 sequences queued delays another's first admission by one of its own, not 512;
  3. a request holding `max_running_per_group` running sequences (three quarters of max_num_seqs,
     see `Scheduler`: 48 of 64) is passed over until one of them ends: one request can never fill the
     batch, so another's sequence finds a free slot within a step (issue 41 row 6: 64 prompts x n=8
     put 512 sequences ahead of everyone and a first token waited 32 s; 13 s on the CI machine
     before, 0.16 s after). A quarter, not a half: a request alone keeps most of the batch's
     throughput (its 512 sequences took 12.9 s, against 15.1 s with FIFO and 25.4 s capped at half).

With one sequence per request this is FIFO. The n samples of a request still join the same step as
long as the step's budget allows (they are admitted in turn with other requests' sequences, not after
all of them), so the scheduler's prefix-cache lookup gives the 2nd..nth the first's prompt blocks.

The scheduler uses it as it used a deque: `append` (new), `appendleft` (preempted), `remove`,
`popleft` (admit what `peek` chose; `take(seq)` for what `peek(passed)` chose past the groups the
scheduler passes over this step), `len`, iteration (in admission order, ignoring the cap) and truth;
before admitting, it gives `count_running(running)` the running list, from which the caps are read.
"""
from __future__ import annotations

from collections import Counter, OrderedDict, deque
from typing import Hashable, Iterator

from vlm_sdk.engine.core.sequence import Sequence


class FairWaitingQueue:
    def __init__(self, max_running_per_group: int):
        self.max_running_per_group = max(1, max_running_per_group)
        self._preempted: deque[Sequence] = deque()
        self._groups: OrderedDict[Hashable, deque[Sequence]] = OrderedDict()  # group -> its waiting, in order
        self._len = 0
        self._running: Counter = Counter()  # group -> running sequences, as of count_running

    # -- the deque surface the scheduler uses -------------------------------------------------------
    def append(self, seq: Sequence) -> None:
        self._groups.setdefault(seq.group, deque()).append(seq)
        self._len += 1

    def appendleft(self, seq: Sequence) -> None:
        """A preempted sequence: first in line, before every other."""
        self._preempted.appendleft(seq)
        self._len += 1

    def remove(self, seq: Sequence) -> None:
        if seq in self._preempted:
            self._preempted.remove(seq)
        else:
            queue = self._groups[seq.group]
            queue.remove(seq)
            if not queue:
                del self._groups[seq.group]
        self._len -= 1

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Sequence]:
        """Every waiting sequence: the preempted, then round-robin across groups (caps ignored)."""
        yield from self._preempted
        queues = [list(q) for q in self._groups.values()]
        for i in range(max(map(len, queues), default=0)):
            yield from (q[i] for q in queues if i < len(q))

    # -- admission -----------------------------------------------------------------------------------
    def count_running(self, running: list[Sequence]) -> None:
        """Read how many running sequences each group holds (before a step's admissions)."""
        self._running = Counter(seq.group for seq in running)

    def peek(self, passed: frozenset | set = frozenset()) -> Sequence | None:
        """The sequence to admit next, or None when none waits or every waiting group is at its cap or
        in `passed` (groups the scheduler passes over this step: their images wait for the vision budget)."""
        for seq in self._preempted:
            if seq.group not in passed:
                return seq
        cap = self.max_running_per_group
        return next((q[0] for group, q in self._groups.items() if self._running[group] < cap and group not in passed),
                    None)

    def popleft(self) -> Sequence:
        """Admit what `peek` chose: it counts as running for its group, which goes to the back of the round."""
        seq = self.peek()
        if seq is None:
            raise IndexError("no waiting sequence may be admitted")
        return self.take(seq)

    def take(self, seq: Sequence) -> Sequence:
        """Admit `seq`, what `peek(passed)` chose (a preempted sequence, or the first waiting of its group):
        it counts as running for its group, which goes to the back of the round."""
        if any(s is seq for s in self._preempted):
            self._preempted.remove(seq)
        else:
            queue = self._groups[seq.group]
            queue.popleft()
            if queue:
                self._groups.move_to_end(seq.group)
            else:
                del self._groups[seq.group]
        self._len -= 1
        self._running[seq.group] += 1
        return seq
