"""Ascend NPU driver. Never imports torch_npu at module import time."""
