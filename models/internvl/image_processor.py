"""InternVL 2 / 2.5 / 3 image preprocessing: dynamic tiling into 448x448 tiles plus a thumbnail.

Pixel-for-pixel the same as transformers' `GotOcr2ImageProcessorPil(crop_to_patches=True)` (the
processor the `-hf` InternVL checkpoints use): choose the tile grid, resize the whole image with PIL
bicubic on uint8 to (448*cols, 448*rows), cut it row by row into 448x448 tiles, append a 448x448
bicubic resize of the original image when there is more than one tile, then x * (1/255) in float64
cast to float32 and (x - mean) / std in float32. The rescale and normalise depend only on a pixel's
byte and channel, so they are done once per (channel, byte) into a 3x256 lookup table built with
exactly those operations, and the tiles are a table gather: the same float32 bits, far less work.

The engine's path keeps the bytes (`tile_bytes`: uint8 tiles, 1/4 of the float32 bytes) and does that
gather on the model's device (`multimodal.pixels`, with `pixel_lut`); `__call__` gives the float tiles
on the host (transformers' output, for comparisons and benchmarks).
"""
from __future__ import annotations


import numpy as np
import torch
from PIL import Image

from vlm_sdk.errors import CheckpointError, InvalidImageError, InvalidRequestError
from vlm_sdk.model_loader import config_field
from vlm_sdk.multimodal.image_io import to_rgb
from vlm_sdk.multimodal.image_key import image_key
from vlm_sdk.multimodal.pixels import byte_table, normalisation

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _check_tile_bounds(min_num, max_num) -> None:
    for name, value in (("min_num", min_num), ("max_num", max_num)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise InvalidRequestError(f"{name} must be a positive int, got {value!r}.")
    if min_num > max_num:
        raise InvalidRequestError(f"min_num ({min_num}) is larger than max_num ({max_num}); "
                                  f"set min_num <= max_num.")


def _closest_grid(candidates, width: int, height: int, image_size: int) -> tuple[int, int]:
    """The loop shared by transformers' get_optimal_tiled_canvas and InternVL's find_closest_aspect_ratio.
    `candidates` are (cols, rows) in visiting order; returns (cols, rows)."""
    aspect_ratio = width / height
    area = width * height
    best_diff, best = float("inf"), (1, 1)
    for cols, rows in candidates:
        diff = abs(aspect_ratio - cols / rows)
        if diff < best_diff:
            best_diff, best = diff, (cols, rows)
        elif diff == best_diff and area > 0.5 * image_size * image_size * cols * rows:
            best = (cols, rows)  # a tie goes to the later (larger) grid while the image is big enough
    return best


def published_grid(width: int, height: int, min_num: int = 1, max_num: int = 12,
                   image_size: int = 448) -> tuple[int, int]:
    """(rows, cols) as InternVL's published `dynamic_preprocess` chooses it: the candidate set is a
    Python set sorted (stably) by tile count, so grids with the same count are visited in set order.

    Equal to `InternVLImageProcessor.grid` (transformers' order, same count visited by increasing
    cols) whenever min_num == 1 (checked for every max_num <= 40: no two grids with the same count
    are then neighbours in aspect ratio, so the within-count order never decides). With min_num > 1
    they can differ on exact ties, e.g. min_num = max_num = 4 on a 5x2 image: published (1 row, 4
    cols), transformers (2, 2).
    """
    _check_tile_bounds(min_num, max_num)
    target_ratios = set(
        (i, j) for n in range(min_num, max_num + 1) for i in range(1, n + 1) for j in range(1, n + 1)
        if min_num <= i * j <= max_num)
    target_ratios = sorted(target_ratios, key=lambda x: x[0] * x[1])
    cols, rows = _closest_grid(target_ratios, width, height, image_size)
    return rows, cols


class InternVLImageProcessor:
    """InternVL dynamic tiling: the tile grid (i x j, min_num <= i*j <= max_num) whose aspect ratio is closest
    to the image's, ties going to the larger area as in the published dynamic_preprocess; resize to
    (448*j, 448*i) bicubic, cut into 448x448 tiles, add a 448x448 thumbnail when there is more than one tile;
    rescale 1/255 and normalise with ImageNet mean/std.

    Output: `[tiles, 3, image_size, image_size]` float32, tiles row by row, the thumbnail last.
    """

    def __init__(self, image_size: int = 448, min_num: int = 1, max_num: int = 12, use_thumbnail: bool = True,
                 mean: tuple[float, ...] = IMAGENET_MEAN, std: tuple[float, ...] = IMAGENET_STD,
                 rescale_factor: float = 1 / 255, resample: int = Image.Resampling.BICUBIC):
        if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size <= 0:
            raise InvalidRequestError(f"image_size must be a positive int, got {image_size!r}.")
        _check_tile_bounds(min_num, max_num)
        self.mean, self.std = normalisation(mean, std, names=("mean", "std"))
        self.image_size = image_size
        self.min_num = min_num
        self.max_num = max_num
        self.use_thumbnail = bool(use_thumbnail)
        self.rescale_factor = float(rescale_factor)
        self.resample = int(resample)
        # transformers' arithmetic on every possible byte: float64 rescale, cast to float32, then float32
        # subtract and divide (normalize casts mean/std to the image dtype)
        self._lut = byte_table(self.mean, self.std, self.rescale_factor)  # [3, 256]
        self.pixel_lut = torch.from_numpy(self._lut)  # [3, 256] float32, shared by every image's meta
        self._candidates: dict[tuple[int, int], list[tuple[int, int]]] = {}

    @classmethod
    def from_preprocessor_config(cls, config: dict, hf_config=None) -> "InternVLImageProcessor":
        """Build from `preprocessor_config.json` and, optionally, `config.json`.

        transformers' layout (`-hf` checkpoints, GotOcr2ImageProcessor): `size: {height, width}`,
        `min_patches`, `max_patches`, `crop_to_patches`, `image_mean`/`image_std`. The original layout
        (OpenGVLab's remote-code checkpoints) keeps a CLIP-style preprocessor config (`size`/`crop_size`
        448) and puts the tiling in config.json: `force_image_size`, `min_dynamic_patch`,
        `max_dynamic_patch`, `use_thumbnail`, `dynamic_image_size`. Values from `hf_config` win.
        """
        config = dict(config or {})

        def cfg(key):
            return config_field(hf_config, key)

        def side(value):
            if isinstance(value, dict):
                h, w = value.get("height"), value.get("width")
                if h is not None and w is not None and h != w:
                    raise CheckpointError(f"InternVL tiles are square; preprocessor_config.json asks for "
                                          f"{w}x{h} (width x height).")
                return h if h is not None else value.get("shortest_edge")
            return value

        vision_size = config_field(cfg("vision_config"), "image_size")
        preprocessor_size = side(config.get("size")) or side(config.get("crop_size"))
        if cfg("model_type") == "internvl":  # transformers tiles at the image processor's size
            image_size = preprocessor_size or vision_size or 448
        else:  # the original chat code tiles at force_image_size, else the vision tower's size
            image_size = cfg("force_image_size") or vision_size or preprocessor_size or 448
        if isinstance(image_size, (list, tuple)):
            image_size = image_size[0]

        min_num = cfg("min_dynamic_patch")
        if min_num is None:
            min_num = config.get("min_patches", 1)
        max_num = cfg("max_dynamic_patch")
        if max_num is None:
            max_num = config.get("max_patches", 12)
        use_thumbnail = cfg("use_thumbnail")
        if use_thumbnail is None:
            use_thumbnail = True
        dynamic = cfg("dynamic_image_size")
        if dynamic is None and cfg("model_type") == "internvl":
            # the -hf checkpoints save crop_to_patches false, but transformers' InternVLProcessor always
            # calls the image processor with crop_to_patches=True: InternVL tiles
            dynamic = True
        if dynamic is None:
            dynamic = config.get("crop_to_patches", True)
        if not dynamic or max_num <= 1:  # transformers: no cropping at all, one resized image
            min_num, max_num = 1, 1

        kwargs = {}
        if config.get("image_mean") is not None:
            kwargs["mean"] = config["image_mean"]
        if config.get("image_std") is not None:
            kwargs["std"] = config["image_std"]
        if config.get("resample") is not None:
            kwargs["resample"] = config["resample"]
        kwargs["rescale_factor"] = config.get("rescale_factor", 1 / 255) if config.get("do_rescale", True) else 1.0
        if config.get("do_normalize", True) is False:
            kwargs["mean"], kwargs["std"] = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
        try:
            return cls(image_size=int(image_size), min_num=int(min_num), max_num=int(max_num),
                       use_thumbnail=bool(use_thumbnail), **kwargs)
        except InvalidRequestError as exc:
            raise CheckpointError(f"InternVL preprocessing config: {exc}") from exc

    def _max(self, max_num: int | None) -> int:
        max_num = self.max_num if max_num is None else max_num
        _check_tile_bounds(self.min_num, max_num)
        return max_num

    def grid(self, width: int, height: int, max_num: int | None = None) -> tuple[int, int]:
        """(rows, cols) of the tile grid, transformers' `get_optimal_tiled_canvas` choice."""
        max_num = self._max(max_num)
        if width <= 0 or height <= 0:
            raise InvalidImageError(f"image has zero size ({width}x{height}, width x height).")
        key = (self.min_num, max_num)
        candidates = self._candidates.get(key)
        if candidates is None:  # transformers' order: by tile count, then cols, then rows
            candidates = sorted(((c, r) for c in range(1, max_num + 1) for r in range(1, max_num + 1)
                                 if self.min_num <= c * r <= max_num), key=lambda g: g[0] * g[1])
            self._candidates[key] = candidates
        cols, rows = _closest_grid(candidates, width, height, self.image_size)
        return rows, cols

    def num_tiles(self, width: int, height: int, max_num: int | None = None) -> int:
        rows, cols = self.grid(width, height, max_num)
        return self.tiles_of_grid(rows * cols)

    def tiles_of_grid(self, n: int) -> int:
        """Tiles an image cut into `n` grid tiles becomes: plus the thumbnail when there is more than one."""
        return n + 1 if (self.use_thumbnail and n > 1) else n

    def __call__(self, image: Image.Image, max_num: int | None = None) -> torch.Tensor:  # [tiles, 3, s, s] float32
        tiles, thumb = self._tiles(image, max_num)
        n = tiles.shape[0] * tiles.shape[1]
        s = self.image_size
        out = np.empty((n + (thumb is not None), 3, s, s), dtype=np.float32)  # [tiles, 3, s, s]
        out_tiles = out[:n].reshape(tiles.shape)  # view
        for c in range(3):
            np.take(self._lut[c], tiles[:, :, c], out=out_tiles[:, :, c])
        if thumb is not None:
            for c in range(3):
                np.take(self._lut[c], thumb[:, :, c], out=out[n, c])
        return torch.from_numpy(out)

    def tile_bytes(self, image: Image.Image, max_num: int | None = None) -> torch.Tensor:  # [tiles, 3, s, s] uint8
        """The tiles before the rescale and normalisation: `pixel_lut` maps them to `__call__`'s values."""
        tiles, thumb = self._tiles(image, max_num)
        n = tiles.shape[0] * tiles.shape[1]
        s = self.image_size
        out = np.empty((n + (thumb is not None), 3, s, s), dtype=np.uint8)  # [tiles, 3, s, s]
        out[:n].reshape(tiles.shape)[...] = tiles
        if thumb is not None:
            out[n] = thumb.transpose(2, 0, 1)
        return torch.from_numpy(out)

    def _tiles(self, image: Image.Image, max_num: int | None) -> tuple[np.ndarray, np.ndarray | None]:
        """The resized image as [rows, cols, 3, s, s] uint8 tiles (a view) and the [s, s, 3] thumbnail (or None)."""
        if not isinstance(image, Image.Image):
            raise InvalidImageError(f"the image processor takes a PIL.Image.Image, got {type(image).__name__}; "
                                    f"use vlm_sdk.multimodal.image_io.load_image to decode other sources.")
        if image.mode != "RGB":
            image = to_rgb(image)
        width, height = image.size
        rows, cols = self.grid(width, height, max_num)
        s = self.image_size
        n = rows * cols
        resized = np.asarray(image.resize((s * cols, s * rows), resample=self.resample))  # [s*rows, s*cols, 3]
        tiles = resized.reshape(rows, s, cols, s, 3).transpose(0, 2, 4, 1, 3)  # [rows, cols, 3, s, s] (view)
        thumb = np.asarray(image.resize((s, s), resample=self.resample)) if self.tiles_of_grid(n) > n else None
        return tiles, thumb  # thumb: [s, s, 3]


def internvl_image_pixels(image: Image.Image, ip: InternVLImageProcessor, max_num: int):
    """One decoded image's work (where `PromptProcessor.run_pixels` puts it): (tile bytes uint8
    [tiles, 3, S, S], (height, width) as decoded, its `image_key`)."""
    return ip.tile_bytes(image, max_num), (image.height, image.width), image_key(image, max_num=max_num)
