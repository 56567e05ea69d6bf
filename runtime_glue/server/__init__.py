"""The OpenAI-compatible HTTP server: FastAPI handlers in front of one engine loop thread."""
