"""`python -m vlm_sdk.serve MODEL [flags]` is `vlm-sdk serve MODEL [flags]`: the entry point torchrun
starts on every rank of a multi-machine tensor-parallel server,

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:29500 -m vlm_sdk.serve /models/X \\
        --tensor-parallel-size 16

Rank 0 serves HTTP; the other ranks serve rank 0 (vlm_sdk/executor/torchrun.py) and exit with it.
"""
from __future__ import annotations

import sys

from vlm_sdk.demo_checkpoint import tiny_model_dir
from vlm_sdk.server.cli import exit_now, serve_main

if __name__ == "__main__":
    exit_now(serve_main(sys.argv[1:], tiny_model_dir))
