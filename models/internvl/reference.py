"""transformers as the oracle for InternVL (`FIXTURES.reference`): GotOcr2ImageProcessorPil and the
same prompt built transformers' way (chat template, then `<IMG_CONTEXT>` -> `<img>` + `<IMG_CONTEXT>` x
image_seq_length*tiles + `</img>`). Imports transformers lazily; test fixtures only.
"""
from __future__ import annotations

import torch

from vlm_sdk.multimodal.image_io import load_image
from vlm_sdk.multimodal.messages import parse_messages


def hf_model(model_dir: str, dtype: torch.dtype = torch.float32):
    """transformers' own model class on the checkpoint, in eval mode."""
    from transformers import InternVLForConditionalGeneration
    return InternVLForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).eval()


def hf_image_processor(model_dir: str, **kwargs):
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
    return GotOcr2ImageProcessorPil.from_pretrained(model_dir, **kwargs)


def hf_prompt(tokenizer, image_processor, config, messages) -> dict:
    """input_ids [1, L] and pixel_values [tiles, 3, S, S] for one conversation, transformers' way
    (an image part's own `max_num` becomes that image's `max_patches`; each tile is
    `config.image_seq_length` image tokens, the number transformers' InternVLProcessor uses)."""
    template_messages, refs = parse_messages(messages)
    text = tokenizer.apply_chat_template(template_messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    tiles, pixels = [], []
    for ref in refs:
        max_num = ref.options.get("max_num")
        kwargs = {} if max_num is None else {"max_patches": max_num}
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
