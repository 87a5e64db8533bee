"""Tiny local models and a demo that runs vLLM with and without DSpark on a CPU."""
