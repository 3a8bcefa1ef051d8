"""Both engines the server can be given satisfy `EngineClient` (vlm_sdk/engine_client.py): `AsyncLLM` and the
Ray replica set `ReplicaSetLLM`, member for member, with the protocol's parameters (names, kinds,
defaults) and its sync / async / async-iterator kind; a live instance of each passes the runtime check."""
from __future__ import annotations

import asyncio
import inspect

import pytest

from vlm_sdk.async_llm import AsyncLLM
from vlm_sdk.config import EngineArgs
from vlm_sdk.engine_client import MEMBERS, EngineClient

ray = pytest.importorskip("ray")
from vlm_sdk.replicas.client import ReplicaSetLLM  # noqa: E402  (needs ray)
from vlm_sdk.replicas.routing import RoutingConfig  # noqa: E402

ATTRIBUTES = {"output_processor"}  # plain attributes of the protocol (set per instance)
PROPERTIES = {"args", "is_alive"}  # read-only: a property or an instance attribute satisfies them
STREAMS = {"generate", "chat_stream"}  # async generators: closing one aborts the request


def _kind(fn) -> str:
    if inspect.isasyncgenfunction(fn):
        return "async iterator"
    if inspect.iscoroutinefunction(fn):
        return "coroutine"
    return "sync"


def _params(fn) -> list[tuple[str, object, object]]:
    """(name, kind, default) of each parameter but self; annotations may differ in spelling."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()][1:]


def test_the_protocol_lists_what_the_server_uses():
    assert set(MEMBERS) == {n for n in dir(EngineClient) if not n.startswith("_")} | ATTRIBUTES
    assert ATTRIBUTES <= set(EngineClient.__annotations__)


@pytest.mark.parametrize("impl", [AsyncLLM, ReplicaSetLLM], ids=lambda c: c.__name__)
def test_every_method_matches_the_protocol(impl):
    for name in MEMBERS:
        if name in ATTRIBUTES:
            continue
        ours = inspect.getattr_static(EngineClient, name)
        theirs = inspect.getattr_static(impl, name, None)
        if name in PROPERTIES:
            assert isinstance(ours, property)
            assert theirs is None or isinstance(theirs, property), f"{impl.__name__}.{name} must be read-only data"
            continue
        assert callable(theirs), f"{impl.__name__} has no method {name}"
        assert _params(theirs) == _params(ours), (impl.__name__, name, inspect.signature(theirs))
        expected = "async iterator" if name in STREAMS else _kind(ours)
        assert _kind(theirs) == expected, (impl.__name__, name, _kind(theirs))


def test_a_live_replica_set_and_engine_are_engine_clients(tiny_ckpt):
    """The runtime check on real instances: attributes set in their constructors count too (the replica
    set is built without a cluster: its handle and stats board are only used per call)."""
    replicas = ReplicaSetLLM(None, str(tiny_ckpt), None, RoutingConfig(), EngineArgs())
    assert isinstance(replicas, EngineClient) and replicas.args == EngineArgs()
    assert replicas.output_processor.tokenizer is not None

    engine = AsyncLLM(str(tiny_ckpt), show_progress=False)
    try:
        assert isinstance(engine, EngineClient) and engine.is_alive
        assert engine.args.max_model_len == engine.engine.args.max_model_len
    finally:
        assert asyncio.run(engine.shutdown(timeout=30))


def test_the_check_can_fail():
    class Partial:  # build_prompt and generate, no shutdown or stats
        async def build_prompt(self, request, params=None, options=None): ...

        async def generate(self, prompt, params=None, request_id=None):
            yield None
    assert not isinstance(Partial(), EngineClient)
