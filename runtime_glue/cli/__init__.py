"""The ``rlt-hal`` command line: argument parsing and the commands that print.

Owns: the top-level parser and its commands (``main``), the commands that check a device
(``checks``: parity, acceptance, eval) and the acceptance kit (``acceptance``), which runs the
checks and ``bench latency`` on one device and so sits above both.

May import: ``hal``, ``runtime_glue.ouro``, ``runtime_glue.engine``, ``runtime_glue.checks``,
``runtime_glue.server`` and ``runtime_glue.bench``. That is every layer but the drivers (the
benchmarks' parsers register here); nothing imports it but the ``rlt-hal`` entry point and
``python -m runtime_glue.cli``.
"""
