"""Model families. `registry.resolve(architectures)` maps a config.json architecture to its family."""
