"""Ascend NPU driver. Never imports torch_npu at module import time.

May import: ``hal``. Never another driver; the runtime reaches this one through the registry.
"""
