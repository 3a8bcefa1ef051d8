"""Shared pieces of the tiny test checkpoints every family builds (`models/<family>/tiny_checkpoint.py`):
a small byte-level BPE tokenizer with ChatML special tokens (the Qwen2 LLM's, which InternVL reuses),
its tokenizer files, the random redraw of a transformers model and its saving. Needs transformers /
tokenizers (test fixtures only: the engine never imports this module).
"""
from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

# In Qwen's order; they get the ids right after the trained BPE vocabulary.
# the language model every family's tiny checkpoint starts from (a family overrides what it must)
TEXT_DEFAULTS: Mapping[str, Any] = MappingProxyType(dict(
    text_hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=128,
    vocab_size=None,              # None: tokenizer size rounded up to a multiple of 64
))

QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)

# Added tokens that are not special (the published tokenizers mark them "special": false, so they stay
# in decoded text): the tool-call and reasoning tags of Qwen2.5's and Qwen3's templates, after the
# special tokens, for the families whose templates use them.
QWEN_TEXT_TOKENS = ("<tool_call>", "</tool_call>", "<think>", "</think>")

# Qwen2's pre-tokenizer split (the same regex transformers' Qwen2Tokenizer rebuilds on load).
_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_BPE_VOCAB_SIZE = 1000  # 256 byte tokens + 744 merges; the special tokens come after

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


def build_tokenizer(special_tokens: tuple[str, ...] = QWEN_SPECIAL_TOKENS, text_tokens: tuple[str, ...] = ()):
    """The byte-level BPE trained on `_CORPUS`, then `special_tokens` in order (ids from 1000 on), then
    `text_tokens` (not special; e.g. `QWEN_TEXT_TOKENS`)."""
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
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in text_tokens])
    return tok


def write_tokenizer(out: Path, tok, special_tokens: tuple[str, ...], chat_template: str,
                    extra_config: Mapping[str, Any] | None = None) -> None:
    """tokenizer.json, tokenizer_config.json (keys sorted; `extra_config` entries added) and chat_template.jinja."""
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                  "single_word": False, "special": True}
        for t in special_tokens
    }
    added.update({str(tok.token_to_id(t)): {**added[str(tok.token_to_id(special_tokens[0]))], "content": t,
                                            "special": False} for t in QWEN_TEXT_TOKENS if t in tok.get_vocab()})
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
    write_json(out / "tokenizer_config.json", dict(sorted(config.items())))
    (out / "chat_template.jinja").write_text(chat_template, encoding="utf-8")



@contextlib.contextmanager
def no_hf_progress_bars():
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def checkpoint_options(overrides: Mapping[str, Any], defaults: Mapping[str, Any],
                       caller: str = "make_tiny_checkpoint()", also: tuple[str, ...] = ()) -> dict[str, Any]:
    """`defaults` with `overrides` applied; an override `defaults` does not name raises TypeError naming
    the accepted ones (`also`: the maker's own keyword arguments, listed first)."""
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise TypeError(f"{caller} got unknown override(s) {', '.join(unknown)}; "
                        f"accepted: {', '.join([*also, *sorted(defaults)])}")
    return {**defaults, **overrides}


def floating_dtype(name: Any) -> "torch.dtype":
    """The torch floating dtype named `name` ("float32", "bfloat16", ...), else ValueError."""
    import torch
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype={name!r} is not a torch floating dtype name")
    return dtype


def vocab_size_for(tokenizer, vocab_size: int | None) -> int:
    """The checkpoint's vocabulary: `vocab_size`, or None for the tokenizer's size rounded up to a
    multiple of 64; ValueError when it is smaller than the tokenizer."""
    n_tokens = tokenizer.get_vocab_size()
    size = vocab_size or round_up(n_tokens, 64)
    if size < n_tokens:
        raise ValueError(f"vocab_size={size} is smaller than the tokenizer ({n_tokens} tokens)")
    return size


def round_up(n: int, multiple: int) -> int:
    return math.ceil(n / multiple) * multiple


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False, ensure_ascii=False) + "\n", encoding="utf-8")

def save_random_model(model_cls, config, out: Path, *, seed: int, init_std: float, dtype, max_shard_size,
                      norm_std: float | None, adjust=None) -> None:
    """Build transformers' `model_cls(config)`, `redraw` its weights and save it (tied heads saved equal).
    `adjust(model, generator)`: a family's own draws after the redraw (parameters whose range matters)."""
    import torch

    with no_hf_progress_bars():
        model = model_cls(config)
        redraw(model, seed, init_std, norm_std)
        if adjust is not None:
            with torch.no_grad():
                adjust(model, torch.Generator().manual_seed(seed + 1))
        if config.tie_word_embeddings:
            # transformers 5 keeps two parameters here; equal values make the checkpoint truly tied
            with torch.no_grad():
                model.lm_head.weight.copy_(model.get_input_embeddings().weight)
        model.to(dtype)
        kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
        model.save_pretrained(out, **kwargs)


def redraw(model, seed: int, init_std: float, norm_std: float | None) -> None:
    """Matrices (embeddings, convs, position grids) ~ N(0, init_std); biases ~ N(0, 0.02); other 1-D
    parameters (norm weights, layer scales) = 1 + N(0, norm_std), so that one loaded into the wrong place
    shows, or exactly 1 with `norm_std` None (no draw). transformers' own init (std 0.02) gives
    near-constant greedy tokens; 0.2 makes them vary. A private generator keeps the global RNG untouched;
    named_parameters' order is fixed, so a seed gives the same checkpoint every time."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied parameters appear once
            if p.ndim < 2 and not name.endswith("bias") and norm_std is None:
                p.fill_(1.0)
                continue
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if p.ndim >= 2:
                p.copy_(noise * init_std)
            elif name.endswith("bias"):
                p.copy_(noise * 0.02)
            else:
                p.copy_(1.0 + norm_std * noise)

