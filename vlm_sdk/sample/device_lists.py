"""Short host lists (row indices, per-row settings) sent to the logits' device without a host sync."""
from __future__ import annotations

import torch


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:  # [len(values)]
    """`torch.tensor(values, device=cuda)` is a blocking copy: it waits for every kernel queued before
    it. A non-blocking copy of the pageable buffer is staged by the driver at once and returns, so
    the sampler's small uploads do not stall the host behind the forward still running."""
    t = torch.tensor(values, dtype=dtype)
    return t if device.type == "cpu" else t.to(device, non_blocking=True)
