"""CUDA reference driver: the same HF-order eager attention as the CPU, plus SDPA."""
