"""`ReplicaConfig`: how many engine replicas `vlm-sdk serve --data-parallel-size` runs on Ray Serve, and
how Serve scales and health-checks them (vlm_sdk/replicas/launch.py deploys them). Plain data: the
command line reads its defaults without importing Ray or the engine."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ReplicaConfig"]


@dataclass(frozen=True)
class ReplicaConfig:
    data_parallel_size: int = 2  # replicas (the initial count under autoscaling)
    replica_cpus: float = 1.0
    min_replicas: int | None = None  # autoscaling bounds (Serve's autoscaling_config) when max_replicas is set
    max_replicas: int | None = None
    target_ongoing_requests: float = 8.0
    max_ongoing_requests: int = 256  # per replica; past it Serve holds requests in the router's queue
    health_check_period_s: float = 2.0
    health_check_timeout_s: float = 30.0
    ray_address: str | None = None
    app_name: str = "vlm-sdk"

    def __post_init__(self):
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be 1 or more, got {self.data_parallel_size}")
        if self.max_replicas is not None and not (self.min_replicas or 1) <= self.data_parallel_size <= self.max_replicas:
            raise ValueError(f"autoscaling needs min_replicas <= data_parallel_size <= max_replicas, got "
                             f"{self.min_replicas} <= {self.data_parallel_size} <= {self.max_replicas}")
