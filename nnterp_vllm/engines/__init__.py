"""The engines a standardized model runs on: transformers and vLLM."""
