"""The worker: everything that runs the model on one device, fed PLAIN DATA by the engine.

    engine (scheduler, sequences)  --SchedulerOutput-->  ModelRunner.execute  --ModelRunnerOutput-->  engine
                                    (vlm_sdk/protocol/)   (per-request state, encoder cache,
                                                           vision, forward, CUDA graphs, sampler)

Nothing here reads an engine `Sequence`: the worker keeps its own per-request state, so a worker
process (one per GPU, under tensor parallelism) can sit behind this seam.
"""
