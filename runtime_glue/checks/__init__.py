"""Tools that check a device or a configuration against another, or against Ouro's own code.

Owns: the HF-module reference (``reference``), the divergence locator (``parity``), the
acceptance kit (``acceptance``) and accuracy evaluation (``evaluation``).

May import: ``hal``, ``runtime_glue.ouro`` and ``runtime_glue.engine``. Never the server, the
benchmarks or the command line.
"""
