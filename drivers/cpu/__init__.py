"""Reference CPU driver: HF-order eager attention, KV writes by ``index_put_``.

May import: ``hal``. Never another driver; the runtime reaches this one through the registry.
"""
