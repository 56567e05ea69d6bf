"""The OpenAI-compatible HTTP server: FastAPI handlers in front of one engine loop thread."""

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024  # a 65536-token prompt as JSON is under 1 MiB
