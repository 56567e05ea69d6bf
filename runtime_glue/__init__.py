"""Everything between a user and the HAL: loading, the Ouro executor, engine, server, CLI."""

import hal  # noqa: F401 - first: it keeps torch from auto-loading vendor stacks (see hal)
from runtime_glue.engine.llm import LLM, CompletionOutput
from runtime_glue.engine.sampling import SamplingParams

__all__ = ["LLM", "CompletionOutput", "SamplingParams"]
