"""The OpenAI-compatible server: many requests on one batched model.

    engine        the continuous-batching loop tying the roles below (one cache row per
                  request, each at its own position); Request, TokenEvent, QueueFull
    request       what the roles pass between them: Request, its row, TokenEvent
    scheduler     who runs: the waiting queue, the rows, each iteration's prefill budget
    cache_rows    where their keys live: a cache row per request, the prefix cache's use
    prefix_cache  copies of prefilled cache rows, reused by prompts that share their prefix
    runner        one model forward (prefill chunk, batched decode step, speculative round)
                  and the sampling of its logits
    output        sampled tokens → token events (log-probs, text), stop strings, finished rows
    batch         offline: many prompts through the engine in the caller's thread
                  (generate_batch, `torchllama generate --prompt-file`)
    adapters      the LoRA adapters served by name (loaded, unloaded, in use)
    api/          one module per API surface (chat, completions, responses, messages,
                  embeddings, tokenization, adapters), each a translation into the one request
                  path (`api.core`)
    app           the FastAPI application: its routes, errors, API key, `torchllama serve`
    metrics       Prometheus metrics of the server

Built on `torchllama.generation` (sampling, text streams and stop strings, grammars,
speculative rounds); nothing in `generation` imports this package.
"""
