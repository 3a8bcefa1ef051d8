"""The worker's persistent block tables (the block arithmetic both sides share is the protocol's:
vlm_sdk/protocol/blocks.py)."""
from __future__ import annotations

import numpy as np
import torch



class BlockTables:
    """One row of block ids per request the worker holds and per attention cache group (`num_groups`
    tables of the same rows: `[groups, rows, blocks]`), kept between steps on the host and on the
    device, and changed only where a step changes them:

        add(ids) -> row     a new (or resumed) request takes a free row: its ids per group, zeros after them
        append(row, ids)    a running request's new blocks per group: only those entries are written
        remove(row)         the row is free for the next request
        flush()             the step's changed entries reach the device table (one copy and one
                            scatter, none when nothing changed)

    A step reads its rows in its own order from the device (`device_table.index_select(1, rows)`: every
    group's at once), and its slots from the host mirror (numpy, no Python list per step). Rows past a
    request's blocks hold zeros, as the padded tables of a step did. With `growable` (no CUDA graph holds
    the device table's address) the table doubles when it runs out of rows or columns; otherwise its
    size is fixed: `max_rows` is `max_num_seqs` and `max_blocks` covers `max_model_len`.
    """

    def __init__(self, max_rows: int, max_blocks: int, device: torch.device, *, growable: bool = False,
                 num_groups: int = 1):
        self.device, self.growable, self.num_groups = device, growable, num_groups
        self._alloc(max(max_rows, 1), max(max_blocks, 1))
        self.free_rows = list(range(self.max_rows - 1, -1, -1))  # pop() hands out row 0 first
        self._pending: list[tuple[int, np.ndarray]] = []  # (flat index of the first entry, its values)

    def _alloc(self, rows: int, cols: int) -> None:
        pin = self.device.type == "cuda"
        host = torch.zeros(self.num_groups, rows, cols, dtype=torch.int32, pin_memory=pin)  # [groups, rows, cols]
        old = getattr(self, "host_np", None)
        if old is not None:
            host.numpy()[:, :old.shape[1], :old.shape[2]] = old
        self.host, self.host_np = host, host.numpy()
        # its own storage on the CPU too, so the CPU tests run the same incremental updates
        self.device_table = host.to(self.device) if self.device.type != "cpu" else host.clone()  # [groups, rows, cols]
        self.num_blocks = np.zeros(rows, dtype=np.int64) if old is None else \
            np.concatenate([self.num_blocks, np.zeros(rows - old.shape[1], dtype=np.int64)])
        self.max_rows, self.max_blocks = rows, cols

    def _fit(self, rows: int, cols: int) -> None:
        if rows <= self.max_rows and cols <= self.max_blocks:
            return
        if not self.growable:
            raise ValueError(f"block table of {self.max_rows} rows x {self.max_blocks} blocks cannot hold "
                             f"{rows} rows x {cols} blocks")
        old_rows = self.max_rows
        self._pending.clear()  # the new device table is a copy of the whole host table
        self._alloc(max(rows, 2 * old_rows if rows > old_rows else old_rows),
                    max(cols, 2 * self.max_blocks if cols > self.max_blocks else self.max_blocks))
        self.free_rows = list(range(self.max_rows - 1, old_rows - 1, -1)) + self.free_rows

    def add(self, block_ids: tuple[list[int], ...]) -> int:
        """`block_ids`: one list per group, all of one length."""
        n = len(block_ids[0])
        if not self.free_rows:
            self._fit(self.max_rows + 1, self.max_blocks)
        self._fit(self.max_rows, n)
        row = self.free_rows.pop()
        old = int(self.num_blocks[row])
        for g, ids in enumerate(block_ids):
            values = np.zeros(max(old, n), dtype=np.int32)  # zeros over the last occupant's
            values[:n] = ids
            self._write(g, row, 0, values)
        self.num_blocks[row] = n
        return row

    def append(self, row: int, block_ids: tuple[list[int], ...]) -> None:
        """`block_ids`: one list per group (all of one length) of new blocks, or () for none."""
        if not block_ids or not block_ids[0]:
            return
        start, n = int(self.num_blocks[row]), len(block_ids[0])
        self._fit(self.max_rows, start + n)
        for g, ids in enumerate(block_ids):
            self._write(g, row, start, np.asarray(ids, dtype=np.int32))
        self.num_blocks[row] = start + n

    def truncate(self, row: int, keep: int) -> None:
        """Row `row` holds its first `keep` blocks only (speculative decoding's rollback); the entries past
        them are stale until the next `append` overwrites them, and never read (lengths bound every read)."""
        self.num_blocks[row] = min(int(self.num_blocks[row]), keep)

    def remove(self, row: int) -> None:
        self.free_rows.append(row)  # its entries stay until the next occupant overwrites them

    def _write(self, group: int, row: int, col: int, values: np.ndarray) -> None:
        self.host_np[group, row, col:col + len(values)] = values
        self._pending.append(((group * self.max_rows + row) * self.max_blocks + col, values))

    def flush(self) -> None:
        """Copy the entries changed since the last flush to the device table."""
        if not self._pending:
            return
        index = np.concatenate([np.arange(s, s + len(v)) for s, v in self._pending])  # [changed]
        values = np.concatenate([v for _, v in self._pending])  # [changed]
        both = torch.from_numpy(np.stack([index, values.astype(np.int64)]))  # [2, changed] int64
        if self.device.type == "cuda":
            both = both.pin_memory()
        dev = both.to(self.device, non_blocking=True)  # [2, changed]
        self.device_table.view(-1).index_copy_(0, dev[0], dev[1].int())
        self._pending.clear()

    def rows(self, rows: np.ndarray, group: int = 0) -> torch.Tensor:  # [len(rows), max blocks of those rows] int32
        """One group's host rows in this order, cut to their widest (tests and the host path)."""
        width = int(self.num_blocks[rows].max()) if len(rows) else 0
        return torch.from_numpy(self.host_np[group, rows, :width])
