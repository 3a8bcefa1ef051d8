"""Data-parallel replicas on Ray Serve: N engines (each an `AsyncLLM`, tensor parallel inside it as
today) behind one OpenAI-compatible server, with cache-aware routing.

    vlm-sdk serve MODEL --data-parallel-size N       (this package: `pip install 'vlm-sdk[ray]'`)

    aiohttp server (this process) --ReplicaSetLLM.build_prompt / generate--> DeploymentHandle
      --CacheAwareRouter (router.py: the rule in routing.py)--> EngineReplica (deployment.py, one Ray
      actor each: an AsyncLLM) --RequestOutput stream--> back to the server's handlers

Ray Serve starts the replicas, reports them ready, health-checks them and replaces one that dies;
`launch.py` deploys them, `client.py` is the engine the server talks to.
"""
from __future__ import annotations

from vlm_sdk.errors import RayNotInstalledError

INSTALL_HINT = ("data-parallel replicas run on Ray Serve, which is not installed: pip install 'vlm-sdk[ray]' "
                "(or pip install 'ray[serve]'), or leave out --data-parallel-size to serve one engine")


def require_ray() -> None:
    """Raise `RayNotInstalledError` saying how to install Ray unless `ray.serve` imports."""
    try:
        import ray.serve  # noqa: F401
    except ImportError as e:
        raise RayNotInstalledError(f"{INSTALL_HINT} ({e})") from None
