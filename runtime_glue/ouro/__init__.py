"""The Ouro model and how it runs on a driver.

Owns: the checkpoint's config (``config``) and its checked loading (``checkpoint``), the looped
executor (``model``, its kernels ``loop_kernels``, its records ``records``, ``adaptive``),
Ouro's exit gate (``exits``), the execution plan and its resolution on a device (``plan``,
``resolve``, ``kernel_trials``, ``plan_record``, ``admission``), the toy checkpoints the tests
and the default use (``toy``, ``train``, ``presets``, with the training text in ``corpus``),
and a long step's progress line (``progress``).

May import: ``hal``. Beyond it only libraries (torch, safetensors, tokenizers); never the
engine, the checks, the server, the benchmarks or the command line.
"""
