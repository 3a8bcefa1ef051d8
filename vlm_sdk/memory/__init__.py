"""All memory arithmetic, shared by `vlm-sdk plan` (config.json alone) and engine start-up (what the ranks
measured): the same inputs, consumers, sizing rules, capacity errors and report.

    inputs.py      MemoryInputs: one rank's model shape and settings (from the model on the meta device)
    consumers/     one file per memory consumer (weights, activation peak, logits + sampler, decode graph
                   pool, piecewise graphs, encoder cache): estimate(inputs); the GPU profile measures the
                   part of the same name (vlm_sdk/worker/profiler.py)
    breakdown.py   every consumer's bytes (measured or estimated) -> the device budget
    kv.py          bytes per block, the cache sizing rules (num_blocks | kv_cache_memory |
                   memory_utilization | the CPU default), CacheConfig.fixes_for, the no-room error
    capacity.py    max_model_len, whether a prompt fits, the too-long error and its fixes
    image_fit.py   whether the largest allowed image fits max_model_len (the start-up refusal)
    startup.py     engine start-up: every rank's cache, the smallest taken, the start-up report
    report.py      StartupMemory and the rows `vlm-sdk plan` shares with it
    weights.py     a model's parameter bytes by part
"""
