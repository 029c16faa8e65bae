"""The OpenAI-compatible server: `python -m workbench serve`.

    HTTP client ──► app.py (FastAPI: parse, validate, shape OpenAI responses, SSE streams)
                      │ await AsyncEngine.generate(...)        ▲ Delta per engine step
                      ▼                                        │
                 async_engine.py: one thread owns the LLMEngine; it drains add/abort commands,
                 runs engine.step() while anything is unfinished, and pushes each request's new
                 text (never a partial stop string) onto that request's asyncio queue
                      │ every StepRecord and finished request
                      ▼
                 metrics.py: Prometheus histograms, gauges and counters served at /metrics

Every request shares the engine's continuous batch; a client that disconnects aborts its request
(its KV blocks are freed at once); shutdown aborts what is left and says so to each stream.
"""
__all__ = ["AsyncEngine", "Delta", "RequestStream", "build_app"]
_WHERE = {"build_app": "app", "AsyncEngine": "async_engine", "Delta": "async_engine",
          "RequestStream": "async_engine"}


def __getattr__(name: str):
    """Import on first use, so that the router (serve/router.py) starts without torch."""
    if name in _WHERE:
        import importlib
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module 'workbench.serve' has no attribute {name!r}")
