"""vLLM's flag names on `vlm-sdk serve` and `vlm-sdk chat`: a command pasted from vLLM runs here where
the meaning is the same, and says what to do where it is not. `VLLM_NAMES` is the one list (the README's
table "vLLM's flag names" is checked against it by tests/e2e/test_cli_flags.py):

    alias      the same setting under vLLM's name (an option string of our flag)
    converted  the same setting, its value written vLLM's way (translated by `apply_vllm_names`)
    no effect  accepted, with a note saying why it changes nothing here
    refused    not accepted; the error says what to use instead (`hint_for`)

vLLM's names that are ours too (`--max-model-len`, `--max-num-seqs`, `--dtype`, `--kv-cache-dtype`,
`--enforce-eager`, `--tensor-parallel-size`, `--served-model-name`, `--api-key`, `--port`, ...) need no
row. One difference of default is not a flag: vLLM listens on every interface, `vlm-sdk serve` on
127.0.0.1 unless `--host 0.0.0.0`.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class VllmName:
    flag: str  # vLLM's spelling
    ours: str  # what it is here
    kind: str  # "alias", "converted", "no effect" or "refused"
    note: str = ""
    commands: tuple[str, ...] = ("serve", "chat")


VLLM_NAMES = (
    VllmName("--gpu-memory-utilization", "--memory-utilization", "alias",
             "the share of the GPU's total memory, as vLLM's", ("serve", "chat", "plan")),
    VllmName("-tp", "--tensor-parallel-size (also --tp)", "alias", "", ("serve", "chat", "plan")),
    VllmName("-pp", "--pipeline-parallel-size (also --pp)", "alias", "", ("serve", "chat", "plan")),
    VllmName("--num-gpu-blocks-override", "--num-blocks", "alias", "", ("serve", "chat", "plan")),
    VllmName("--kv-cache-memory-bytes", "--kv-cache-memory", "converted",
             "a bare number is bytes, as in vLLM; a size with a unit (8GiB) works too", ("serve", "chat", "plan")),
    VllmName("--mm-processor-kwargs", "the family's settings (the flags of `--help images`)", "converted",
             "a JSON object of the family's settings (the names of `--help images`, underscores for dashes); "
             "checked by the checkpoint's family at start-up"),
    VllmName("--limit-mm-per-prompt", "--limit-images / --limit-videos", "converted",
             "'image=2,video=1' or JSON '{\"image\": 2, \"video\": 1}'", ("serve",)),
    VllmName("--model", "MODEL (the positional argument)", "alias", "", ("serve",)),
    VllmName("-dp", "--data-parallel-size (replicas on Ray Serve)", "alias", "", ("serve",)),
    VllmName("--trust-remote-code", "nothing", "no effect",
             "no checkpoint's code is ever run: every family is built in, remote-code layouts too"),
    VllmName("--enable-auto-tool-choice", "nothing", "no effect",
             "tool_choice 'auto' is on whenever the chat template renders tools; --tool-call-parser names the "
             "format", ("serve",)),
    VllmName("--chat-template", "none", "refused",
             "the checkpoint's own chat template is used (a request's chat_template is refused too)"),
    VllmName("--quantization", "none", "refused",
             "the format is read from config.json's quantization_config: nothing to set"),
    VllmName("-q", "none", "refused", "the format is read from config.json's quantization_config: nothing to set"),
)
# EngineArgs field -> vLLM's spellings added to its flag (engine_flags.add_engine_flags)
ENGINE_ALIASES = {"memory_utilization": ("--gpu-memory-utilization",), "num_blocks": ("--num-gpu-blocks-override",),
                  "tensor_parallel_size": ("--tp", "-tp"), "pipeline_parallel_size": ("--pp", "-pp")}


def add_vllm_names(parser: argparse.ArgumentParser, command: str) -> None:
    """The converted and no-effect names of `command`, in a group of their own."""
    group = parser.add_argument_group("vLLM's flag names (README: vLLM's flag names)")
    names = {n.flag: n for n in VLLM_NAMES if command in n.commands}
    if "--kv-cache-memory-bytes" in names:
        group.add_argument("--kv-cache-memory-bytes", dest="engine_kv_cache_memory", type=_bytes, default=None,
                           metavar="BYTES", help="vLLM's name of --kv-cache-memory: a bare number is bytes "
                           "(default: not set)")
    if "--mm-processor-kwargs" in names:
        group.add_argument("--mm-processor-kwargs", dest="vllm_mm_processor_kwargs", type=_json_object, default=None,
                           metavar="JSON", help=f"vLLM's: {names['--mm-processor-kwargs'].note} (default: none)")
    if "--limit-mm-per-prompt" in names:
        group.add_argument("--limit-mm-per-prompt", dest="vllm_limit_mm_per_prompt", type=_limits, default=None,
                           metavar="LIMITS", help=f"vLLM's: {names['--limit-mm-per-prompt'].note}; sets "
                           "--limit-images / --limit-videos (default: theirs)")
    for name in names.values():
        if name.kind == "no effect":
            group.add_argument(name.flag, dest="vllm_" + name.flag.lstrip("-").replace("-", "_"), action="store_true",
                               help=f"accepted from vLLM, no effect: {name.note} (default off)")


def apply_vllm_names(args: argparse.Namespace) -> None:
    """Translate the converted names into ours (in `args`) and say what the no-effect ones do not do."""
    kwargs = getattr(args, "vllm_mm_processor_kwargs", None)
    if kwargs:  # a setting also given by its own flag must agree (EngineArgs.from_kwargs says so)
        args.engine_mm_processor_kwargs = dict(kwargs)
    limits = getattr(args, "vllm_limit_mm_per_prompt", None)
    if limits:
        for kind, value in limits.items():
            setattr(args, f"limit_{kind}s", value)
    for name in VLLM_NAMES:
        if name.kind == "no effect" and getattr(args, "vllm_" + name.flag.lstrip("-").replace("-", "_"), False):
            print(f"[vlm-sdk] note: {name.flag} has no effect here: {name.note}", file=sys.stderr)


def hint_for(flag: str, command: str) -> str | None:
    """What to do instead of vLLM's `flag` on `command`, when it is one of the refused names."""
    for name in VLLM_NAMES:
        if name.flag == flag and (name.kind == "refused" or command not in name.commands):
            return f"{flag} is vLLM's; {name.note}" if name.kind == "refused" else \
                f"{flag} is vLLM's, for `vlm-sdk {'/'.join(name.commands)}`: {name.note or name.ours}"
    return None


def _bytes(text: str) -> str:
    """vLLM's byte count ("8589934592"), or a size with a unit; a string EngineArgs parses."""
    text = text.strip()
    return f"{text}B" if text.isdigit() else text


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg}); write a JSON object, e.g. '{{\"name\": 1}}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object of setting -> value, got {text!r}")
    return value


def _limits(text: str) -> dict[str, int]:
    """'image=2,video=1' or '{"image": 2, "video": 1}' -> {"image": 2, "video": 1}."""
    text = text.strip()
    if text.startswith("{"):
        items = _json_object(text).items()
    else:
        items = [part.split("=", 1) if "=" in part else (part, None) for part in text.split(",") if part.strip()]
    out: dict[str, int] = {}
    for kind, value in items:
        kind = str(kind).strip().lower()
        if kind not in ("image", "video"):
            raise argparse.ArgumentTypeError(f"{kind!r}: this server takes 'image' and 'video' limits")
        try:
            count = int(value)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"{kind}={value!r} is not a count; write e.g. image=2,video=1") from None
        if count < 0:
            raise argparse.ArgumentTypeError(f"{kind}={count} must be 0 or more")
        out[kind] = count
    return out
