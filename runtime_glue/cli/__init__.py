"""The ``rlt-hal`` command line: argument parsing and the commands that print.

Owns: the top-level parser and its commands (``main``) and the commands that check a device
(``checks``: parity, acceptance, eval).

May import every other layer (the benchmarks' parsers register here). Nothing imports it but
the ``rlt-hal`` entry point and ``python -m runtime_glue.cli``.
"""
