"""Everything between a user and the HAL: loading, the Ouro executor, engine, server, CLI.

``LLM``, ``RequestOutput``, ``CompletionOutput`` and ``SamplingParams`` load the engine (and torch) on first use,
so that the command line parses, and ``--help`` answers, without importing torch.

May import: ``hal`` and ``runtime_glue.engine``. Each subpackage is a layer that declares its
own list; none reaches a driver but through the registry.
"""

from typing import TYPE_CHECKING, Any

import hal  # noqa: F401 - first: it keeps torch from auto-loading vendor stacks (see hal)

if TYPE_CHECKING:
    from runtime_glue.engine.llm import LLM
    from runtime_glue.engine.results import CompletionOutput, RequestOutput
    from runtime_glue.engine.sampling import SamplingParams

_EXPORTS = {
    "LLM": "runtime_glue.engine.llm",
    "CompletionOutput": "runtime_glue.engine.results",
    "RequestOutput": "runtime_glue.engine.results",
    "SamplingParams": "runtime_glue.engine.sampling",
}

__all__ = ["LLM", "RequestOutput", "CompletionOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'runtime_glue' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
