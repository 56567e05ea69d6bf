"""Tools that check a device or a configuration against another, or against Ouro's own code.

Owns: the HF-module reference (``reference``), the divergence locator (``parity``) and
accuracy evaluation (``evaluation``). The acceptance kit runs these and a benchmark, so it sits
above both, in the command line.

May import: ``hal``, ``runtime_glue.ouro`` and ``runtime_glue.engine``. Never the server, the
benchmarks or the command line.
"""
