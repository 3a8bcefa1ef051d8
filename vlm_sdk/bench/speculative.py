"""`vlm-sdk bench --speculative METHOD`: decoding with speculative drafts against without, in one run.

Two engines on one checkpoint and device, the same greedy workload, run in turns (which goes first
alternates, so a busy spell of a shared machine falls on both):

    plain        `--spec-requests` requests at once, `--spec-max-tokens` tokens each (eos ignored)
    speculative  the same with speculative_config {"method": METHOD, "num_speculative_tokens": --spec-tokens}

Printed: tokens/s of each (median over `--spec-rounds` rounds), their ratio, the drafts' acceptance rate and
mean accepted length (tokens per verification: accepted drafts + the one every verification yields) and
the time spent drafting. Greedy outputs of both engines are compared token for token (they must agree).

A workload where drafts can be right: a trained model often repeats its context (summaries, code edits,
quotes), which is where n-gram drafts pay. Random weights do not, so without `--model` the checkpoint is
the bench shape (~100M parameters, vocab 151,936) drawn with weights of std 0.02 (transformers' own init)
instead of 0.2, whose greedy output falls into repeating one token: the best case of a model that copies
(acceptance near 1), stated as such in the report; give --model for a workload of your own.
"""
from __future__ import annotations

import json
import statistics
import time

import torch

from vlm_sdk.errors import InvalidRequestError

PROMPT = ("Repeat the following list exactly, then continue it: alpha beta gamma delta, alpha beta gamma delta, "
          "alpha beta gamma delta, alpha beta gamma delta.")
REPEATING_STD = 0.02
EAGLE_DRAFT_VOCAB = 32000  # the published EAGLE-3 drafts' draft_vocab_size


def reject_without_speculative(args) -> None:
    given = [f"--{n.replace('_', '-')}" for n in ("spec_tokens", "spec_requests", "spec_max_tokens", "spec_rounds",
                                                               "spec_draft")
             if getattr(args, n, None) is not None]
    if given:
        raise InvalidRequestError(f"{', '.join(given)} only apply with --speculative METHOD")


def repeating_checkpoint(family: str):
    """The bench shape with small weights (its greedy output repeats itself), made once."""
    import os
    from vlm_sdk.demo_checkpoint import cache_dir
    from vlm_sdk.testing import make_bench_checkpoint
    path = cache_dir() / f"bench-repeating-{REPEATING_STD}-{family}"
    if not (path / "config.json").exists():
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        make_bench_checkpoint(tmp, family=family, init_std=REPEATING_STD)
        tmp.rename(path)
    return path


def eagle3_pair(family: str):
    """(target, draft) for `--speculative eagle3` without --model, made once: the bench shape made token-local
    and a draft that agrees with it (vlm_sdk/testing/eagle3.py: the target's last layer's MLP and norms, its
    head's first 32,000 rows as the draft vocabulary, the target's head kept to them): the best case of a
    trained draft (acceptance near 1), stated as such in the report."""
    import os
    from vlm_sdk.demo_checkpoint import cache_dir
    from vlm_sdk.testing import make_bench_checkpoint
    from vlm_sdk.testing.eagle3 import make_token_local, write_eagle3_draft
    path = cache_dir() / f"bench-eagle3-{family}"
    if not (path / "draft" / "config.json").exists():
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        make_bench_checkpoint(tmp / "target", family=family)
        make_token_local(tmp / "target", keep_vocab=EAGLE_DRAFT_VOCAB)
        write_eagle3_draft(tmp / "target", tmp / "draft", draft_vocab_size=EAGLE_DRAFT_VOCAB)
        tmp.rename(path)
    return path / "target", path / "draft"


def run_speculative(args) -> int:
    from vlm_sdk import LLM, SamplingParams
    from vlm_sdk.bench.device_share import bench_device, describe, shared_engine_args
    from vlm_sdk.spec_config import parse_speculative_config
    k = args.spec_tokens or 4
    n = args.spec_requests or 4
    tokens = args.spec_max_tokens or 64
    rounds = args.spec_rounds or 3
    if min(k, n, tokens, rounds) < 1:
        raise InvalidRequestError("--spec-tokens, --spec-requests, --spec-max-tokens and --spec-rounds must be >= 1")
    spec = {"method": args.speculative, "num_speculative_tokens": k}
    if args.speculative == "ngram":
        spec |= {"prompt_lookup_min": 1, "prompt_lookup_max": 4}
    weights = "given" if args.model else f"random, std {REPEATING_STD} (repeats one token: the best case)"
    if args.speculative == "eagle3":
        if args.model and not args.spec_draft:
            raise InvalidRequestError("--speculative eagle3 with --model needs --spec-draft DIR (its EAGLE-3 draft "
                                      "checkpoint); without --model the bench builds an agreeing pair")
        model_dir, draft = (args.model, args.spec_draft) if args.model else eagle3_pair(args.family)
        spec["model"] = str(draft)
        if not args.model:
            weights = ("random bench shape made token-local, with a draft built to agree with it (its last "
                       "layer's MLP and norms, head rows 0..31,999): the best case of a trained draft")
    elif args.spec_draft:
        raise InvalidRequestError(f"--spec-draft is an EAGLE-3 draft: it applies to --speculative eagle3, "
                                  f"not {args.speculative}")
    else:
        model_dir = args.model or repeating_checkpoint(args.family)
    model_dir = str(model_dir)
    parse_speculative_config(spec)  # a method not built is refused here, before any engine loads
    device = bench_device(args.device)
    shares = shared_engine_args(device, 2)
    common = dict(device=device, max_num_seqs=max(n, 8), show_progress=False)
    engines = {"plain": LLM(model_dir, **common, **shares[0]),
               "speculative": LLM(model_dir, **common, **shares[1], speculative_config=spec)}
    convs = [[{"role": "user", "content": f"{PROMPT} ({i})"}] for i in range(n)]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for llm in engines.values():
        llm.chat(convs[:1], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    times: dict[str, list[float]] = {m: [] for m in engines}
    outputs = {}
    before = engines["speculative"].stats()
    for r in range(rounds):
        for mode in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            t0 = time.perf_counter()
            outs = engines[mode].chat(convs, params)
            times[mode].append(time.perf_counter() - t0)
            outputs[mode] = [o.token_ids for o in outs]
    s = engines["speculative"].stats()
    drafts = s["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = s["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    verifications = s["spec_verify_steps"] - before["spec_verify_steps"]
    tps = {m: n * tokens / statistics.median(v) for m, v in times.items()}
    report = {"model": model_dir, "weights": weights,
              "device": device, "sharing": describe(device, shares, list(engines)), "method": args.speculative,
              "num_speculative_tokens": k, "requests": n, "tokens_per_request": tokens, "rounds": rounds,
              "seconds": times, "tokens_per_second": tps, "speedup": tps["speculative"] / tps["plain"],
              "draft_tokens": drafts, "accepted_tokens": accepted,
              "acceptance_rate": accepted / drafts if drafts else 0.0,
              "mean_accepted_length": 1 + accepted / verifications if verifications else 0.0,
              "draft_seconds": s["spec_draft_seconds"] - before["spec_draft_seconds"],
              "outputs_equal": outputs["plain"] == outputs["speculative"], "torch_threads": torch.get_num_threads()}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{n} requests x {tokens} tokens (greedy), {rounds} rounds each, {device}; weights {report['weights']}")
        print(f"  {report['sharing']}")
        print(f"  plain:       {tps['plain']:8.1f} tokens/s")
        print(f"  speculative: {tps['speculative']:8.1f} tokens/s  ({args.speculative}, k={k}): "
              f"{report['speedup']:.2f}x plain")
        print(f"  mean accepted length {report['mean_accepted_length']:.2f} tokens per verification, acceptance "
              f"rate {report['acceptance_rate']:.2f} ({accepted} of {drafts} drafts), drafting "
              f"{report['draft_seconds'] * 1000:.1f} ms")
        print(f"  greedy outputs equal: {report['outputs_equal']}")
    for llm in engines.values():
        llm.shutdown()
    return 0 if report["outputs_equal"] else 1
