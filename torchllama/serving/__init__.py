"""The OpenAI-compatible server: many requests on one batched model.

    engine        the continuous-batching engine (one cache row per request, each at its own
                  position)
    prefix_cache  copies of prefilled cache rows, reused by prompts that share their prefix
    app           the FastAPI application: protocol bodies, handlers, streaming
    metrics       Prometheus metrics of the server

Built on `torchllama.generation` (sampling, stop strings, grammars, speculative rounds); nothing
in `generation` imports this package.
"""
