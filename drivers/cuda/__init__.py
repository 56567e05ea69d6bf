"""CUDA reference driver: the same HF-order eager attention as the CPU, plus SDPA.

May import: ``hal``. Never another driver; the runtime reaches this one through the registry.
"""
