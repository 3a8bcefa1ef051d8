"""Tiny Hugging Face checkpoints with random weights, for tests and benchmarks without a model hub.

`make_tiny_checkpoint` writes a directory that transformers itself can load: `config.json`, safetensors
weights saved by `Qwen2_5_VLForConditionalGeneration.save_pretrained`, a small byte-level BPE tokenizer
with Qwen's special tokens and chat template, `generation_config.json` and `preprocessor_config.json`.
transformers' model on the same directory is the correctness oracle for our implementation.

`family="internvl"` writes an InternVL 2 / 2.5 / 3 checkpoint instead, in transformers' layout
(`InternVLForConditionalGeneration`) or OpenGVLab's original remote-code layout (`InternVLChatModel`):
see `vlm_sdk.testing_internvl`.
"""
from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import torch

__all__ = [
    "make_tiny_checkpoint", "make_bench_checkpoint", "SUPPORTED_FAMILIES", "QWEN_SPECIAL_TOKENS",
    "QWEN2_VL_CHAT_TEMPLATE",
]

SUPPORTED_FAMILIES = ("qwen2_5_vl", "internvl")

# In Qwen's order; they get the ids right after the trained BPE vocabulary.
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)

# The chat template published with Qwen2-VL / Qwen2.5-VL Instruct.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen2's pre-tokenizer split (the same regex transformers' Qwen2Tokenizer rebuilds on load).
_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_BPE_VOCAB_SIZE = 1000  # 256 byte tokens + 744 merges; the special tokens come after

_OPENAI_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_OPENAI_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

# Original English text (no third-party corpus); enough distinct pairs for 744 merges.
_CORPUS = """\
A small red boat rests on the shore of a quiet lake. Behind it, a row of tall pine trees rises toward a pale blue sky.
The photograph shows a busy street market in the early morning. Vendors arrange baskets of apples, oranges, lemons and green peppers.
In the center of the image there is a wooden table with two white cups, a teapot and a plate of cookies.
A black and white cat sleeps on a windowsill while rain runs down the glass.
The chart compares the monthly sales of three stores. Sales grow in spring, fall in summer and rise again before the winter holidays.
Two children are flying a bright yellow kite on a windy hill. Their shadows stretch across the grass.
The diagram explains how water moves from the ocean to the clouds, falls as rain, and flows back to the sea through rivers.
A man in a gray coat waits at the bus stop, reading a newspaper. A woman next to him looks at her phone.
The screenshot contains a login form with fields for the user name and the password, and a blue button labeled Sign in.
On the left side of the picture there is a mountain covered with snow; on the right side there is a small village with red roofs.
Describe this image in one sentence. What color is the car? How many people are in the room? Where was this photo taken?
The assistant answers the question clearly and briefly. If the image is unclear, the assistant says what it can and cannot see.
You are a helpful assistant. The user asks questions about pictures, documents, tables and charts, and you answer them.
Please read the text in the image and write it down exactly as it appears, keeping the line breaks.
The table lists the name, age and city of five people: Anna is 34 and lives in Berlin; Carlos is 28 and lives in Madrid.
The receipt shows the date, the store address, the items bought and the total price of 42 dollars and 17 cents.
An old clock tower stands in the middle of the square. Pigeons gather around the fountain at its base.
The painting uses warm colors: orange, gold and deep red. A woman in a long dress walks through a field of wheat.
The x axis shows the year and the y axis shows the temperature in degrees. The line goes up slowly over time.
There are four apples, three bananas and one pear in the bowl. The bowl is made of glass and sits on a marble counter.
The dog is running after a ball in the park. Its ears are flying and its mouth is open as if it were smiling.
This is a map of the city center. The river divides the old town in the north from the new business district in the south.
The slide has a title, three bullet points and a small logo in the bottom right corner.
A plane is taking off from the runway at sunset. The sky is orange and purple, and the lights of the airport are on.
The kitchen is clean and bright. Pots hang above the stove and fresh herbs grow in small pots by the window.
The bicycle leans against a brick wall. Its front wheel is bent and the chain is missing.
In this photo, a group of friends is sitting around a campfire at night, telling stories and roasting marshmallows.
The page of the book is open to a chapter about the history of printing, with a drawing of an early press.
Question: what is written on the sign? Answer: the sign says that the road is closed for repairs until Friday.
Question: is it day or night? Answer: it is night, because the street lamps are on and the sky is dark.
The model looks at the image, finds the objects, and explains how they relate to each other in space.
Each image is split into small patches; the patches become tokens that the language model reads together with the text.
Numbers and dates: 1, 2, 3, 10, 25, 100, 2024, 3.14, 12:30, 7 June, 15 percent, first, second, third.
Weather report: cloudy in the morning, sunny in the afternoon, with a light wind from the west and a high of 21 degrees.
The train arrives at the station at nine o'clock. Passengers carry bags and suitcases onto the platform.
A bowl of soup, a piece of bread and a glass of water are placed on a tray in the hospital room.
The building has glass walls that reflect the clouds. Workers in orange helmets stand on the scaffolding.
A butterfly with blue wings sits on a purple flower. Tiny drops of dew cover the petals.
The graph has two lines: the first shows income and the second shows spending; they cross in the middle of the year.
The soccer player kicks the ball toward the goal while the goalkeeper jumps to the left.
The office desk holds a laptop, a notebook, a pen, a coffee mug and a small plant in a white pot.
Snow falls softly on the empty street. The windows of the houses glow with warm yellow light.
The horse stands in a green field near a wooden fence. A farmhouse and a barn are visible in the distance.
The recipe says: mix the flour, sugar and eggs; add the milk slowly; bake for thirty minutes at 180 degrees.
She is holding an umbrella and a shopping bag. He is pointing at something across the road.
It's a sunny day, isn't it? They're going to the beach, and we'll meet them there. I've seen this place before.
The museum hall is full of statues. Visitors walk slowly and read the small signs beside each work of art.
The forest path is covered with brown leaves. A deer watches from behind a tree, ready to run.
The boat carries fishermen back to the harbor. Seagulls circle above the nets full of fish.
The classroom has rows of desks, a whiteboard with math problems, and a globe on the teacher's table.
The image is blurry and dark, so it is hard to tell what the object on the floor is; it may be a shoe or a bag.
Let me think step by step. First, count the objects. Then compare their sizes. Finally, give the answer.
The answer is yes. The answer is no. The answer is not clear from the image. There is not enough information.
The city skyline at night is full of lights. A bridge crosses the river, and cars move along it like small stars.
The garden has roses, tulips and sunflowers. A stone path leads to a bench under an apple tree.
"""

_DEFAULTS: Mapping[str, Any] = MappingProxyType(dict(
    text_hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=128,
    vocab_size=None,              # None: tokenizer size rounded up to a multiple of 64
    vision_depth=2,
    vision_hidden_size=32,
    vision_heads=2,
    vision_intermediate_size=64,
    fullatt_block_indexes=(1,),
    window_size=112,
    tie_word_embeddings=False,
    mrope_section=None,           # None: Qwen's 1/4, 3/8, 3/8 split of head_dim / 2
    max_position_embeddings=4096,
    min_pixels=56 * 56,
    max_pixels=28 * 28 * 256,
    init_std=0.2,
    config_layout="nested",
    preprocessor_layout="nested",
    max_shard_size=None,          # e.g. "200KB" forces sharded safetensors + model.safetensors.index.json
    dtype="float32",              # dtype of the saved weights ("bfloat16" for the benchmark checkpoint)
))

_FIXED: Mapping[str, Any] = MappingProxyType(dict(
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    patch_size=14,
    temporal_patch_size=2,
    spatial_merge_size=2,
    tokens_per_second=2,
))


def make_tiny_checkpoint(path, family: str = "qwen2_5_vl", seed: int = 0, **overrides) -> Path:
    """Write a complete HF-format checkpoint with random weights to `path` and return it.

    `family` is one of `SUPPORTED_FAMILIES`. "internvl" goes to
    `vlm_sdk.testing_internvl.make_tiny_internvl_checkpoint` (its overrides, e.g. `layout="original"`,
    `llm="llama"`, are described there); the rest of this docstring is about "qwen2_5_vl".

    Same arguments give byte-identical files. Accepted overrides: see `_DEFAULTS` (an unknown name
    raises TypeError). Layouts: config_layout "nested" is what transformers 5 writes, "flat" is the
    published Qwen2.5-VL layout (text fields top level, rope_scaling type mrope); preprocessor_layout
    "nested" writes size.shortest_edge/longest_edge, "flat" writes min_pixels/max_pixels.
    """
    if family not in SUPPORTED_FAMILIES:
        raise ValueError(f"unknown family {family!r}; supported families: {', '.join(SUPPORTED_FAMILIES)}")
    if family == "internvl":
        from vlm_sdk.testing_internvl import make_tiny_internvl_checkpoint
        return make_tiny_internvl_checkpoint(path, seed=seed, **overrides)
    unknown = sorted(set(overrides) - set(_DEFAULTS))
    if unknown:
        raise TypeError(f"make_tiny_checkpoint() got unknown override(s) {', '.join(unknown)}; "
                        f"accepted: {', '.join(sorted(_DEFAULTS))}")
    opts = {**_DEFAULTS, **overrides}
    for key, allowed in (("config_layout", ("nested", "flat")), ("preprocessor_layout", ("nested", "flat"))):
        if opts[key] not in allowed:
            raise ValueError(f"{key}={opts[key]!r}; use one of {allowed}")
    dtype = getattr(torch, str(opts["dtype"]), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype={opts['dtype']!r} is not a torch floating dtype name")

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer, ids, config = qwen_tokenizer_and_config(opts)
    _save_model(config, out, seed=seed, init_std=float(opts["init_std"]), dtype=dtype,
                max_shard_size=opts["max_shard_size"])

    if opts["config_layout"] == "flat":
        nested = json.loads((out / "config.json").read_text())
        _write_json(out / "config.json", _flat_qwen2_5_vl_config(nested, ids))
    write_qwen_side_files(out, tokenizer, ids, opts)
    return out


def qwen_tokenizer_and_config(opts: Mapping[str, Any]):
    """The test tokenizer, its special-token ids and the transformers `Qwen2_5_VLConfig` of `opts`
    (`_DEFAULTS` with overrides applied)."""
    tokenizer = _build_tokenizer()
    ids = {tok: tokenizer.token_to_id(tok) for tok in QWEN_SPECIAL_TOKENS}
    n_tokens = tokenizer.get_vocab_size()
    vocab_size = opts["vocab_size"] or _round_up(n_tokens, 64)
    if vocab_size < n_tokens:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer ({n_tokens} tokens)")
    return tokenizer, ids, _qwen2_5_vl_config(opts, vocab_size, ids)


def write_qwen_side_files(out: Path, tokenizer, ids: dict[str, int], opts: Mapping[str, Any]) -> None:
    """Everything of a Qwen2.5-VL checkpoint directory besides config.json and the weights: the
    tokenizer files, generation_config.json and preprocessor_config.json."""
    _write_tokenizer(out, tokenizer)
    _write_json(out / "generation_config.json", {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
    })
    _write_json(out / "preprocessor_config.json",
                _preprocessor_config(opts["min_pixels"], opts["max_pixels"], opts["preprocessor_layout"]))


def make_bench_checkpoint(path, seed: int = 0, *, family: str = "qwen2_5_vl", **overrides) -> Path:
    """The benchmark shape: Qwen2.5-VL architecture, 105,909,504 parameters, bfloat16 weights (212 MB).

    Text 101.4M (tied 151936 x 512 embedding = 77.8M of it), vision 4.5M. Speed does not depend on the
    weight values; vocab 151936 keeps the embedding and LM head as costly as the real ones.
    `family="internvl"`: the InternVL equivalent, `vlm_sdk.testing_internvl.make_bench_internvl_checkpoint`.
    """
    if family == "internvl":
        from vlm_sdk.testing_internvl import make_bench_internvl_checkpoint
        return make_bench_internvl_checkpoint(path, seed=seed, **overrides)
    if family != "qwen2_5_vl":
        raise ValueError(f"unknown family {family!r}; supported families: {', '.join(SUPPORTED_FAMILIES)}")
    bench = dict(
        text_hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1408,
        vocab_size=151936, tie_word_embeddings=True, mrope_section=(8, 12, 12),
        max_position_embeddings=32768, min_pixels=56 * 56, max_pixels=28 * 28 * 1280,
        vision_depth=4, vision_hidden_size=256, vision_heads=4, vision_intermediate_size=512,
        fullatt_block_indexes=(3,), dtype="bfloat16",
    )
    return make_tiny_checkpoint(path, "qwen2_5_vl", seed, **{**bench, **overrides})


# ----------------------------------------------------------------------------------------------
# tokenizer

def _build_tokenizer(special_tokens: tuple[str, ...] = QWEN_SPECIAL_TOKENS):
    """The byte-level BPE trained on `_CORPUS`, then `special_tokens` in order (ids from 1000 on)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE

    tok = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    # The same pipeline as Qwen2's tokenizer.json (and as transformers' Qwen2Tokenizer rebuilds it).
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=_BPE_VOCAB_SIZE, show_progress=False, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    return tok


def _write_tokenizer(out: Path, tok, special_tokens: tuple[str, ...] = QWEN_SPECIAL_TOKENS,
                     chat_template: str = QWEN2_VL_CHAT_TEMPLATE, extra_config: Mapping[str, Any] | None = None) -> None:
    """tokenizer.json, tokenizer_config.json (keys sorted; `extra_config` entries added) and chat_template.jinja."""
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                  "single_word": False, "special": True}
        for t in special_tokens
    }
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for t in special_tokens if t not in ("<|endoftext|>", "<|im_end|>")],
        "bos_token": None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
        **(extra_config or {}),
    }
    _write_json(out / "tokenizer_config.json", dict(sorted(config.items())))
    (out / "chat_template.jinja").write_text(chat_template, encoding="utf-8")


# ----------------------------------------------------------------------------------------------
# config

def _qwen2_5_vl_config(o: dict, vocab_size: int, ids: dict[str, int]):
    from transformers import Qwen2_5_VLConfig

    hidden, heads, kv_heads = o["text_hidden_size"], o["num_heads"], o["num_kv_heads"]
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"text_hidden_size={hidden} must divide by num_heads={heads}, "
                         f"and num_heads by num_kv_heads={kv_heads}")
    half = hidden // heads // 2
    section = list(o["mrope_section"] or _default_mrope_section(half))
    if sum(section) != half:
        raise ValueError(f"mrope_section={section} must sum to head_dim/2 = {half}")
    if o["vision_hidden_size"] % o["vision_heads"]:
        raise ValueError(f"vision_hidden_size={o['vision_hidden_size']} must divide by vision_heads={o['vision_heads']}")
    bad = [i for i in o["fullatt_block_indexes"] if not 0 <= i < o["vision_depth"]]
    if bad:
        raise ValueError(f"fullatt_block_indexes {bad} outside vision_depth={o['vision_depth']}")

    eot, im_end = ids["<|endoftext|>"], ids["<|im_end|>"]
    text = dict(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=o["intermediate_size"],
        num_hidden_layers=o["num_layers"], num_attention_heads=heads, num_key_value_heads=kv_heads,
        hidden_act="silu", max_position_embeddings=o["max_position_embeddings"],
        rms_norm_eps=_FIXED["rms_norm_eps"], use_sliding_window=False,
        max_window_layers=o["num_layers"], attention_dropout=0.0,
        rope_parameters={"rope_type": "default", "rope_theta": _FIXED["rope_theta"], "mrope_section": section},
        bos_token_id=eot, eos_token_id=im_end, pad_token_id=eot,
    )
    vision = dict(
        depth=o["vision_depth"], hidden_size=o["vision_hidden_size"], hidden_act="silu",
        intermediate_size=o["vision_intermediate_size"], num_heads=o["vision_heads"], in_channels=3,
        patch_size=_FIXED["patch_size"], temporal_patch_size=_FIXED["temporal_patch_size"],
        spatial_merge_size=_FIXED["spatial_merge_size"], tokens_per_second=_FIXED["tokens_per_second"],
        window_size=o["window_size"], out_hidden_size=hidden,
        fullatt_block_indexes=list(o["fullatt_block_indexes"]),
    )
    return Qwen2_5_VLConfig(
        text_config=text, vision_config=vision,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=bool(o["tie_word_embeddings"]),
    )


def _default_mrope_section(half: int) -> list[int]:
    t = half // 4                      # Qwen2.5-VL: [16, 24, 24] of 64
    h = (half - t) // 2
    return [t, h, half - t - h]


def _flat_qwen2_5_vl_config(nested: dict, ids: dict[str, int]) -> dict:
    """The layout of the published Qwen2.5-VL config.json (written by transformers 4.4x)."""
    text = dict(nested["text_config"])
    rope = dict(text.pop("rope_parameters"))
    for key in ("model_type", "layer_types", "dtype", "sliding_window"):
        text.pop(key, None)
    vision = dict(nested["vision_config"])
    for key in ("model_type", "rope_parameters", "initializer_range", "in_channels", "dtype"):
        vision.pop(key, None)
    vision["in_chans"] = 3
    vision["spatial_patch_size"] = vision["patch_size"]
    flat = {
        "architectures": nested["architectures"],
        "model_type": "qwen2_5_vl",
        **text,
        "sliding_window": 32768,
        "rope_theta": rope["rope_theta"],
        "rope_scaling": {"type": "mrope", "mrope_section": list(rope["mrope_section"])},
        "tie_word_embeddings": nested["tie_word_embeddings"],
        "torch_dtype": nested.get("dtype", "float32"),
        "image_token_id": nested["image_token_id"],
        "video_token_id": nested["video_token_id"],
        "vision_start_token_id": nested["vision_start_token_id"],
        "vision_end_token_id": nested["vision_end_token_id"],
        "vision_token_id": ids["<|vision_pad|>"],
        "vision_config": vision,
        "transformers_version": "4.49.0",
    }
    return dict(sorted(flat.items()))


def _preprocessor_config(min_pixels: int, max_pixels: int, layout: str) -> dict:
    common = {
        "image_mean": _OPENAI_CLIP_MEAN,
        "image_std": _OPENAI_CLIP_STD,
        "image_processor_type": "Qwen2VLImageProcessor",
        "merge_size": _FIXED["spatial_merge_size"],
        "patch_size": _FIXED["patch_size"],
        "temporal_patch_size": _FIXED["temporal_patch_size"],
    }
    if layout == "flat":
        return {**common, "min_pixels": min_pixels, "max_pixels": max_pixels,
                "processor_class": "Qwen2_5_VLProcessor"}
    return {**common, "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
            "resample": 3, "rescale_factor": 1 / 255,
            "size": {"longest_edge": max_pixels, "shortest_edge": min_pixels}}


# ----------------------------------------------------------------------------------------------
# weights

def _save_model(config, out: Path, *, seed: int, init_std: float, dtype: torch.dtype, max_shard_size) -> None:
    from transformers import Qwen2_5_VLForConditionalGeneration

    with _no_hf_progress_bars():
        model = Qwen2_5_VLForConditionalGeneration(config)
        _redraw(model, seed, init_std)
        if config.tie_word_embeddings:
            # transformers 5 keeps two parameters here; equal values make the checkpoint truly tied
            with torch.no_grad():
                model.lm_head.weight.copy_(model.get_input_embeddings().weight)
        model.to(dtype)
        kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
        model.save_pretrained(out, **kwargs)


@torch.no_grad()
def _redraw(model: torch.nn.Module, seed: int, init_std: float) -> None:
    """Matrices (embeddings and the conv included) ~ N(0, init_std); norms = 1; biases ~ N(0, 0.02).

    transformers' own init (std 0.02) gives near-constant greedy tokens; 0.2 makes them vary.
    A private generator keeps the global RNG untouched; named_parameters' order is fixed.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():       # tied parameters appear once
        if p.ndim >= 2:
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * init_std)
        elif name.endswith("bias"):
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * 0.02)
        else:
            p.fill_(1.0)


@contextlib.contextmanager
def _no_hf_progress_bars():
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _round_up(n: int, multiple: int) -> int:
    return math.ceil(n / multiple) * multiple


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False, ensure_ascii=False) + "\n", encoding="utf-8")
