"""Output: the engine's per-step `EngineOutput` (token ids, finish reasons, metrics), and the
`OutputProcessor` that turns them into text (incremental detokenization, stop strings) on each stream's
own thread, never the engine's."""
