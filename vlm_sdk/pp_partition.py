"""Which decoder layers each pipeline stage holds (vLLM's `get_pp_indices`, `VLLM_PP_LAYER_PARTITION`).

    even (default)   num_layers // stages each; the remainder goes one layer each to the stages before
                     the last, from the second-to-last backwards (the last stage also holds the final
                     norm, the LM head and the sampler; vLLM balances the same way)
    partition        "4,6" or (4, 6): the layers of each stage, in order; as many numbers as stages,
                     each >= 1, summing to the model's layers (checked here: `InvalidRequestError` naming
                     the numbers and the setting that fixes them)

A stage's range is [start, stop): stage s holds layers sum(parts[:s]) .. sum(parts[:s + 1]) - 1.
"""
from __future__ import annotations

from vlm_sdk.errors import InvalidRequestError

PARAM = "pp_layer_partition"


def parse_partition(text: str | tuple[int, ...] | list[int] | None) -> tuple[int, ...] | None:
    """"4,6" (the flag's, vLLM's environment variable's spelling) or a sequence of ints -> a tuple; None as is."""
    if text is None:
        return None
    if isinstance(text, str):
        try:
            return tuple(int(p) for p in text.split(","))
        except ValueError:
            raise InvalidRequestError(f"pp_layer_partition={text!r} is not a list of layer counts: write one "
                                      f"number per pipeline stage, comma-separated (e.g. '4,6')", param=PARAM) from None
    if not all(isinstance(p, int) and not isinstance(p, bool) for p in text):
        raise InvalidRequestError(f"pp_layer_partition={text!r}: every stage's layer count must be an integer",
                                  param=PARAM)
    return tuple(text)


def layer_counts(num_layers: int, stages: int, partition: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """Each stage's layer count (module docstring); a partition that does not fit is refused."""
    if partition is not None:
        if len(partition) != stages:
            raise InvalidRequestError(
                f"pp_layer_partition={','.join(map(str, partition))} names {len(partition)} stages but "
                f"pipeline_parallel_size is {stages}: give one layer count per stage", param=PARAM)
        if any(p < 1 for p in partition):
            raise InvalidRequestError(
                f"pp_layer_partition={','.join(map(str, partition))}: every stage needs at least 1 decoder layer",
                param=PARAM)
        if sum(partition) != num_layers:
            raise InvalidRequestError(
                f"pp_layer_partition={','.join(map(str, partition))} sums to {sum(partition)} layers but the model "
                f"has {num_layers} decoder layers: the counts must add up to {num_layers}", param=PARAM)
        return partition
    if stages > num_layers:
        raise InvalidRequestError(f"pipeline_parallel_size={stages} is more stages than the model's {num_layers} "
                                  f"decoder layers: every stage needs at least one", param="pipeline_parallel_size")
    parts = [num_layers // stages] * stages
    for i in range(2, num_layers % stages + 2):  # the remainder to the stages before the last
        parts[-i] += 1
    return tuple(parts)


def layer_range(num_layers: int, stage: int, stages: int, partition: tuple[int, ...] | None = None) -> tuple[int, int]:
    """Stage `stage`'s [start, stop) of the decoder layers."""
    parts = layer_counts(num_layers, stages, partition)
    start = sum(parts[:stage])
    return start, start + parts[stage]
