"""Reference CPU driver: HF-order eager attention, KV writes by ``index_put_``."""
