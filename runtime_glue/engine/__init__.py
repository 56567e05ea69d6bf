"""The serving engine: requests in, tokens out, over one model and one paged KV pool.

Owns: the engine and its step loop (``core``) and its seams (docs/architecture.md): the
scheduler (``scheduler``), the input builder (``step``, ``spans``), step graphs (``graphs``,
``graph_buffers``), sampling (``sampling``, ``sampler``) and what a step's rows become
(``output``); the block allocator and prefix cache (``kv_manager``), where requests' K/V
lives in it (``kv_placement``, with ``shared_blocks`` for decode KV sharing),
requests, their checks and lifecycle (``request``, ``validation``), speculative decoding
(``speculative``), structured outputs (``structured``), the tokenizer and incremental
detokenizer (``tokenizer``, ``detokenizer``), ``LLM`` (``llm``), and ``EngineArgs``
(``args``), the one declaration of every option that builds an engine and of the pairs that
do not combine, checked where engines are made (``refusals``).

May import: ``hal`` and ``runtime_glue.ouro``. Never the checks, the server, the benchmarks or
the command line.
"""
