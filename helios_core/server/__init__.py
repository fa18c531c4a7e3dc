"""The HTTP server: an OpenAI-compatible chat API over a running model (Litestar, uvicorn).

Module owners: ``app`` (app factory and thin controllers), ``service`` (the request lifecycle),
``schemas`` (request structs), ``preparation`` (frontend work on worker threads), ``presentation``
(JSON and SSE shapes), ``admission`` (ingress bound), ``bridge`` (engine events to the event loop),
``errors`` (error classes to statuses), ``metrics`` (Prometheus export), ``serve`` (``helios run``).
"""
