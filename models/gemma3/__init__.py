"""Gemma 3 (Gemma3ForConditionalGeneration): a SigLIP tower, an average-pool projector and the Gemma decoder."""
