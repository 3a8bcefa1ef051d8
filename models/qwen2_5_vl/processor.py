"""Qwen2.5-VL prompt builder: messages -> `PromptInputs`.

Images are decoded and preprocessed, the chat template renders one `<|image_pad|>` per image, and
each is expanded to the image's token count (grid_t*grid_h*grid_w / merge^2), so the prompt's
length is final before scheduling. M-RoPE positions are computed here, once per request.
"""
from __future__ import annotations

from vlm_sdk.errors import InvalidRequestError
from vlm_sdk.multimodal.image_io import load_image
from vlm_sdk.multimodal.inputs import ImageInput, PromptInputs
from vlm_sdk.multimodal.messages import ImageRef, parse_messages
from vlm_sdk.models.qwen2_5_vl.image_processor import Qwen2VLImageProcessor
from vlm_sdk.models.qwen2_5_vl.rope_index import mrope_positions


class Qwen2_5_VLProcessor:
    def __init__(self, tokenizer, image_processor: Qwen2VLImageProcessor, hf_config, *,
                 min_pixels: int | None = None, max_pixels: int | None = None,
                 max_image_pixels: int = 64_000_000):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.image_token_id = hf_config.image_token_id
        self.merge_size = hf_config.vision_config.spatial_merge_size
        self.min_pixels = min_pixels
        self.max_pixels = max_pixels
        self.max_image_pixels = max_image_pixels

    def __call__(self, messages) -> PromptInputs:
        template_messages, refs = parse_messages(messages)
        images = [self._image(ref) for ref in refs]
        return self.build(template_messages, images)

    def _image(self, ref: ImageRef) -> ImageInput:
        pil = load_image(ref.source, max_image_pixels=self.max_image_pixels)
        min_px = ref.min_pixels or self.min_pixels
        max_px = ref.max_pixels or self.max_pixels
        image = self.image_processor(pil, min_pixels=min_px, max_pixels=max_px)
        image.source_size = (pil.height, pil.width)
        image.own_max_pixels = ref.max_pixels is not None
        return image

    def build(self, template_messages: list[dict], images: list[ImageInput]) -> PromptInputs:
        text = self.tokenizer.apply_chat_template(template_messages, tokenize=False, add_generation_prompt=True)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        token_ids, positions = [], []
        it = iter(images)
        for tok in ids:
            if tok != self.image_token_id:
                token_ids.append(tok)
                continue
            image = next(it, None)
            if image is None:
                raise InvalidRequestError("the prompt text contains more image placeholders than images were given; "
                                          "do not write <|image_pad|> in text parts")
            positions.append(len(token_ids))
            token_ids.extend([self.image_token_id] * image.num_tokens)
        if len(positions) != len(images):
            raise InvalidRequestError(f"the chat template rendered {len(positions)} image placeholders for "
                                      f"{len(images)} images; the model's chat template must render every image part")
        mrope, delta = mrope_positions(token_ids, [im.grid_thw for im in images], self.image_token_id,
                                       self.merge_size)
        return PromptInputs(token_ids=token_ids, images=images, image_positions=positions,
                            mrope_positions=mrope, rope_delta=delta)

    def image_tokens_with_max_pixels(self, prompt: PromptInputs, max_pixels: int) -> list[int]:
        """Each image's token count if the engine's max_pixels were `max_pixels` (images whose part
        sets its own max_pixels keep theirs)."""
        counts = []
        for image in prompt.images:
            if image.own_max_pixels or image.source_size is None:
                counts.append(image.num_tokens)
                continue
            h, w = image.source_size
            counts.append(self.image_processor.num_image_tokens(h, w, min_pixels=self.min_pixels,
                                                               max_pixels=max_pixels))
        return counts
