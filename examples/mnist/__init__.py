"""MNIST example: a small CNN trained data-parallel with gradient accumulation."""
