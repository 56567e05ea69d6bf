"""What an engine says when it starts: its plan (and where the plan's kernel choice is kept),
speculation, step graphs, weights and the KV pool (``announce_llm``, called by
``runtime_glue.engine.llm.build_llm`` and ``rlt-hal plan``)."""

from __future__ import annotations

import sys
from typing import Any

from runtime_glue.ouro.resolve import record_note


def announce_llm(llm: Any, file: Any = None) -> None:
    """An ``LLM``'s start-up lines (typed loosely: ``llm`` imports this module), on standard error unless ``file`` says otherwise: the plan (and
    where its kernel choice is kept, measured now or reused, so that a changed plan shows),
    then the KV pool."""
    file = file or sys.stderr
    caching = "on" if llm.engine.config.enable_prefix_caching else "off"
    spec = llm.speculative
    spec_line = "" if spec is None else "; " + spec.describe(llm.config.total_ut_steps)
    verdict = llm.engine.graph_admission  # None: graphs not asked for
    graphs_line = (
        ""
        if verdict is None
        else f"; step graphs {verdict.kernel} "
        + ("admitted" if verdict.admitted else f"refused ({verdict.why})")
    )
    stored = llm.stored_quantization
    source = "" if stored is None else f", as stored: {stored.describe()}"
    weights = (
        f"; weights {llm.model.weight_bytes / 2**20:.1f} MiB ({llm.plan.quantization}{source})"
    )
    print(
        f"{llm.driver.label}: {llm.plan.describe()}; prefix caching {caching}{spec_line}"
        f"{graphs_line}{weights}",
        file=file,
    )
    note = record_note(llm.plan)
    if note is not None:
        print(f"  {note}", file=file)
    print(llm.kv_summary, file=file)
