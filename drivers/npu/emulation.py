"""EMULATED torch_npu: a CPU test double for the few torch_npu operations the driver uses.

Ascend hardware and CANN cannot exist where rlt-hal is built and tested, so this module
stands in for them with the same entry points, the same argument checks and the same
semantics, on CPU tensors. Everything it produces is labelled "emulated"; no result obtained
through it is a hardware result.

Events can be made to complete late (``event_delay`` polls) so that a missing fence shows up as
a test failure instead of passing by luck.
"""

from __future__ import annotations

import os

import torch

from drivers.npu import fused_ops, quant_ops
from hal.devops import emulated_op

EMULATE_ENV_VAR = "RLT_HAL_NPU_EMULATE"
# torch_npu's own documentation of npu_scatter_nd_update_ (torch_npu/_op_plugin_docs.py in the
# 2.13.0 wheel): data types of input and updates on Atlas A2/A3 (910B, the parts with bf16).
SCATTER_ND_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bool,
    torch.bfloat16,
    torch.int64,
    torch.int8,
)


def emulation_requested() -> bool:
    """Whether ``RLT_HAL_NPU_EMULATE`` asks for the emulation (1, true or yes)."""
    return os.environ.get(EMULATE_ENV_VAR, "").strip().lower() in ("1", "true", "yes")


class EmulatedEvent:
    """``torch.npu.Event`` stand-in: ``query()`` turns true only after ``delay`` polls, or
    immediately after ``synchronize()``."""

    def __init__(self, delay: int = 0) -> None:
        self.delay = delay
        self.recorded = False
        self._polls = 0
        self._complete = False

    def record(self, stream=None) -> None:
        self.recorded = True
        self._complete = self.delay == 0

    def query(self) -> bool:
        if not self.recorded:
            return True
        if not self._complete:
            self._polls += 1
            self._complete = self._polls > self.delay
        return self._complete

    def synchronize(self) -> None:
        self._complete = True


class EmulatedStream:
    pass


class EmulatedTorchNpu:
    """The operation set the NPU driver calls, emulated on the CPU."""

    label = "emulated torch_npu (CPU)"

    # The fused kernels of the fast plan, under torch_npu's names (drivers.npu.fused_ops).
    npu_rms_norm = staticmethod(fused_ops.npu_rms_norm)
    npu_add_rms_norm = staticmethod(fused_ops.npu_add_rms_norm)
    npu_swiglu = staticmethod(fused_ops.npu_swiglu)
    npu_rotary_mul = staticmethod(fused_ops.npu_rotary_mul)
    npu_scatter_pa_kv_cache = staticmethod(fused_ops.npu_scatter_pa_kv_cache)
    npu_fused_infer_attention_score = staticmethod(fused_ops.npu_fused_infer_attention_score)
    # The weight-only quantized matmul and its int4 packing (drivers.npu.quant_ops).
    npu_weight_quant_batchmatmul = staticmethod(quant_ops.npu_weight_quant_batchmatmul)
    npu_convert_weight_to_int4pack = staticmethod(quant_ops.npu_convert_weight_to_int4pack)
    npu_dynamic_quant = staticmethod(quant_ops.npu_dynamic_quant)  # W8A8 dynamic
    npu_quant_matmul = staticmethod(quant_ops.npu_quant_matmul)
    npu_quantize = staticmethod(quant_ops.npu_quantize)  # W8A8 static

    def __init__(self, event_delay: int = 0, device_count: int = 1) -> None:
        self.event_delay = event_delay
        self._device_count = device_count
        self.current_device = 0
        self.events: list[EmulatedEvent] = []
        self.scatter_calls = 0
        self.host_copies = 0  # device-to-host copies: each one a wait for the device
        from drivers.npu.graphs import install

        install(self)  # the emulated ACL graph API, and graph-aware ops (drivers.npu.graphs)

    # torch.npu.* ------------------------------------------------------------------------
    def device_count(self) -> int:
        return self._device_count

    def set_device(self, index: int) -> None:
        if not 0 <= index < self._device_count:
            raise RuntimeError(f"emulated npu: invalid device index {index}")
        self.current_device = index

    def current_stream(self) -> EmulatedStream:
        return EmulatedStream()  # a new object per call, like torch.npu.current_stream()

    def Event(self) -> EmulatedEvent:  # noqa: N802 - mirrors torch.npu.Event
        event = EmulatedEvent(self.event_delay)
        self.events.append(event)
        return event

    def synchronize(self) -> None:
        for event in self.events:
            event.synchronize()
        self.events.clear()

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor.to("cpu")`` from the device: counted, and a new tensor (the host copy)."""
        self.host_copies += 1
        return tensor.clone()

    # torch_npu.npu_scatter_nd_update_ ----------------------------------------------------
    def npu_scatter_nd_update_(self, target, indices, updates):
        """``target[indices[i]] = updates[i]`` in place, with torch_npu's argument rules.

        Checking the index values reads them, which the real op never does on the host: the
        checks run unobserved (``DisableTorchFunction``), so tests that record every read of
        a tensor see the driver's reads, not the test double's."""
        with emulated_op("torch_npu.npu_scatter_nd_update_"):  # one device op when counted
            with torch._C.DisableTorchFunction():
                self._check_scatter_nd(target, indices, updates)
            k = indices.shape[-1]
            flat = indices.reshape(-1, k).long()
            target.index_put_(tuple(flat.unbind(-1)), updates.reshape(-1, *target.shape[k:]))
        self.scatter_calls += 1
        return target

    def _check_scatter_nd(self, target, indices, updates) -> None:
        """The op's documented rules (see SCATTER_ND_DTYPES); the real op raises RuntimeError."""

        def refuse(rule: str):
            raise RuntimeError(f"npu_scatter_nd_update_: {rule} (torch_npu's documented rule)")

        if indices.dtype not in (torch.int32, torch.int64):
            refuse(f"indices must be int32 or int64, got {indices.dtype}")
        if indices.dim() < 2:
            refuse(f"indices must be at least 2-D, got {indices.dim()}-D")
        if not 1 <= target.dim() <= 8:
            refuse(f"input must have 1 to 8 dimensions, got {target.dim()}")
        if target.dtype not in SCATTER_ND_DTYPES:
            refuse(
                f"input must be float32, float16, bool, bfloat16, int64 or int8 on A2/A3, "
                f"got {target.dtype}"
            )
        if updates.dtype != target.dtype:
            refuse(f"updates must have input's dtype {target.dtype}, got {updates.dtype}")
        k = indices.shape[-1]
        if k > target.dim():
            refuse(f"the last dimension of indices ({k}) cannot exceed input's ({target.dim()})")
        want = tuple(indices.shape[:-1]) + tuple(target.shape[k:])
        if tuple(updates.shape) != want:
            refuse(
                f"updates.shape {list(updates.shape)} must equal indices.shape[:-1] + "
                f"input.shape[{k}:] = {list(want)}"
            )
        flat = indices.reshape(-1, k).long()
        if ((flat < 0) | (flat >= torch.tensor(target.shape[:k]))).any():
            refuse("indices must not be out of range")
