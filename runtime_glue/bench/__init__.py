"""Benchmarks: every figure comes with its physical floor and its baseline from the same run.

Owns: the ``rlt-hal bench`` commands (``cli``) and what they measure (engine, HTTP serving,
detokenising, the device's floors).

May import: ``hal``, ``runtime_glue.ouro``, ``runtime_glue.engine`` and
``runtime_glue.checks``. The checks' HF-module reference is a baseline; not the server's
internals (``bench serve`` is an HTTP client) and never the command line.
"""
