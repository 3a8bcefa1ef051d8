"""`import vlm_sdk.plan` (what `vlm-sdk plan` loads before it reads config.json) loads the memory
package's pipeline and what it reads (models, layers, protocol, config), never the engine, the
executor, a worker or the sampler: the planner needs only the model's split check
(models/parallel_split.py), which sits below all of them. The import-linter contract
"planner-reads-memory" holds the imports; this holds what one import actually loads."""
from __future__ import annotations

import json
import subprocess
import sys

# vlm_sdk's subpackages and modules the planner may load; the rest of vlm_sdk must stay unloaded
ALLOWED = {"plan", "memory", "models", "layers", "attention", "kernels", "protocol", "multimodal", "config",
           "sampling_params", "model_loader", "weight_loading", "spec_config", "errors"}
NEVER = {"engine", "executor", "worker", "sample", "server", "replicas", "testing", "bench", "llm", "async_llm",
         "cli", "client", "demo_checkpoint"}


def _loaded_by(statement: str) -> list[str]:
    code = (f"import sys, json; {statement}; "
            "print(json.dumps(sorted(m for m in sys.modules if m == 'vlm_sdk' or m.startswith('vlm_sdk.'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_import_plan_loads_no_executor_worker_or_engine_module():
    loaded = _loaded_by("import vlm_sdk.plan, vlm_sdk.plan.report")
    assert "vlm_sdk.plan.planner" in loaded and "vlm_sdk.memory.kv" in loaded and "vlm_sdk.models.parallel_split" in loaded
    parts = {m.split(".")[1] for m in loaded if m != "vlm_sdk"}
    assert not parts & NEVER, sorted(m for m in loaded if m.split(".")[1:2] and m.split(".")[1] in NEVER)
    assert parts <= ALLOWED, sorted(parts - ALLOWED)


def test_the_check_sees_the_executor():
    """The same probe on the engine's side loads what the planner must not: the check can fail."""
    loaded = _loaded_by("import vlm_sdk.executor")
    assert {"vlm_sdk.executor.launch", "vlm_sdk.worker.worker"} <= set(loaded)
