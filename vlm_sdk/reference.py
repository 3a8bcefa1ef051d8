"""transformers as the oracle: build the same prompt for transformers' Qwen2.5-VL or InternVL and generate.

Used by the parity tests and `vlm-sdk bench`. Without torchvision the combined processors will not
build, so prompts are made the documented way: chat template, then each image placeholder expanded
by hand (Qwen: `<|image_pad|>` x grid_t*grid_h*grid_w/merge^2; InternVL: `<IMG_CONTEXT>` ->
`<img>` + `<IMG_CONTEXT>` x image_seq_length*tiles + `</img>`, tiles from transformers'
GotOcr2ImageProcessorPil). Imports transformers lazily.
"""
from __future__ import annotations

import torch

from vlm_sdk.multimodal.image_io import load_image
from vlm_sdk.multimodal.messages import parse_messages


def hf_image_processor(model_dir: str, **kwargs):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    return Qwen2VLImageProcessorPil.from_pretrained(model_dir, **kwargs)


def hf_prompt(tokenizer, image_processor, config, messages) -> dict:
    """input_ids [1, L], mm_token_type_ids, pixel_values, image_grid_thw for one conversation."""
    template_messages, refs = parse_messages(messages)
    text = tokenizer.apply_chat_template(template_messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    out = {}
    grids = []
    if refs:
        images = [load_image(r.source) for r in refs]
        proc = image_processor(images, return_tensors="pt")
        out["pixel_values"] = proc["pixel_values"]
        out["image_grid_thw"] = proc["image_grid_thw"]
        grids = proc["image_grid_thw"].tolist()
    merge = config.vision_config.spatial_merge_size
    expanded, it = [], iter(grids)
    for tok in ids:
        if tok == config.image_token_id:
            t, h, w = next(it)
            expanded.extend([tok] * (t * h * w // merge ** 2))
        else:
            expanded.append(tok)
    input_ids = torch.tensor([expanded])
    out["input_ids"] = input_ids
    out["mm_token_type_ids"] = (input_ids == config.image_token_id).int()
    return out


def hf_internvl_image_processor(model_dir: str, **kwargs):
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
    return GotOcr2ImageProcessorPil.from_pretrained(model_dir, **kwargs)


def hf_internvl_prompt(tokenizer, image_processor, config, messages) -> dict:
    """input_ids [1, L] and pixel_values [tiles, 3, S, S] for one conversation, transformers' way
    (an image part's own `max_num` becomes that image's `max_patches`; each tile is
    `config.image_seq_length` image tokens, the number transformers' InternVLProcessor uses)."""
    template_messages, refs = parse_messages(messages)
    text = tokenizer.apply_chat_template(template_messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    tiles, pixels = [], []
    for ref in refs:
        kwargs = {} if ref.max_num is None else {"max_patches": ref.max_num}
        proc = image_processor([load_image(ref.source)], return_tensors="pt", **kwargs)
        tiles.append(int(proc["num_patches"][0]))
        pixels.append(proc["pixel_values"])
    start, end = tokenizer.convert_tokens_to_ids("<img>"), tokenizer.convert_tokens_to_ids("</img>")
    expanded, it = [], iter(tiles)
    for tok in ids:
        if tok == config.image_token_id:
            expanded.extend([start] + [tok] * (config.image_seq_length * next(it)) + [end])
        else:
            expanded.append(tok)
    out = {"input_ids": torch.tensor([expanded])}
    if pixels:
        out["pixel_values"] = torch.cat(pixels)
    return out


def hf_batch(prompts: list[dict], pad_token_id: int) -> dict:
    """Left-pad single prompts into one batch."""
    width = max(p["input_ids"].shape[1] for p in prompts)
    ids, mask, types = [], [], []
    for p in prompts:
        n = p["input_ids"].shape[1]
        pad = width - n
        ids.append(torch.cat([torch.full((pad,), pad_token_id), p["input_ids"][0]]))
        mask.append(torch.cat([torch.zeros(pad, dtype=torch.long), torch.ones(n, dtype=torch.long)]))
        if "mm_token_type_ids" in p:  # Qwen2.5-VL only
            types.append(torch.cat([torch.zeros(pad, dtype=torch.int), p["mm_token_type_ids"][0]]))
    out = {"input_ids": torch.stack(ids), "attention_mask": torch.stack(mask)}
    if types:
        out["mm_token_type_ids"] = torch.stack(types)
    with_images = [p for p in prompts if "pixel_values" in p]
    if with_images:
        out["pixel_values"] = torch.cat([p["pixel_values"] for p in with_images])
        if "image_grid_thw" in with_images[0]:
            out["image_grid_thw"] = torch.cat([p["image_grid_thw"] for p in with_images])
    return out


@torch.inference_mode()
def hf_greedy(model, batch: dict, max_new_tokens: int, eos_token_ids=None) -> list[list[int]]:
    """Greedy continuation of each row, cut after its first eos (kept) when eos ids are given;
    with eos_token_ids=None generation ignores eos and every row gets max_new_tokens tokens."""
    from transformers import GenerationConfig
    pad = model.config.text_config.pad_token_id if hasattr(model.config, "text_config") else None
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False,
                           eos_token_id=list(eos_token_ids) if eos_token_ids else None,
                           pad_token_id=pad if pad is not None else 0)
    out = model.generate(**batch, generation_config=cfg)
    new = out[:, batch["input_ids"].shape[1]:].tolist()
    if not eos_token_ids:
        return new
    eos = set(eos_token_ids)
    cut = []
    for row in new:
        for j, tok in enumerate(row):
            if tok in eos:
                row = row[:j + 1]
                break
        cut.append(row)
    return cut


def best_of(fn, repeats: int):
    """(fastest wall time in seconds over `repeats` calls, the last result): the figure the
    preprocessing comparisons against transformers report."""
    import math
    import time
    best, result = math.inf, None
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def pixel_report(ours_s: float, theirs_s: float, ours: torch.Tensor, theirs: torch.Tensor, layout_match: bool,
                 num_images: int) -> dict:
    """Per-image times and the max abs pixel difference (inf when the layouts differ)."""
    same = layout_match and ours.shape == theirs.shape
    return {"ours_ms_per_image": ours_s * 1e3 / num_images, "transformers_ms_per_image": theirs_s * 1e3 / num_images,
            "max_abs_diff": (ours - theirs.to(torch.float32)).abs().max().item() if same else float("inf"),
            "num_images": num_images}
