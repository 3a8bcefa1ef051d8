"""A tiny checkpoint whose greedy output is known: each script (a list of text pieces) is written piece
by piece once a logit_bias picks its first piece, then <|im_end|>. For server tests of what the parsers
make of given model text (issue 50 points 5-7) through the whole path: the real model, engine, sampler,
detokenizer, parsers and HTTP server, with weights chosen rather than random.

How: every piece is a token of its own (added to the tokenizer, not special, so it decodes to its text),
with a one-hot embedding on a dimension of its own. The decoder layers' output projections are zeroed,
so the last hidden state is the token's embedding; the LM head maps piece i's dimension to piece i + 1
(the last piece's to <|im_end|>), and no other token's embedding or LM-head row touches those
dimensions. The first piece comes from the request's logit_bias (+100 against logits near 0); after it
the successor's logit (LM_SCALE x the normalised one-hot, 400) outweighs that bias."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Tokenizer

LM_SCALE = 50.0


def scripted_checkpoint(src: Path, dst: Path, scripts: list[list[str]]) -> list[int]:
    """Copy `src` (a tiny Qwen2.5-VL) to `dst` with `scripts` written in; returns each script's first
    token id (give it logit_bias +100 to run that script)."""
    shutil.copytree(src, dst)
    pieces = [p for script in scripts for p in script]
    assert len(set(pieces)) == len(pieces), "each piece must be a token of its own"
    tok = Tokenizer.from_file(str(dst / "tokenizer.json"))
    tok.add_tokens([AddedToken(p, special=False, normalized=False) for p in pieces])
    tok.save(str(dst / "tokenizer.json"))
    ids = {p: tok.token_to_id(p) for p in pieces}
    # transformers' Qwen2Tokenizer rebuilds its added tokens from tokenizer_config.json's table
    tok_config = json.loads((dst / "tokenizer_config.json").read_text())
    table = tok_config.setdefault("added_tokens_decoder", {})
    for p, i in ids.items():
        if str(i) not in table and i >= tok.get_vocab_size(with_added_tokens=False):
            table[str(i)] = {"content": p, "special": False, "normalized": False, "lstrip": False, "rstrip": False,
                             "single_word": False}
    (dst / "tokenizer_config.json").write_text(json.dumps(tok_config))
    end = tok.token_to_id("<|im_end|>")
    config = json.loads((dst / "config.json").read_text())
    vocab, hidden = config["text_config"]["vocab_size"], config["text_config"]["hidden_size"]
    assert max(ids.values()) < vocab and len(pieces) <= hidden // 2, "room in the vocabulary and the hidden size"
    weights = load_file(str(dst / "model.safetensors"))
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]  # [vocab, hidden] each
    k = len(pieces)
    embed[:, :k] = 0
    head[:, :k] = 0
    weights["model.norm.weight"][:k] = 1.0
    for script in scripts:
        for i, piece in enumerate(script):
            d = pieces.index(piece)
            embed[ids[piece]] = 0
            embed[ids[piece], d] = 1.0
            head[ids[script[i + 1]] if i + 1 < len(script) else end, d] = LM_SCALE
    for name in weights:
        if name.startswith("model.layers.") and name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return [ids[s[0]] for s in scripts]
