"""The OpenAI-compatible HTTP server: FastAPI handlers in front of one engine loop thread.

Owns: the app (``app``, its HTTP plumbing in ``http``) and its routes, the request protocol,
the response shapes (``render``; ``logprobs``), tool calls (``tools``), the engine loop thread,
metrics, and Ray Serve replicas of the same app (``replicas``, the one module that imports Ray).

May import: ``hal``, ``runtime_glue.ouro`` and ``runtime_glue.engine``. An engine is built
from ``EngineArgs``; never the command line, the checks or the benchmarks.
"""

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024  # a 65536-token prompt as JSON is under 1 MiB
# Between the tokens of a JSON output whose request chose no whitespace (response_format, or
# structured_outputs without disable_any_whitespace / whitespace_pattern): room for indented
# JSON, while a model (a random one, a small one) cannot spend its tokens on whitespace.
DEFAULT_JSON_WHITESPACE = r"[ \t\n\r]{0,8}"
