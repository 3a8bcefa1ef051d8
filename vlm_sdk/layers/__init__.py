"""Model building blocks above the attention backends: tensor-parallel-ready linear layers and
embeddings (`linear`, `embedding`, TP group in `parallel_state`), RMSNorm (`norm`), rotary angle
state (`rotary`), activations (`activation`), the attention layers (`attention`) and the
non-attention kernel set chosen once per engine (`ops`)."""
