"""Sampler and incremental detokenizer, without a model."""
import pytest
import torch

from vlm_sdk.engine.output.detokenizer import IncrementalDetokenizer
from vlm_sdk.sample.sampler import Sampler
from vlm_sdk.errors import InvalidRequestError
from vlm_sdk.sampling_params import SamplingParams


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 0.0]])
    assert Sampler()(logits, [SamplingParams(temperature=0)] * 2) == [1, 0]


def test_top_k_1_and_tiny_top_p_are_greedy():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    best = logits.argmax(-1).tolist()
    s = Sampler(1)
    assert s(logits, [SamplingParams(temperature=1.0, top_k=1)] * 4) == best
    assert s(logits, [SamplingParams(temperature=1.0, top_p=1e-6)] * 4) == best


def test_top_k_never_leaves_the_top():
    logits = torch.arange(20, dtype=torch.float32)[None].repeat(64, 1)
    params = [SamplingParams(temperature=5.0, top_k=3)] * 64
    tokens = Sampler(0)(logits, params)
    assert set(tokens) <= {17, 18, 19} and len(set(tokens)) > 1


def test_sampling_matches_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log()[None].repeat(4000, 1)
    tokens = torch.tensor(Sampler(3)(logits, [SamplingParams(temperature=1.0)] * 4000))
    freq = torch.bincount(tokens, minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def test_seeded_rows_do_not_depend_on_batch_company():
    torch.manual_seed(0)
    logits = torch.randn(3, 100)
    p = SamplingParams(temperature=1.0, seed=42)

    def run(rows, params):
        sampler = Sampler(7)
        # five successive tokens of each request: draw i of a seeded row is its i-th output token
        return [sampler(logits[rows], params, [([0, 1] + [2] * i, 2, ())] * len(rows)) for i in range(5)]

    alone = [r[0] for r in run([1], [p])]
    crowd = [r[1] for r in run([0, 1, 2], [SamplingParams(temperature=1.0), p, SamplingParams(temperature=0.7)])]
    assert alone == crowd and len(set(alone)) > 1  # the draws differ from token to token


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-5),
                                 dict(stop=[""]), dict(seed="x"), dict(temperature="0.5"), dict(top_p=None),
                                 dict(stop_token_ids=["a"]), dict(stop=5), dict(temperature=float("inf")),
                                 dict(max_tokens=True), dict(ignore_eos="yes")])
def test_bad_sampling_params_are_typed_errors(bad):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**bad)


class _DecodeOnly:
    """A tokenizer without a tokenizers backend: the detokenizer's window path."""

    def __init__(self, tok):
        self.decode = tok.decode


def _detok(tok, path):
    detok = IncrementalDetokenizer(tok if path == "stream" else _DecodeOnly(tok))
    assert (detok._stream is not None) == (path == "stream")  # DecodeStream when the backend allows
    return detok


@pytest.mark.parametrize("path", ["stream", "window"])
def test_detokenizer_never_splits_utf8(tiny_ckpt, path):
    from vlm_sdk.model_loader import load_tokenizer
    tok = load_tokenizer(tiny_ckpt)
    text = "héllo 🦙 wörld — 你好 ✓ done"
    ids = tok.encode(text, add_special_tokens=False)
    detok = _detok(tok, path)
    deltas = [detok.add(t) for t in ids]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == text
    assert sum(1 for d in deltas if d == "") > 0  # multi-byte characters were held back at least once


@pytest.mark.parametrize("path", ["stream", "window"])
def test_detokenizer_on_arbitrary_ids_matches_decode(tiny_ckpt, path):
    from vlm_sdk.model_loader import load_tokenizer
    tok = load_tokenizer(tiny_ckpt)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, len(tok), (300,), generator=g).tolist()
    detok = _detok(tok, path)
    joined = "".join(detok.add(t) for t in ids) + detok.flush()
    assert joined == tok.decode(ids, skip_special_tokens=True)


def test_detokenizer_falls_back_to_the_window_when_the_stream_refuses(tiny_ckpt):
    from vlm_sdk.model_loader import load_tokenizer
    tok = load_tokenizer(tiny_ckpt)
    text = "héllo 🦙 wörld — 你好 ✓ done"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    first = "".join(detok.add(t) for t in ids[:7])

    class Refusing:
        def step(self, *_):
            raise RuntimeError("Invalid prefix encountered")
    detok._stream = Refusing()
    rest = "".join(detok.add(t) for t in ids[7:]) + detok.flush()
    assert detok._stream is None and first + rest == text


def test_tiny_temperature_is_greedy_not_nan():
    torch.manual_seed(1)
    logits = torch.randn(3, 40)
    tokens = Sampler(0)(logits, [SamplingParams(temperature=1e-40)] * 3)
    assert tokens == logits.argmax(-1).tolist()
