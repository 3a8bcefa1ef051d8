"""`vlm-sdk bench --multi-turn`: prefix caching and the encoder cache, on against off, in one run.

Two engines on the same checkpoint are loaded side by side: "on" (the defaults: enable_prefix_caching,
encoder_cache_memory 256 MiB) and "off" (enable_prefix_caching=False, encoder_cache_memory=0); on CUDA
each is sized for half of the device (`device_share.py`).

    multi-turn   `--rounds` conversations of `--turns` turns about one 448x448 image (a new image per
                 round, so no round reuses another's cache); each turn sends the whole history with the
                 real previous answers (`--answer-tokens` each, greedy, eos ignored) and a new question.
                 TTFT = building the prompt (image decode and preprocessing, the image's content hash)
                 + the engine's time to the first token, the request alone in its engine. The figure:
                 each turn's median TTFT over the rounds, summed over turns 2..T, on / off (target
                 <= 0.3); per-turn medians, because one busy moment of a shared machine spoils a whole
                 round's sum but only one sample of a turn's median.
    many users   `--users` requests at once, all with one system prompt and one 448x448 image, each with
                 its own question, `--user-tokens` tokens each: wall time from the first prompt built to
                 the last token, so throughput includes preprocessing; TTFT from each request's arrival.
                 The figure: output tokens/s on / off.

The modes take turns, moments apart (each turn of a conversation on one engine, then on the other;
many-users runs on first in even rounds, off first in odd ones), because this kind of machine's speed
drifts between minutes; both engines have a warm-up conversation on an image no timed request uses. Greedy
answers on and off are compared token for token (they must be equal: caching is exact).
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import time

import torch

from vlm_sdk.bench.device_share import bench_device, describe, shared_engine_args
from vlm_sdk.bench.engine import _images
from vlm_sdk.bench.flags import MultiTurnConfig
from vlm_sdk.errors import InvalidRequestError

__all__ = ["MODES", "MultiTurnConfig", "config_from_args", "reject_without_multi_turn",
           "run_multi_turn"]

MODES = {"on": {}, "off": {"enable_prefix_caching": False, "encoder_cache_memory": 0}}
TTFT_TARGET = 0.3  # issue 15: turns 2-4 at most 0.3x of their time without caching
QUESTIONS = ("What is in this image?", "What colours are the largest shapes?", "Is anything written on it?",
             "Where is the brightest part?", "How many objects can you count?", "Describe the background.",
             "What is in the top left corner?", "Does the picture look like a photograph or a drawing?")
SYSTEM_PROMPT = ("You are a careful visual assistant for a shop's catalogue team. Answer questions about the "
                 "product photograph the user sends: describe only what is visible, name colours and materials "
                 "plainly, say when something cannot be seen, keep each answer to one or two sentences, and "
                 "never guess prices, brands or sizes that are not shown in the picture itself.")



_OPTIONS = tuple(f.name for f in dataclasses.fields(MultiTurnConfig))



def reject_without_multi_turn(args) -> None:
    """Its options without --multi-turn would be silently ignored: refuse them."""
    given = [f"--{n.replace('_', '-')}" for n in _OPTIONS if getattr(args, n, None) is not None]
    if given:
        raise InvalidRequestError(f"{', '.join(given)} only apply with --multi-turn")


def config_from_args(args) -> MultiTurnConfig:
    if getattr(args, "gpu", False):
        raise InvalidRequestError("--multi-turn and --gpu are separate benchmarks: give one")
    if getattr(args, "tensor_parallel_size", 1) != 1:
        raise InvalidRequestError("--multi-turn runs one rank: drop --tensor-parallel-size")
    cfg = dataclasses.replace(MultiTurnConfig(), **{n: getattr(args, n) for n in _OPTIONS
                                                    if getattr(args, n, None) is not None})
    cfg.validate()
    return cfg


# ----------------------------------------------------------------------------------------------

def _params(max_tokens: int):
    from vlm_sdk import SamplingParams
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _ttft(out) -> float:
    """What a user waits: building the prompt, then the engine's time to the first token."""
    m = out.metrics
    return m.preprocess_time + m.time_to_first_token


def _conversations(engines: dict, image, cfg: MultiTurnConfig, round_index: int) -> dict[str, list[dict]]:
    """The same conversation with each engine, in lockstep: turn t on one engine, then on the other
    (which goes first alternates), so both samples of a turn are taken moments apart and a busy spell
    of a shared machine falls on both. Each answer joins its own history, as a client sends it."""
    history = {mode: [] for mode in engines}
    turns: dict[str, list[dict]] = {mode: [] for mode in engines}
    for t in range(cfg.turns):
        question = QUESTIONS[t % len(QUESTIONS)]
        content = [{"type": "image", "image": image}, {"type": "text", "text": question}] if t == 0 else question
        modes = list(engines) if (round_index + t) % 2 == 0 else list(engines)[::-1]
        for mode in modes:
            messages = history[mode]
            messages.append({"role": "user", "content": content})
            [out] = engines[mode].chat([messages], _params(cfg.answer_tokens))
            turns[mode].append({"ttft_s": _ttft(out), "preprocess_s": out.metrics.preprocess_time,
                                "prompt_tokens": len(out.prompt_token_ids), "cached_tokens": out.num_cached_tokens,
                                "tokens": list(out.token_ids)})
            messages.append({"role": "assistant", "content": out.text})
    return turns


def _many_users(llm, image, cfg: MultiTurnConfig) -> dict:
    convs = [[{"role": "system", "content": SYSTEM_PROMPT},
              {"role": "user", "content": [{"type": "image", "image": image},
                                           {"type": "text", "text": f"{QUESTIONS[i % len(QUESTIONS)]} ({i})"}]}]
             for i in range(cfg.users)]
    t0 = time.perf_counter()
    outs = llm.chat(convs, _params(cfg.user_tokens))
    seconds = time.perf_counter() - t0
    ttfts = sorted(o.metrics.time_to_first_token for o in outs)
    generated = sum(len(o.token_ids) for o in outs)
    return {"seconds": seconds, "tokens_per_s": generated / seconds, "requests_per_s": len(outs) / seconds,
            "ttft_p50_s": statistics.median(ttfts), "ttft_max_s": ttfts[-1],
            "preprocess_s": sum(o.metrics.preprocess_time for o in outs),
            "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
            "cached_tokens": sum(o.num_cached_tokens for o in outs), "tokens": [list(o.token_ids) for o in outs]}


def _orders(rounds: int) -> list[tuple[int, tuple[str, ...]]]:
    return [(r, ("on", "off") if r % 2 == 0 else ("off", "on")) for r in range(rounds)]


def run(model_dir: str, device: str, cfg: MultiTurnConfig) -> dict:
    from vlm_sdk import LLM
    side = (cfg.image_size, cfg.image_size)
    shares = shared_engine_args(device, len(MODES))  # both engines stay loaded: each takes its share
    engines = {mode: LLM(model_dir, device=device, show_progress=False, **kw, **share)
               for (mode, kw), share in zip(MODES.items(), shares)}
    try:
        # warm-up on an image no timed request uses
        _conversations(engines, _images([side], seed=1000)[0], dataclasses.replace(cfg, turns=2, answer_tokens=2), 0)
        convs: dict[str, list] = {"on": [], "off": []}
        for r in range(cfg.rounds):
            for mode, turns in _conversations(engines, _images([side], seed=r)[0], cfg, r).items():
                convs[mode].append(turns)
        users: dict[str, list] = {"on": [], "off": []}
        for r, order in _orders(cfg.user_rounds):
            image = _images([side], seed=500 + r)[0]
            for mode in order:
                users[mode].append(_many_users(engines[mode], image, cfg))
        stats = {mode: llm.stats() for mode, llm in engines.items()}
    finally:
        for llm in engines.values():
            llm.shutdown()
    return {"multi_turn": _multi_turn_summary(convs, cfg), "many_users": _users_summary(users), "stats": stats,
            "device_share": describe(device, shares, list(MODES))}


def _multi_turn_summary(convs: dict[str, list], cfg: MultiTurnConfig) -> dict:
    later = range(1, cfg.turns)  # turns 2..T
    ratios = [sum(on[t]["ttft_s"] for t in later) / sum(off[t]["ttft_s"] for t in later)
              for on, off in zip(convs["on"], convs["off"])]
    per_turn = []
    for t in range(cfg.turns):
        on = statistics.median(c[t]["ttft_s"] for c in convs["on"])
        off = statistics.median(c[t]["ttft_s"] for c in convs["off"])
        per_turn.append({"turn": t + 1, "prompt_tokens": convs["on"][0][t]["prompt_tokens"],
                         "cached_tokens_on": statistics.median(c[t]["cached_tokens"] for c in convs["on"]),
                         "ttft_on_s": on, "ttft_off_s": off, "ratio": on / off})
    same = sum(a["tokens"] == b["tokens"] for on, off in zip(convs["on"], convs["off"]) for a, b in zip(on, off))
    strip = {m: [[{k: v for k, v in t.items() if k != "tokens"} for t in c] for c in cs] for m, cs in convs.items()}
    ratio = sum(per_turn[t]["ttft_on_s"] for t in later) / sum(per_turn[t]["ttft_off_s"] for t in later)
    return {"ratio_later_turns": ratio, "ratio_per_round": ratios, "target": TTFT_TARGET,
            "per_turn": per_turn, "identical_answers": same, "answers": cfg.rounds * cfg.turns, "rounds": strip}


def _users_summary(users: dict[str, list]) -> dict:
    def total(mode, key):
        return sum(r[key] for r in users[mode])
    summary = {}
    for mode in ("on", "off"):
        runs = users[mode]
        seconds = total(mode, "seconds")
        summary[mode] = {"seconds": seconds, "tokens_per_s": sum(len(t) for r in runs for t in r["tokens"]) / seconds,
                         "requests_per_s": sum(len(r["tokens"]) for r in runs) / seconds,
                         "ttft_p50_s": statistics.median(r["ttft_p50_s"] for r in runs),
                         "ttft_max_s": max(r["ttft_max_s"] for r in runs), "preprocess_s": total(mode, "preprocess_s"),
                         "prompt_tokens": total(mode, "prompt_tokens"), "cached_tokens": total(mode, "cached_tokens")}
    same = sum(a == b for on, off in zip(users["on"], users["off"]) for a, b in zip(on["tokens"], off["tokens"]))
    return {**summary, "throughput_ratio": summary["on"]["tokens_per_s"] / summary["off"]["tokens_per_s"],
            "ttft_p50_ratio": summary["on"]["ttft_p50_s"] / summary["off"]["ttft_p50_s"],
            "identical_outputs": same, "outputs": sum(len(r["tokens"]) for r in users["on"])}


def run_multi_turn(args) -> int:
    from vlm_sdk.demo_checkpoint import tiny_model_dir
    from vlm_sdk.model_loader import read_checkpoint
    from vlm_sdk.models.registry import resolve

    cfg = config_from_args(args)
    model_dir = args.model or str(tiny_model_dir("bench", args.family))
    family = resolve([read_checkpoint(model_dir).architecture]).name
    device = bench_device(args.device)
    report = {"benchmark": "vlm-sdk bench --multi-turn", "model": model_dir, "family": family, "device": device,
              "torch_threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "config": dataclasses.asdict(cfg), "modes": MODES}
    t0 = time.perf_counter()
    report.update(run(model_dir, device, cfg))
    report["wall_s"] = time.perf_counter() - t0
    print(json.dumps(report, indent=2, default=str) if args.json else format_report(report))
    return 0


def format_report(r: dict) -> str:
    cfg, mt, mu = r["config"], r["multi_turn"], r["many_users"]
    side = f"{cfg['image_size']}x{cfg['image_size']}"
    lines = [f"model {r['model']} ({r['family']}) on {r['device']}, {r['torch_threads']} threads; caching on: the "
             f"defaults (prefix caching, encoder cache); off: enable_prefix_caching=False, encoder_cache_memory=0",
             r["device_share"],
             f"multi-turn: {cfg['rounds']} conversation(s) per mode of {cfg['turns']} turns about one {side} image, "
             f"answers of {cfg['answer_tokens']} tokens kept in the history; TTFT = prompt building + first token "
             f"(median over conversations)",
             f"  {'turn':>4}  {'prompt tokens':>13}  {'cached (on)':>11}  {'TTFT on':>10}  {'TTFT off':>10}  on/off"]
    for t in mt["per_turn"]:
        lines.append(f"  {t['turn']:>4}  {t['prompt_tokens']:>13,}  {t['cached_tokens_on']:>11,.0f}  "
                     f"{t['ttft_on_s'] * 1000:>7.1f} ms  {t['ttft_off_s'] * 1000:>7.1f} ms  {t['ratio']:.2f}x")
    per_round = ", ".join(f"{x:.2f}" for x in mt["ratio_per_round"])
    lines.append(f"  TTFT of turns 2-{cfg['turns']} (their medians summed), on/off: {mt['ratio_later_turns']:.2f}x "
                 f"(target <= {mt['target']}x; each conversation's own: {per_round}); identical answers on and off: "
                 f"{mt['identical_answers']}/{mt['answers']}")
    lines.append(f"many users: {cfg['users']} requests at once sharing one system prompt and one {side} image, "
                 f"different questions, {cfg['user_tokens']} tokens each ({cfg['user_rounds']} run(s) per mode)")
    for mode in ("on", "off"):
        m = mu[mode]
        lines.append(f"  {mode:<3} {m['seconds']:7.2f} s  {m['tokens_per_s']:8.1f} tokens/s  "
                     f"{m['requests_per_s']:6.2f} requests/s  TTFT p50 {m['ttft_p50_s'] * 1000:7.0f} ms, max {m['ttft_max_s'] * 1000:7.0f} ms  "
                     f"cached {m['cached_tokens']:,}/{m['prompt_tokens']:,} prompt tokens")
    lines.append(f"  throughput on/off: {mu['throughput_ratio']:.2f}x; TTFT p50 on/off: {mu['ttft_p50_ratio']:.2f}x; "
                 f"identical outputs: {mu['identical_outputs']}/{mu['outputs']}")
    s = r["stats"]["on"]
    lines.append(f"  engine 'on' since start: prefix cache {s.get('prefix_cache_hit_tokens', 0):,}/"
                 f"{s.get('prefix_cache_query_tokens', 0):,} tokens hit, encoder cache "
                 f"{s.get('encoder_cache_hits', 0)}/{s.get('encoder_cache_queries', 0)} images hit; KV blocks in use after: {s['kv_blocks_used']}")
    lines.append(f"whole benchmark (both engines loaded, warm-ups included): {r['wall_s']:.0f} s")
    return "\n".join(lines)
