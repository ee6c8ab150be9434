"""Inference runtime: slot-indexed caches, generation, CUDA-graph decode."""
