"""The rlt-hal conformance kit: what any driver must pass.

Run it against a driver package (installed, registered through the ``rlt_hal`` entry point):

    pytest --pyargs hal.testing --rlt-driver NAME [--rlt-driver OTHER]

It checks the interfaces, KV write/read-back across planes and page boundaries, isolation
and causality, fence semantics, each attention backend against a float64 reference within a
stated bound (and HF-exact backends bit for bit against the shared HF-order arithmetic),
each kernel against float64 and the invariances it claims (``test_kernels``), and end-to-end
greedy parity with the CPU driver on small random checkpoints.

May import: ``hal``, ``runtime_glue.ouro`` and ``runtime_glue.engine``. The end-to-end case
drives the runtime over the driver under test, so the kit sits on top of the stack though it
ships inside hal; nothing imports the kit.
"""
