"""Image bytes to normalised pixels where the model runs: the families' processors hand out resized
uint8 pixels with a `[C, 256]` table of transformers' float value of every (channel, byte), and the
model turns them into floats on its device. An image's bytes are 1/4 of its float32 pixels (1/8 where
the float layout repeats a frame in two temporal slots); the copy from pinned memory does not block.

    byte_table:      float64 x * rescale_factor, cast to float32, then float32 (x - mean) / std: the
                     operations and dtypes of transformers' rescale + normalize, once per byte value
    fused_byte_table: float32 (x - mean / rescale) / (std / rescale): transformers' torchvision-backed
                     processors (its video processors), which fuse the rescale into the normalisation
    bytes_to_device: pinned upload (CUDA), then one gather from the table rounded once to the dtype,
                     so the result equals normalising on the host and casting, bit for bit
"""
from __future__ import annotations

import numpy as np
import torch


def normalisation(mean, std, names: tuple[str, str] = ("image_mean", "image_std")) -> tuple[tuple[float, ...], ...]:
    """(mean, std) as float tuples, checked: 3 values each and no zero std; `InvalidRequestError` naming
    the preprocessor's fields (`names`) otherwise."""
    from vlm_sdk.errors import InvalidRequestError
    if len(mean) != 3 or len(std) != 3 or any(s == 0 for s in std):
        raise InvalidRequestError(f"{names[0]} and {names[1]} need 3 values each and a non-zero std; got "
                                  f"{names[0]}={list(mean)}, {names[1]}={list(std)}.")
    return tuple(float(m) for m in mean), tuple(float(s) for s in std)


def byte_table(mean: tuple[float, ...], std: tuple[float, ...], rescale_factor: float) -> np.ndarray:
    """`[C, 256]` float32: the normalised value of byte v in channel c."""
    values = (np.arange(256, dtype=np.float64) * rescale_factor).astype(np.float32)  # [256]
    m = np.array(mean, dtype=np.float32)[:, None]  # [C, 1]
    s = np.array(std, dtype=np.float32)[:, None]  # [C, 1]
    return np.ascontiguousarray((values[None, :] - m) / s, dtype=np.float32)  # [C, 256]


def fused_byte_table(mean: tuple[float, ...], std: tuple[float, ...], rescale_factor: float) -> np.ndarray:
    """`[C, 256]` float32 as transformers' `TorchvisionBackend.rescale_and_normalize` computes it:
    mean and std scaled by 1 / rescale_factor in float32, then (x - mean) / std in float32."""
    import torch
    m = torch.tensor(mean) * (1.0 / rescale_factor)  # [C] float32
    s = torch.tensor(std) * (1.0 / rescale_factor)  # [C] float32
    values = torch.arange(256, dtype=torch.float32)[None, :]  # [1, 256]
    return ((values - m[:, None]) / s[:, None]).numpy()  # [C, 256]


def bytes_to_device(raw: torch.Tensor,  # [N, C, ...] uint8 on the host (or already on the device)
                    table: torch.Tensor,  # [C, 256] float32
                    device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:  # [N, C, ...] dtype
    """`table[c, raw[n, c, ...]]` on `device`."""
    device = torch.device(device)
    if raw.dtype != torch.uint8 or raw.dim() < 2 or raw.shape[1] != table.shape[0] or table.shape[1:] != (256,):
        raise ValueError(f"bytes_to_device takes uint8 [N, C, ...] with a [C, 256] table, got {raw.dtype} "
                         f"{list(raw.shape)} and {list(table.shape)}")
    if device.type == "cuda" and raw.device.type == "cpu":
        raw = raw.pin_memory()  # an asynchronous copy needs page-locked memory
    raw = raw.to(device, non_blocking=True)
    n, channels = raw.shape[0], raw.shape[1]
    # [C * 256]: float32 values rounded once to dtype; 3 KB, staged without waiting for the device
    flat_table = table.to(device, non_blocking=True).to(dtype).view(-1)
    offsets = torch.arange(0, 256 * channels, 256, dtype=torch.int32, device=device)  # [C]
    index = raw.reshape(n, channels, -1).to(torch.int32) + offsets[:, None]  # [N, C, rest] 4 B per pixel
    return flat_table.index_select(0, index.view(-1)).view(raw.shape)  # [N, C, ...]


def images_to_device(data: list[torch.Tensor],  # per image: uint8 [n_i, C, ...] or float pixels
                     tables: list[torch.Tensor | None],  # per image: its [C, 256] table (bytes) or None
                     device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:  # [sum n_i, ...] dtype
    """The images' pixels back to back on `device`: float data (already normalised) copied and cast;
    bytes through their tables, in one upload and one gather when the images share a table (one
    processor's), else image by image. `ValueError` when bytes and floats are mixed or a table is missing."""
    if all(d.dtype != torch.uint8 for d in data):
        return torch.cat(data).to(device, dtype)
    if any(d.dtype != torch.uint8 for d in data) or any(t is None for t in tables):
        raise ValueError("images mix byte and float pixels, or byte pixels come without their table")
    if any(t is not tables[0] and not torch.equal(t, tables[0]) for t in tables[1:]):
        return torch.cat([bytes_to_device(d, t, device, dtype) for d, t in zip(data, tables)])
    return bytes_to_device(torch.cat(data), tables[0], device, dtype)
