"""Between the engine and the workers: how many ranks there are, where they run, and how a step
reaches all of them (`make_executor`; executor.py has the interface)."""
from __future__ import annotations

from vlm_sdk.executor.executor import Executor, InProcessExecutor
from vlm_sdk.executor.launch import check_no_group_yet, rank_devices
from vlm_sdk.executor.torchrun import run_torchrun_rank, torchrun_rank
from vlm_sdk.models.parallel_split import check_tensor_parallel_size, tensor_parallel_sizes

__all__ = ["Executor", "make_executor"]


def make_executor(model_dir: str, config, hf_config, family) -> Executor:
    """One rank in this process; or, with `tensor_parallel_size` > 1: Ray actors placed by a placement
    group (`distributed_executor_backend="ray"`), ranks started by torchrun (when its environment is
    set) or spawned here, one per device. The size is checked first (it must split the model's heads;
    on CUDA, one GPU per rank): refused with the sizes that would work."""
    device = config.args.resolve_device()
    parallel = config.parallel
    size = parallel.world_size
    check_tensor_parallel_size(family, hf_config, parallel, config.args.shard_vision)
    if size == 1:
        return InProcessExecutor(model_dir, config, device)
    check_no_group_yet()
    if config.args.distributed_executor_backend == "ray" and parallel.pipeline_parallel_size > 1:
        from vlm_sdk.errors import InvalidRequestError
        raise InvalidRequestError(
            f"pipeline_parallel_size={parallel.pipeline_parallel_size} runs on the 'mp' executor (and torchrun's "
            f"processes); the Ray executor does not place pipeline stages yet: leave distributed_executor_backend "
            f"unset (or 'mp')", param="distributed_executor_backend")
    if config.args.distributed_executor_backend == "ray":
        from vlm_sdk.executor.ray_executor import RayExecutor
        return RayExecutor(model_dir, config, device)
    if torchrun_rank() is not None:
        return run_torchrun_rank(model_dir, config, device)
    from vlm_sdk.executor.multiproc import MultiprocExecutor
    devices = rank_devices(device, size,
                           lambda limit: tensor_parallel_sizes(family, hf_config, parallel, config.args.shard_vision,
                                                               limit))
    return MultiprocExecutor(model_dir, config, devices)

