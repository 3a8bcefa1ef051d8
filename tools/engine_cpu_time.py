"""Our engine on `vlm-sdk bench`'s workload (16 requests, 448x448 images, 16-128 greedy tokens), timed in
process CPU seconds with one torch thread: on a machine shared with other work, CPU time moves far less than
wall time. Run with PYTHONPATH at the checkout to measure (tools/engine_cpu_ab.sh alternates two); prints one JSON line."""
import json
import os
import sys
import time

import torch

torch.set_num_threads(1)
from vlm_sdk import LLM, SamplingParams  # noqa: E402
from vlm_sdk.bench.engine import _workload  # noqa: E402

model_dir = sys.argv[1]
_, convs, max_tokens = _workload(16, [(448, 448)])
llm = LLM(model_dir, device="cpu", show_progress=False)
params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
llm.chat(convs[:2], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
c0, t0 = time.process_time(), time.perf_counter()
outs = llm.chat(convs, params)
cpu, wall = time.process_time() - c0, time.perf_counter() - t0
print(json.dumps({"checkout": os.environ.get("PYTHONPATH"), "cpu_s": cpu, "wall_s": wall,
                  "tokens": sum(len(o.token_ids) for o in outs), "first": outs[0].token_ids[:8]}))
