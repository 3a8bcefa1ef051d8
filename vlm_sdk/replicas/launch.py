"""`serve_replicas`: deploy N engine replicas on Ray Serve and return the engine the server talks to.

    from vlm_sdk.replicas import launch
    llm = launch.serve_replicas("Qwen/Qwen2.5-VL-3B-Instruct", data_parallel_size=2)
    out = await llm.chat_stream(...)            # or: vlm-sdk serve MODEL --data-parallel-size 2

Ray: joins the cluster `ray_address` names ("auto": the local node's), the one this process already
joined, or starts a local one (then shut down with the replicas). Each replica holds `replica_cpus`
CPUs and, on CUDA, its GPU in bundle 0 of its placement group; a tensor-parallel replica's other
ranks are Ray actors in bundles 1..N-1 of the same group (`_placement`; the Ray executor), or with
`distributed_executor_backend="mp"` processes of the replica holding all N GPUs in bundle 0. Serve's
HTTP proxy is not started: the OpenAI server in this process is the front. With `max_replicas`, Serve's autoscaler keeps between
`min_replicas` and `max_replicas`, aiming at `target_ongoing_requests` per replica.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import asdict

from vlm_sdk.executor.ray_placement import rank_bundle
from vlm_sdk.replicas import require_ray
from vlm_sdk.replicas.config import ReplicaConfig
from vlm_sdk.replicas.routing import RoutingConfig

ROUTER_CLASS = "vlm_sdk.replicas.router:CacheAwareRouter"
# the Ray side of shutting down (delete the application, stop Serve and the cluster we started): a
# cluster that stopped answering meanwhile would hold every Serve call ~60 s, then Ray ends the process
STOP_SECONDS = 20.0
PROBE_SECONDS = 0.5
log = logging.getLogger(__name__)


def replica_engine_args(engine_args: dict) -> dict:
    """The engine arguments a replica runs with: a tensor-parallel replica's ranks 1..N-1 are Ray actors
    in the replica's own placement group (`distributed_executor_backend="ray"`) unless "mp" is asked for."""
    out = {"show_progress": False, **engine_args}
    if int(out.get("tensor_parallel_size") or 1) > 1 and out.get("distributed_executor_backend") is None:
        out["distributed_executor_backend"] = "ray"
    return out


def _placement(config: ReplicaConfig, engine_args: dict) -> dict:
    """A replica's placement group and its own share of it. Bundle 0 holds the replica (rank 0: its CPUs
    and, on CUDA, its GPU, which Ray then makes its only visible one); with Ray ranks, bundles 1..N-1
    hold ranks 1..N-1 (ray_placement.rank_bundle) with the engine's `ray_placement_strategy`, so they
    may sit on other nodes; with "mp" ranks, bundle 0 holds all N GPUs on one node."""
    tp = int(engine_args.get("tensor_parallel_size") or 1)
    on_cuda = engine_args.get("device") not in ("cpu",) and _cuda_available()
    ray_ranks = tp > 1 and engine_args.get("distributed_executor_backend") == "ray"
    gpus = (1 if ray_ranks else tp) if on_cuda else 0
    bundles = [{"CPU": config.replica_cpus, **({"GPU": gpus} if gpus else {})}]
    if ray_ranks:
        bundles += [rank_bundle(on_cuda) for _ in range(tp - 1)]
    return dict(ray_actor_options={"num_cpus": 0, **({"num_gpus": gpus} if gpus else {})},
                placement_group_bundles=bundles,
                placement_group_strategy=engine_args.get("ray_placement_strategy", "PACK") if ray_ranks else "STRICT_PACK")


def _deployment_options(config: ReplicaConfig, routing: RoutingConfig, engine_args: dict) -> dict:
    from ray.serve.config import RequestRouterConfig
    options = dict(
        max_ongoing_requests=config.max_ongoing_requests,
        health_check_period_s=config.health_check_period_s,
        health_check_timeout_s=config.health_check_timeout_s,
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTER_CLASS, request_router_kwargs=asdict(routing),
            request_routing_stats_period_s=routing.stats_period_s,
            request_routing_stats_timeout_s=max(10.0, 4 * routing.stats_period_s)),
        **_placement(config, engine_args))
    if config.max_replicas is not None:
        options["autoscaling_config"] = {"min_replicas": config.min_replicas or 1,
                                         "initial_replicas": config.data_parallel_size,
                                         "max_replicas": config.max_replicas,
                                         "target_ongoing_requests": config.target_ongoing_requests}
    else:
        options["num_replicas"] = config.data_parallel_size
    return options


def gcs_answers(address: str, timeout: float = 1.0) -> bool:
    """Whether the Ray cluster's GCS at `address` ("host:port") still accepts a connection. Ctrl-C in a
    terminal, or a SIGTERM to the server's whole process group, also reaches the processes of a cluster
    the server started (they share its group): then every Serve call waits ~60 s for a GCS that is gone."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def stop_replicas(app_name: str, board, started_ray: bool) -> None:
    """Delete the Serve application and the stats board, and stop Serve and Ray when this process
    started the cluster. Waits up to STOP_SECONDS, asking the GCS every PROBE_SECONDS whether it still
    answers: once it stops (the cluster got the same signal), no longer; the Ray side's thread, stuck in
    a Serve call, is left behind."""
    import ray
    # read while connected: once the thread has run ray.shutdown, Ray's API would start a new cluster
    gcs = ray.get_runtime_context().gcs_address
    worker = threading.Thread(target=_stop_ray_side, args=(app_name, board, started_ray), name="vlm-ray-stop",
                              daemon=True)
    worker.start()
    deadline = time.monotonic() + STOP_SECONDS
    while True:
        worker.join(PROBE_SECONDS)
        if not worker.is_alive():
            return
        if not gcs_answers(gcs):
            log.warning("the Ray cluster (GCS at %s) no longer answers, so its replicas have ended with it: most "
                        "likely its processes got this one's signal (Ctrl-C, or a SIGTERM to the whole process "
                        "group). Nothing is left to delete.", gcs)
            return
        if time.monotonic() >= deadline:
            log.warning("the Ray cluster did not finish deleting the replicas within %.0f s; leaving it to end "
                        "them", STOP_SECONDS)
            return


def _stop_ray_side(app_name: str, board, started_ray: bool) -> None:
    import ray
    from ray import serve
    serve.delete(app_name)
    ray.kill(board)
    if started_ray:
        serve.shutdown()
        ray.shutdown()


def _cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


def serve_replicas(model: str, config: ReplicaConfig | None = None, routing: RoutingConfig | None = None,
                   **engine_args):
    """Start the replicas (returns once every one has loaded its model and reported ready) and return
    the `ReplicaSetLLM` that routes to them; its `shutdown()` deletes them."""
    require_ray()
    import ray
    from ray import serve

    from vlm_sdk.replicas.client import ReplicaSetLLM
    from vlm_sdk.replicas.deployment import EngineReplica
    from vlm_sdk.replicas.stats import StatsBoard
    config, routing = config or ReplicaConfig(), routing or RoutingConfig()
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address=config.ray_address, include_dashboard=False, log_to_driver=False)
    serve.start(proxy_location="Disabled")
    board = ray.remote(StatsBoard).options(num_cpus=0).remote()
    engine_args = replica_engine_args(engine_args)
    deployment = serve.deployment(EngineReplica, name="EngineReplica").options(
        **_deployment_options(config, routing, engine_args))
    handle = serve.run(deployment.bind(str(model), engine_args, board), name=config.app_name, route_prefix=None)

    def stop() -> None:
        stop_replicas(config.app_name, board, started_ray)
    try:
        args = handle.info.remote().result()["args"]
        llm = ReplicaSetLLM(handle, str(model), board, routing, args, on_shutdown=stop)
        # serve.run returned once every replica was built; wait for each one's first stats report, so
        # that stats() covers them all from the start
        deadline = time.monotonic() + 30 * routing.stats_period_s + 10
        while len(ray.get(board.read.remote(60.0))) < config.data_parallel_size and time.monotonic() < deadline:
            time.sleep(routing.stats_period_s / 4)
    except BaseException:
        stop()
        raise
    return llm
