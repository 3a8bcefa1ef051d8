"""transformers as the oracle for video prompts (Qwen2.5-VL, Qwen3-VL), built the way its processors build
them from frames that qwen-vl-utils sampled and sized (the README recipe: `process_vision_info`, then the
processor with the frames already resized, Qwen3-VL with `do_resize=False`).

transformers' video processors import torchvision at their top, and torchvision's PyPI wheel does not
load beside the CPU-only torch the tests pin. So their modules are imported while `torchvision` names an
empty stand-in (gone from sys.modules again afterwards), and what they compute is taken from them:
`Qwen2VLVideoProcessor.patchify` / `Qwen3VLVideoProcessor.patchify` (the patch layout and the grid) and
`TorchvisionBackend._fuse_mean_std_and_rescale_factor` (the normalisation constants). The one torchvision
call between them, `normalize`, is its `normalize_image` as written in torchvision/transforms/v2/
functional/_misc.py: `image.sub_(mean).div_(std)` with mean and std viewed [C, 1, 1]. The resize is
skipped, as transformers skips it when the frames already have the size it computes.
Prompts: the chat template, each `<|video_pad|>` replaced as the processor's `replace_video_token` does
(Qwen2.5-VL: grid tokens; Qwen3-VL: per temporal patch "<t seconds>" + vision_start + tokens +
vision_end, t from the frames' indices and fps), then tokenized; mm_token_type_ids 1 at image tokens and
2 at video tokens; Qwen2.5-VL's second_per_grid_ts = temporal_patch_size / sample_fps as float32.
"""
from __future__ import annotations

import importlib
import itertools
import sys
import types

import numpy as np
import torch


def _video_module(family: str):
    import transformers.image_processing_backends  # noqa: F401  (imported for real first)
    import transformers.video_processing_utils  # noqa: F401
    name = {"qwen2_vl": "transformers.models.qwen2_vl.video_processing_qwen2_vl",
            "qwen3_vl": "transformers.models.qwen3_vl.video_processing_qwen3_vl"}[family]
    if name in sys.modules:
        return sys.modules[name]
    names = ["torchvision", "torchvision.transforms", "torchvision.transforms.v2",
             "torchvision.transforms.v2.functional"]
    if importlib.util.find_spec("torchvision") is not None:
        try:
            return importlib.import_module(name)
        except Exception:  # the CUDA wheel beside CPU torch
            for n in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
                del sys.modules[n]
    mods = [types.ModuleType(n) for n in names]
    for parent, child, attr in zip(mods, mods[1:], ("transforms", "v2", "functional")):
        setattr(parent, attr, child)
    sys.modules.update(zip(names, mods))
    try:
        return importlib.import_module(name)
    finally:
        for n in names:
            sys.modules.pop(n, None)


def hf_video_pixels(frames: np.ndarray,  # [n, h, w, 3] uint8, sampled and resized
                    image_processor, family: str = "qwen2_vl") -> tuple[torch.Tensor, list[int]]:
    """(pixel_values_videos [patches, 3 * T * p * p] float32, [grid_t, grid_h, grid_w]) of one video."""
    from transformers.image_processing_backends import TorchvisionBackend
    ip = image_processor
    module = _video_module(family)
    cls = module.Qwen2VLVideoProcessor if family == "qwen2_vl" else module.Qwen3VLVideoProcessor
    videos = torch.from_numpy(frames).permute(0, 3, 1, 2)[None].to(torch.float32)  # [1, n, 3, h, w], as handed over
    mean, std, _ = TorchvisionBackend._fuse_mean_std_and_rescale_factor(
        None, True, tuple(ip.image_mean), tuple(ip.image_std), True, ip.rescale_factor, None)
    videos = videos.sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))  # torchvision's normalize_image
    patches, t, h, w = cls.patchify(None, videos, patch_size=ip.patch_size, merge_size=ip.merge_size,
                                    temporal_patch_size=ip.temporal_patch_size)
    return patches[0], [t, h, w]


def timestamps(times: tuple[float, ...], merge: int = 2) -> list[float]:
    """Qwen3VLProcessor._calculate_timestamps from each frame's time (index / fps): the mean of each pair."""
    times = list(times)
    if len(times) % merge:
        times.extend(times[-1] for _ in range(merge - len(times) % merge))
    return [(times[i] + times[i + merge - 1]) / 2 for i in range(0, len(times), merge)]


def hf_prompt(tokenizer, config, template_messages: list[dict], videos: list[dict], images: list[dict] = (),
              qwen3: bool = False) -> dict:
    """Inputs of `generate` for one conversation. `videos`: per video {"pixels", "grid", "sample_fps",
    "times"}; `images`: per image {"pixels", "grid"} (transformers' image processor's)."""
    text = tokenizer.apply_chat_template(template_messages, tokenize=False, add_generation_prompt=True)
    merge = config.vision_config.spatial_merge_size
    pieces = text.split("<|video_pad|>")
    assert len(pieces) == len(videos) + 1, "one <|video_pad|> per video"
    out = pieces[0]
    for video, rest in zip(videos, pieces[1:]):
        t, h, w = video["grid"]
        if qwen3:
            frame_tokens = h * w // merge ** 2
            out += "".join(f"<{stamp:.1f} seconds><|vision_start|>{'<|video_pad|>' * frame_tokens}<|vision_end|>"
                           for stamp in timestamps(video["times"]))
        else:
            out += "<|video_pad|>" * (t * h * w // merge ** 2)
        out += rest
    image_pieces = out.split("<|image_pad|>")
    out = image_pieces[0]
    for image, rest in zip(images, image_pieces[1:]):
        t, h, w = image["grid"]
        out += "<|image_pad|>" * (t * h * w // merge ** 2) + rest
    input_ids = torch.tensor([tokenizer.encode(out, add_special_tokens=False)])
    types_ = torch.zeros_like(input_ids, dtype=torch.int)
    types_[input_ids == config.image_token_id] = 1
    types_[input_ids == config.video_token_id] = 2
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "mm_token_type_ids": types_}
    if videos:
        inputs["pixel_values_videos"] = torch.cat([v["pixels"] for v in videos])
        inputs["video_grid_thw"] = torch.tensor([v["grid"] for v in videos])
        if not qwen3:
            inputs["second_per_grid_ts"] = torch.tensor([2 / v["sample_fps"] for v in videos])  # float32
    if images:
        inputs["pixel_values"] = torch.cat([i["pixels"] for i in images])
        inputs["image_grid_thw"] = torch.tensor([i["grid"] for i in images])
    return inputs


def qwen_original_positions(input_ids: list[int], mm_token_type_ids: list[int], grids: list[tuple[int, int, int]],
                            time_intervals: list[float], merge: int) -> tuple[torch.Tensor, int]:
    """Qwen2.5-VL's M-RoPE positions by the rule of Qwen's own get_rope_index (transformers PR #35569 by the
    Qwen team, kept through transformers 5.2; qwen-vl-finetune's rope2d.py; vLLM's MRotaryEmbedding): each
    text run and each vision block starts at the largest position before it + 1 (`llm_pos_ids_list[-1].max()
    + 1`), a block's temporal index is int(k * interval), and decoding continues at the prompt's largest
    position + 1. `grids`: (t, h, w) of each vision block in order; `time_intervals`: tokens_per_second *
    seconds per temporal patch for a video block, 0 for an image. Returns ([3, L] int64, rope_delta).
    Written from that rule, not from our rope_index.py (issue 50 point 10: transformers 5.3+ differs)."""
    blocks, groups = iter(zip(grids, time_intervals)), []
    for kind, run in itertools.groupby(mm_token_type_ids):
        groups.append((kind, len(list(run))))
    pieces, top = [], -1
    for kind, length in groups:
        start = top + 1
        if kind == 0:
            piece = (torch.arange(length) + start).expand(3, -1)
        else:
            (t, h, w), interval = next(blocks)
            gh, gw = h // merge, w // merge
            assert t * gh * gw == length, "one block per run of vision tokens"
            t_index = (torch.arange(t).view(-1, 1).expand(-1, gh * gw) * interval).long().flatten()
            h_index = torch.arange(gh).view(1, -1, 1).expand(t, -1, gw).flatten()
            w_index = torch.arange(gw).view(1, 1, -1).expand(t, gh, -1).flatten()
            piece = torch.stack([t_index, h_index, w_index]) + start
        pieces.append(piece)
        top = int(piece.max())
    positions = torch.cat(pieces, dim=1).to(torch.int64)  # [3, L]
    return positions, top + 1 - len(input_ids)


def hf_greedy_at(model, inputs: dict, positions: torch.Tensor, decode_start: int, max_new_tokens: int) -> list[int]:
    """transformers' model, greedy, driven with the given prompt positions ([3, L]) and decode token i at
    position decode_start + i on all three axes (its forward takes explicit position_ids as they are)."""
    kwargs = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    ids = inputs["input_ids"]
    with torch.inference_mode():
        out = model(input_ids=ids, position_ids=positions[:, None], use_cache=True, **kwargs)
        tokens = [int(out.logits[0, -1].argmax())]
        for i in range(1, max_new_tokens):
            step = torch.full((3, 1, 1), decode_start + i - 1, dtype=torch.int64)
            out = model(input_ids=torch.tensor([[tokens[-1]]]), position_ids=step, cache=out.cache, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens
