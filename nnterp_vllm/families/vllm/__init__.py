"""The vLLM engine's families, one module per model_type; no default on this engine."""
