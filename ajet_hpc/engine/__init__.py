"""Inference engines behind one interface (vLLM, transformers) and the built-in tiny model."""
