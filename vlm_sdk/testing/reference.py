"""transformers as the oracle, family-neutral part: batch single prompts (each built by the family's
`FIXTURES.reference.hf_prompt`) and generate greedily. Used by the parity tests and `vlm-sdk bench`.
Imports transformers lazily.
"""
from __future__ import annotations

import torch


def hf_batch(prompts: list[dict], pad_token_id: int) -> dict:
    """Left-pad single prompts into one batch."""
    width = max(p["input_ids"].shape[1] for p in prompts)
    ids, mask = [], []
    # the image-token flags some families' forward reads: Qwen's mm_token_type_ids, Gemma 3's token_type_ids
    types: dict[str, list[torch.Tensor]] = {}
    for p in prompts:
        n = p["input_ids"].shape[1]
        pad = width - n
        ids.append(torch.cat([torch.full((pad,), pad_token_id), p["input_ids"][0]]))
        mask.append(torch.cat([torch.zeros(pad, dtype=torch.long), torch.ones(n, dtype=torch.long)]))
        for key in ("mm_token_type_ids", "token_type_ids"):
            if key in p:
                flags = p[key][0]
                types.setdefault(key, []).append(torch.cat([torch.zeros(pad, dtype=flags.dtype), flags]))
    out = {"input_ids": torch.stack(ids), "attention_mask": torch.stack(mask)}
    out.update({key: torch.stack(rows) for key, rows in types.items()})
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
