"""Every memory consumer the plan and the start-up report count, in report order. A new one is a file
here (a `MemoryConsumer` subclass) and a line in `CONSUMERS`; the worker's profiler measures a part of
the same name on a GPU when it can (vlm_sdk/worker/profiler.py), else the estimate counts."""
from __future__ import annotations

from vlm_sdk.memory.consumers.activation import Activation
from vlm_sdk.memory.consumers.base import KINDS, MemoryConsumer
from vlm_sdk.memory.consumers.encoder_cache import EncoderCache
from vlm_sdk.memory.consumers.graph_pool import DecodeGraphPool
from vlm_sdk.memory.consumers.moe import MoeActivation
from vlm_sdk.memory.consumers.piecewise import PiecewiseGraphs
from vlm_sdk.memory.consumers.sampler import Sampler
from vlm_sdk.memory.consumers.weights import Weights

CONSUMERS: tuple[MemoryConsumer, ...] = (Weights(), Activation(), MoeActivation(), Sampler(), DecodeGraphPool(),
                                         PiecewiseGraphs(), EncoderCache())

__all__ = ["CONSUMERS", "KINDS", "MemoryConsumer"]
