"""Every Triton kernel of vlm_sdk.kernels compiles ahead of time for sm_90 (H100), and each tensor-core
kernel also for sm_80 (A100), in bfloat16 at production shapes, with no register spills, on a machine
without a GPU.

tests/kernels/aot_compile.py does the work in a subprocess (the kernels must be JITFunctions, which
TRITON_INTERPRET=1 in this process prevents): each launcher runs on "meta" tensors of the real shapes
(Qwen2.5-VL-7B 28q/4kv and -3B 16q/2kv at head_dim 128, GQA groups 7 and 8; Qwen3-VL-8B's q/k norm
rotary; the vision towers' head_dim 80 (Qwen2.5-VL ViT) and 64 (InternViT-300M); Qwen3-VL-30B-A3B's and
235B-A22B's experts, and 30B-A3B's block-wise FP8 experts on sm_90 only: Triton has no e4m3 before
sm_89), its launches are
recorded, specialised by Triton's binder for the CUDA backend and compiled with
`triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`; ptxas (inside triton) reports the
registers and spills. sm_90 compiles every case; sm_80 the cases in aot_compile.py's SM80_CASES (one
per tensor-core kernel: `python tests/kernels/aot_compile.py --arch 80 --all-cases` compiles the rest).
One process per arch.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
ARCHS = ("sm_90", "sm_80")
MODULES = ("paged_attention_decode", "paged_prefill_attention", "store_kv", "rotary", "rotary_store_kv",
           "varlen_attention", "rms_norm", "silu_and_mul", "token_bitmask", "exponential_race", "top_p_cut",
           "skinny_gemm", "int4_gemm", "fp8_block_gemm", "fused_moe", "causal_conv1d", "gated_delta_rule_chunk",
           "gated_delta_rule_recurrent", "gated_rms_norm")
# (module, arch) -> why it spills, as a strict xfail; empty: none does (the rotary kernel's sm_90 spill,
# libdevice's huge-argument cosf/sinf path, went with its own cos/sin: kernels/rotary.py `_cos_sin`)
KNOWN_SPILLS: dict[tuple[str, str], str] = {}
# the modules of aot_compile.py's SM80_CASES
SM80_MODULES = ("paged_attention_decode", "paged_prefill_attention", "varlen_attention", "fused_moe", "int4_gemm",
                "fp8_block_gemm", "skinny_gemm")


def _ptxas_available() -> bool:
    try:
        import triton.backends.nvidia as nvidia
    except ImportError:
        return False
    return (Path(nvidia.__file__).parent / "bin" / "ptxas").exists()


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> tuple[list[dict], list[str]]:
    """(one row per (kernel launch, case, arch), every kernel name the package defines)."""
    if not _ptxas_available():
        pytest.skip("triton's NVIDIA backend (ptxas) is not installed")
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # real JITFunctions, compiled
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton_cache"))  # fresh: ptxas must run
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default, stated to silence its warning
    # one process per arch, side by side: ptxas and Triton's passes are single-threaded, and the two
    # arches share no compiled binary, so this halves the wall time on two cores
    procs = [subprocess.Popen([sys.executable, str(HERE / "aot_compile.py"), "--arch", arch[3:]], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for arch in ARCHS]
    rows, kernels = [], None
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-4000:]
        lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        rows += [r for r in lines if "module" in r]
        kernels = lines[-1]["kernels"]
    return rows, kernels


def test_every_kernel_compiles_for_both_archs(compiled):
    rows, kernels = compiled
    errors = [f"{r['kernel']} ({r['case']}, {r['arch']}): {r['error']}" for r in rows if "error" in r]
    assert not errors, "\n".join(errors)
    for kernel in kernels:
        assert any(r["kernel"] == kernel and r["arch"] == "sm_90" for r in rows), (
            f"{kernel} has no ahead-of-time case: add one to tests/kernels/aot_compile.py cases()")
    assert {r["module"] for r in rows if r["arch"] == "sm_90"} == set(MODULES)
    assert {r["module"] for r in rows if r["arch"] == "sm_80"} == set(SM80_MODULES)


@pytest.mark.parametrize("module,arch", [
    pytest.param(m, a, marks=[pytest.mark.xfail(strict=True, reason=KNOWN_SPILLS[m, a])] if (m, a) in KNOWN_SPILLS
                 else []) for a in ARCHS for m in (MODULES if a == "sm_90" else SM80_MODULES)])
def test_no_register_spills(compiled, module, arch):
    rows = [r for r in compiled[0] if r["module"] == module and r["arch"] == arch and "error" not in r]
    assert rows
    spilled = [f"{r['kernel']} ({r['case']}, {arch}): {r['spill_bytes']} bytes spilled, {r['regs']} registers, "
               f"{r['constexprs']}" for r in rows if r["spill_bytes"]]
    assert not spilled, "\n".join(spilled)
