"""transformers as the oracle for Gemma 3 (`FIXTURES.reference`): `Gemma3ForConditionalGeneration`,
`Gemma3ImageProcessorPil` (no torchvision needed) and transformers' own `Gemma3Processor` over them for
the prompt (its placeholder expansion, pan-and-scan and `token_type_ids`, which `generate` needs for the
bidirectional attention among each image's tokens). Imports transformers lazily; test fixtures only.
"""
from __future__ import annotations

import torch

from vlm_sdk.multimodal.image_io import load_image
from vlm_sdk.multimodal.messages import parse_messages


def hf_model(model_dir: str, dtype: torch.dtype = torch.float32):
    """transformers' own model class on the checkpoint, in eval mode."""
    from transformers import Gemma3ForConditionalGeneration
    return Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).eval()


def hf_image_processor(model_dir: str, **kwargs):
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    return Gemma3ImageProcessorPil.from_pretrained(model_dir, **kwargs)


def hf_processor(tokenizer, image_processor, config):
    from transformers import Gemma3Processor
    return Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer, chat_template=tokenizer.chat_template,
                           image_seq_length=config.mm_tokens_per_image)


def hf_prompt(tokenizer, image_processor, config, messages, **images_kwargs) -> dict:
    """input_ids [1, L], token_type_ids [1, L] (1 at image soft tokens) and pixel_values [frames, 3, S, S]
    for one conversation, through transformers' Gemma3Processor; `images_kwargs` (e.g. do_pan_and_scan=True)
    go to its image processor for every image. An image part's own options are not read: give them here."""
    template_messages, refs = parse_messages(messages)
    text = tokenizer.apply_chat_template(template_messages, tokenize=False, add_generation_prompt=True)
    images = [load_image(r.source) for r in refs] or None
    processor = hf_processor(tokenizer, image_processor, config)
    out = processor(text=text, images=images, return_tensors="pt", add_special_tokens=False,
                    images_kwargs=images_kwargs)
    result = {"input_ids": out["input_ids"], "token_type_ids": out["token_type_ids"]}
    if images:
        result["pixel_values"] = out["pixel_values"]
    return result
