"""The serving engine: requests in, tokens out, over one model and one paged KV pool.

Owns: the scheduler and step loop (``core``), the block allocator and prefix cache
(``kv_manager``), requests and their lifecycle (``request``), sampling (``sampling``), the
tokenizer and incremental detokenizer (``tokenizer``, ``detokenizer``), ``LLM`` (``llm``), and
``EngineArgs`` (``args``), the one declaration of every option that builds an engine.

May import: ``hal`` and ``runtime_glue.ouro``. Never the checks, the server, the benchmarks or
the command line.
"""
