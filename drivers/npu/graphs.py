"""Step graphs on Ascend (``torch.npu.NPUGraph``), and their EMULATED test double.

``NpuStepGraphs`` is the npu driver's ``hal.graphs`` capability. With torch_npu it warms the
step up, captures it with ``torch.npu.graph(g, pool=...)`` and replays it with ``g.replay()``.
It captures without ``auto_dispatch_capture``: with it, torch_npu's ``_npugraph_handlers``
record ops such as ``npu_fused_infer_attention_score`` so that
``NPUGraph.update(cpu_update_input=...)`` can refresh host arguments like
``actual_seq_lengths_kv``, but each such op then waits, at every replay, for an update that
relaunches it: one more host call per layer pass. The step graphs need none (the ascend_fia
decode form passes constant lengths and a mask on the device).

Without hardware, ``EmulatedNPUGraph`` stands in for an ACL graph (a test double: everything
it runs is labelled emulated, and it proves nothing about speed). It does what a graph
*constrains*, so that code that would break on a 910B breaks here:

- capture runs the step once and records, with a ``TorchDispatchMode``, the sequence of
  device ops it dispatched: each op's name, its non-tensor arguments, and for every tensor
  its shape, dtype and where its memory comes from (a buffer that existed before capture,
  by address and offset; or the k-th buffer the step itself made). Views are not ops.
  Each emulated torch_npu op is one entry (the one device op it stands for).
- any host read (``.item()``, ``.tolist()``, ``bool(t)``, ``.cpu()``, ``.numpy()``), any
  tensor built from host data (``torch.tensor(...)``) and any synchronise during capture
  raises :class:`GraphCaptureError`.
- replay runs the recorded callable again on the same static tensors and raises
  :class:`GraphReplayError` at the first op that differs from the capture: another op,
  shape or host argument (control flow that depended on data, which a real graph would
  have frozen at its captured branch), or a read of a buffer the capture never saw (an input
  copied into a new tensor instead of the static one: a real graph keeps reading the old
  buffer). The outputs returned at capture are static: replay writes into them.
- a handler op's host arguments are frozen at capture: replay runs it with the captured
  ones whatever the callable passes, as the real graph does (a step whose lengths changed
  reads the wrong context, which the replay-vs-eager checks catch).
- ``update(cpu_update_input)`` follows torch_npu's rules (only after
  ``auto_dispatch_capture=True``, one dict per recorded handler op or one for all); replay
  then runs those ops with the updated host arguments, and raises without an update since
  the previous replay (on hardware it would wait for the update's event).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hal.graphs import StepGraph, StepGraphs, device_call


class GraphCaptureError(RuntimeError):
    """Something a real graph cannot capture happened during capture."""


class GraphReplayError(RuntimeError):
    """A replay did not issue the op sequence the capture recorded."""


# torch_npu/npu/_npugraph_handlers (2.13.0): the ops whose host arguments update() refreshes,
# and where those arguments sit (positional index, keyword name).
UPDATE_SPECS: dict[str, tuple[tuple[int, str], ...]] = {
    "npu_fused_infer_attention_score": ((5, "actual_seq_lengths"), (6, "actual_seq_lengths_kv")),
    "npu_fused_infer_attention_score_v2": (
        (5, "actual_seq_qlen"),
        (6, "actual_seq_kvlen"),
    ),
    "_npu_paged_attention": ((7, "context_lens"),),
}

_HOST_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.cpu,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
}
_aten = torch.ops.aten
_HOST_READ_OPS = {_aten._local_scalar_dense.default}
_HOST_DATA_OPS = {_aten.lift_fresh.default, _aten.lift_fresh_copy.default}
_NOT_KERNELS = {_aten.detach.default, _aten.alias.default}

_captures: list[_Tape] = []  # the tapes recording now (one capture at a time, as on hardware)


def capturing() -> bool:
    """Whether an emulated graph is being captured (torch.npu.is_current_stream_capturing)."""
    return any(t.capture for t in _captures)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr() if t.numel() else 0


class _Tape(TorchDispatchMode):
    """The op sequence of one run of a step (capture, or a replay being checked)."""

    def __init__(self, capture: bool) -> None:
        super().__init__()
        self.capture = capture
        self.ops: list[tuple] = []
        self.made: dict[int, int] = {}  # storage address -> k: the k-th buffer the run made
        self.buffers = 0
        self.paused = 0
        self.graph: EmulatedNPUGraph | None = None  # whose capture or replay this is

    def describe(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value if isinstance(value, (int, float, bool, str, type(None))) else repr(value)
        ptr = _storage(value)
        where = ("made", self.made[ptr]) if ptr in self.made else ("static", ptr)
        return (tuple(value.shape), value.dtype, where, value.storage_offset())

    def record(self, name: str, args, kwargs, outputs, skip: frozenset[str] = frozenset()) -> None:
        kw = {k: v for k, v in (kwargs or {}).items() if k not in skip}
        flat, _ = tree_flatten((args, kw))
        before = {_storage(t) for t in flat if isinstance(t, torch.Tensor)}
        self.ops.append((name, tuple(self.describe(v) for v in flat)))
        for out in tree_flatten(outputs)[0]:
            if isinstance(out, torch.Tensor) and _storage(out) not in before and out.numel():
                self.made[_storage(out)] = self.buffers  # an address may be reused: a new k
                self.buffers += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.paused:  # warm-up work: what it makes outlives the step, as a static buffer
            out = func(*args, **(kwargs or {}))
            ins = {
                _storage(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
            }
            for t in tree_flatten(out)[0]:  # a new buffer's address may be a freed step one's
                if isinstance(t, torch.Tensor) and _storage(t) not in ins:
                    self.made.pop(_storage(t), None)
            return out
        if self.capture and func in _HOST_READ_OPS:
            raise GraphCaptureError(
                f"host read during graph capture ({func}): a graph freezes the branch it saw; "
                "keep the decision on the device (torch.where) or outside the captured step"
            )
        if self.capture and func in _HOST_DATA_OPS:
            raise GraphCaptureError(
                "a tensor built from host data during graph capture (torch.tensor): a graph "
                "would replay the captured values; copy per-step data into a static buffer"
            )
        out = func(*args, **(kwargs or {}))
        if not (func in _NOT_KERNELS or (func.is_view and _aliases(out, args))):
            self.record(str(func), args, kwargs, out)
        return out


def _aliases(out, args) -> bool:
    """Whether an op that may alias (``aten.to`` under inference mode) returned views only."""
    ins = {_storage(t) for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)}
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    return all(_storage(t) in ins for t in outs)


class _NoHostReads(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _HOST_READS and not any(t.paused for t in _captures):
            raise GraphCaptureError(
                f"host read during graph capture ({getattr(func, '__name__', func)}): nothing "
                "inside a graph may read the device from the host"
            )
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _recording(tape: _Tape) -> Iterator[_Tape]:
    _captures.append(tape)
    guard = _NoHostReads() if tape.capture else contextlib.nullcontext()
    try:
        with tape, guard:
            yield tape
    finally:
        _captures.remove(tape)


def _first_difference(want: list[tuple], got: list[tuple]) -> str | None:
    for i, (a, b) in enumerate(zip(want, got, strict=False)):
        if a != b:
            why = (
                "another op"
                if a[0] != b[0]
                else "a buffer the capture never read (an input copied into a new tensor "
                "instead of the static one?)"
                if any(
                    isinstance(x, tuple) and len(x) == 4 and isinstance(y, tuple) and x[2] != y[2]
                    for x, y in zip(a[1], b[1], strict=False)
                )
                else "other shapes or host arguments"
            )
            return f"op {i}: captured {a[0]}, replayed {b[0]}: {why}"
    if len(want) != len(got):
        return f"the capture issued {len(want)} ops, the replay {len(got)}"
    return None


class EmulatedNPUGraph:
    """EMULATED ``torch.npu.NPUGraph`` (see the module docstring for what it checks)."""

    def __init__(self) -> None:
        self.auto_dispatch_capture = False
        self._fn: Callable[[], Any] | None = None
        self._tape: _Tape | None = None
        self._outputs: Any = None
        self._pool: object | None = None
        self._host_args: list[dict[str, Any]] = []  # per recorded handler op
        self._updated = False  # update() since the last replay
        self.replays = 0

    def capture(self, fn: Callable[[], Any], pool=None, auto_dispatch_capture=False) -> Any:
        """Capture ``fn()`` (the emulation needs the callable: it re-runs it at replay)."""
        if capturing():
            raise GraphCaptureError("another graph is being captured")
        self.auto_dispatch_capture = auto_dispatch_capture
        self._pool = pool if pool is not None else object()
        with _recording(_Tape(capture=True)) as tape:
            tape.graph = self
            outputs = fn()
        self._fn, self._tape, self._outputs = fn, tape, outputs
        return outputs

    def replay(self) -> None:
        if self._fn is None or self._tape is None:
            raise RuntimeError("emulated NPUGraph: replay() before a capture")
        if self.auto_dispatch_capture and self._host_args and not self._updated:
            raise GraphReplayError(
                "emulated NPUGraph: replay() without update() of its "
                f"{len(self._host_args)} handler op(s): with auto_dispatch_capture=True "
                "torch_npu captures an ExternalEvent wait before each such op that only "
                "update(cpu_update_input) records, so on hardware this replay would wait forever"
            )
        self._updated = False
        with _recording(_Tape(capture=False)) as tape:
            tape.graph = self
            outputs = self._fn()
            why = _first_difference(self._tape.ops, tape.ops)
            if why is not None:
                raise GraphReplayError(
                    f"emulated NPUGraph: the replay differs from the capture at {why}"
                )
            tape.paused += 1  # the double's own bookkeeping, not the step's
            pairs = zip(tree_flatten(self._outputs)[0], tree_flatten(outputs)[0], strict=True)
            for static, new in pairs:
                if isinstance(static, torch.Tensor) and static is not new:
                    with torch.inference_mode(static.is_inference()):
                        static.copy_(new)
        self.replays += 1

    def update(self, cpu_update_input: list[dict[str, Any]]) -> None:
        if not self.auto_dispatch_capture:
            raise RuntimeError(
                "The current graph configuration does not support update,Try to capture by "
                "setting auto_dispatch_capture=True during capture"
            )
        if len(cpu_update_input) == 1:
            cpu_update_input = [dict(cpu_update_input[0]) for _ in self._host_args]
        if len(cpu_update_input) != len(self._host_args):
            raise RuntimeError(
                f"Currently, there are {len(self._host_args)} operators that need to be "
                f"updated by capture, and there are only {len(cpu_update_input)} elements in "
                "the incoming cpu_update_input list"
            )
        for recorded, new in zip(self._host_args, cpu_update_input, strict=True):
            recorded.update({k: v for k, v in new.items() if k in recorded})
        self._updated = True

    def reset(self) -> None:
        self._fn = self._tape = self._outputs = None

    def pool(self) -> object:
        return self._pool

    @property
    def num_ops(self) -> int:
        """Device ops the capture recorded (what one replay stands for)."""
        return len(self._tape.ops) if self._tape is not None else 0


class emulated_graph:  # noqa: N801 - mirrors torch.npu.graph
    """EMULATED ``torch.npu.graph(g, pool, stream, auto_dispatch_capture, capture_error_mode)``:
    the body is checked as a capture (host reads, host data and synchronise raise), but the
    emulation can replay only what ``EmulatedNPUGraph.capture(fn)`` recorded."""

    def __init__(self, npu_graph, pool=None, stream=None, auto_dispatch_capture=False, **_):
        self.npu_graph = npu_graph
        npu_graph.auto_dispatch_capture = auto_dispatch_capture
        self._ctx: contextlib.AbstractContextManager | None = None

    def __enter__(self):
        self._ctx = _recording(_Tape(capture=True))
        self._ctx.__enter__()

    def __exit__(self, *exc):
        assert self._ctx is not None
        return self._ctx.__exit__(*exc)


def _npu_op(name: str, fn: Callable) -> Callable:
    """An emulated torch_npu op as one device op of the tape; its own torch ops are hidden."""
    spec = UPDATE_SPECS.get(name, ())

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with device_call(f"torch_npu.{name}"):
            return _run_npu_op(name, fn, spec, args, kwargs)

    return call


def _run_npu_op(name: str, fn: Callable, spec, args, kwargs):
    tape = _captures[-1] if _captures else None
    if tape is None or tape.paused:
        return fn(*args, **kwargs)
    if spec and tape.graph is not None:
        args, kwargs = _host_arguments(tape.graph, tape, spec, list(args), dict(kwargs))
    tape.paused += 1
    try:
        out = fn(*args, **kwargs)
    finally:
        tape.paused -= 1
    # Host arguments update() refreshes are not part of what the graph froze.
    frozen = [a if i not in {i for i, _ in spec} else "<updatable>" for i, a in enumerate(args)]
    tape.record(f"torch_npu.{name}", frozen, kwargs, out, frozenset(k for _, k in spec))
    return out


def _host_arguments(graph: EmulatedNPUGraph, tape: _Tape, spec, args: list, kwargs: dict):
    """Capture: remember the handler op's host arguments. Replay: run it with the remembered
    (or updated) ones, whatever the callable passes, as the real graph does."""
    index = sum(1 for op in tape.ops if op[0].split(".")[-1] in {*UPDATE_SPECS})
    if tape.capture:
        graph._host_args.append(
            {key: args[i] if i < len(args) else kwargs.get(key) for i, key in spec}
        )
        return args, kwargs
    recorded = graph._host_args[index]
    for i, key in spec:
        if i < len(args):
            args[i] = recorded[key]
        elif key in kwargs or recorded[key] is not None:
            kwargs[key] = recorded[key]
    return args, kwargs


@contextlib.contextmanager
def warm_up_work() -> Iterator[None]:
    """Work that a step does on its first run only (a quantized weight's device layout,
    derived once): on the device, ``NpuStepGraphs`` runs the step once before capturing it,
    so such work never enters a graph. The emulated graph captures without that warm-up (its
    capture runs the step): the body is hidden from its tapes, as it would be absent from
    the device's capture. Outside an emulated capture it does nothing."""
    for tape in _captures:
        tape.paused += 1
    try:
        yield
    finally:
        for tape in _captures:
            tape.paused -= 1


def _refuse_in_capture(what: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if capturing() and not any(t.paused for t in _captures):
            raise GraphCaptureError(f"{what} during graph capture: a graph cannot wait for itself")
        return fn(*args, **kwargs)

    return call


def install(npu: Any) -> None:
    """Give an ``EmulatedTorchNpu`` the graph API (``NPUGraph``, ``graph``,
    ``graph_pool_handle``, ``is_current_stream_capturing``) and make its ops graph-aware."""
    npu.NPUGraph = EmulatedNPUGraph
    npu.graph = emulated_graph
    npu.graph_pool_handle = object
    npu.is_current_stream_capturing = capturing
    for name in dir(npu):
        if name.startswith(("npu_", "_npu_")) and callable(getattr(npu, name)):
            setattr(npu, name, _npu_op(name, getattr(npu, name)))
    npu.synchronize = _refuse_in_capture("synchronize", npu.synchronize)
    npu.to_host = _refuse_in_capture("a device-to-host copy", npu.to_host)


class NpuStepGraph(StepGraph):
    def __init__(self, graph: Any) -> None:
        self.graph = graph

    def _replay(self) -> None:
        self.graph.replay()

    def update(self, cpu_update_input: list[dict[str, Any]]) -> None:
        self.graph.update(cpu_update_input)


class NpuStepGraphs(StepGraphs):
    """ACL graphs through torch_npu (``torch.npu.NPUGraph``), or the emulated double."""

    name = "npu_graph"

    def __init__(self, device: Any) -> None:
        self.device = device  # an NpuDevice, initialised
        self.emulated = bool(device.emulated)
        self._pool: object | None = None

    def capture(self, fn: Callable[[], Any]) -> tuple[StepGraph, Any]:
        ops = self.device.ops
        if ops.NPUGraph is None:
            raise RuntimeError(
                "--step-graphs: this torch_npu has no torch.npu.NPUGraph (ACL graphs); install "
                "the torch-npu release paired with your torch, which has it"
            )
        if self._pool is None:
            self._pool = ops.graph_pool_handle()  # one pool: graphs run one at a time
        graph = ops.NPUGraph()
        # No dispatch handlers: the captured step takes no per-step host argument (ascend_fia's
        # decode form has constant lengths), and a handler op would make every replay wait
        # for an update() that relaunches it (one host call per layer pass).
        if self.emulated:
            outputs = graph.capture(fn, pool=self._pool, auto_dispatch_capture=False)
            return NpuStepGraph(graph), outputs
        fn()  # warm-up: lazy initialisation and the allocator's first blocks, outside capture
        ops.synchronize()
        with ops.graph(graph, pool=self._pool, auto_dispatch_capture=False):
            outputs = fn()
        return NpuStepGraph(graph), outputs
