"""transformers as the oracle for the Qwen-VL families' prompts (each family's reference module,
`FIXTURES.reference`, adds its own `hf_model`): transformers' Qwen2-VL image processor, which it serves
all of them with, and the prompt built transformers' way (without torchvision the combined processor
will not build, so: chat template, then each `<|image_pad|>` expanded by hand to
grid_t*grid_h*grid_w/merge^2). Imports transformers lazily; test fixtures only.
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
