"""Stop strings found as text streams in, at a cost per character that does not depend on how many
stop strings a request has.

A request's stop strings become one Aho-Corasick automaton: each new character moves one state
(amortised over the failure links), so a token costs the same with 1 stop string or 100,000 (a
`str.find` per stop string per token made a request with many of them slow every stream sharing the
event loop). The state also says how much of the text may still become a stop string: its depth,
the longest suffix of the text that begins some stop string. Only that much is held back from the
stream; the rest can never be part of a match.

A stop string is matched where it ends first; when several end at the same character the longest
(the one starting earliest) wins, so the cut does not depend on how the text was split into tokens.
"""
from __future__ import annotations

from collections import deque


class StopMatcher:
    """`feed(text)` each new piece of a request's text in order; it returns the index in the whole
    text where the first stop string starts, or None. `hold` is how many trailing characters of the
    text so far may still begin a stop string."""

    def __init__(self, stops: tuple[str, ...]):
        # node 0 is the root; goto[n] maps a character to the next node
        self._goto: list[dict[str, int]] = [{}]
        depth = [0]
        ends = [0]  # length of the stop string ending at this node, 0 if none
        for stop in stops:
            node = 0
            for ch in stop:
                nxt = self._goto[node].get(ch)
                if nxt is None:
                    nxt = len(self._goto)
                    self._goto[node][ch] = nxt
                    self._goto.append({})
                    depth.append(depth[node] + 1)
                    ends.append(0)
                node = nxt
            ends[node] = len(stop)
        fail = [0] * len(self._goto)
        # breadth first, so a node's failure target is finished before the node
        queue = deque(self._goto[0].values())
        while queue:
            node = queue.popleft()
            for ch, child in self._goto[node].items():
                f = fail[node]
                while f and ch not in self._goto[f]:
                    f = fail[f]
                fail[child] = self._goto[f].get(ch, 0)
                if not ends[child]:  # the longest stop string that is a suffix here
                    ends[child] = ends[fail[child]]
                queue.append(child)
        self._fail, self._depth, self._ends = fail, depth, ends
        self._state = 0
        self._seen = 0  # characters fed so far

    @property
    def seen(self) -> int:
        """Characters fed so far (a `feed` that finds a stop string stops right after it)."""
        return self._seen

    @property
    def hold(self) -> int:
        return self._depth[self._state]

    def feed(self, text: str) -> int | None:
        goto, fail, ends = self._goto, self._fail, self._ends
        state = self._state
        for i, ch in enumerate(text):
            while state and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, 0)
            if ends[state]:
                self._state = state
                end = self._seen + i + 1
                self._seen = end
                return end - ends[state]
        self._state = state
        self._seen += len(text)
        return None
