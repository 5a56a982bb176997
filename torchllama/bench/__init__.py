"""Measurements of the model and its engine, side by side with peers.

`torchllama bench decode | shapes | serve | load | speculative | train`, one module each:

    decode         prefill, decode and batched-decode throughput (ours, transformers, llama.cpp)
    shapes_bench   the same at real sizes (1B-8B), plus load time and peak RSS (each engine
                   loading in its own process, both then in one, runs interleaved), on the
                   random-weight GGUFs `shapes` writes
    serve          the server's throughput at 1, 4 and 8 concurrent requests; serve_in_thread
    load           the serving load test (many clients, prefix cache, structured-output cost)
    speculative    greedy decode plain, drafted by a draft model and by prompt lookup
    train          training throughput against transformers

and what else measures:

    timing         the median of interleaved runs after a warm-up, a pause before each
    peer           llama.cpp through llama-cpp-python (the speed peer; never a dependency)
    shapes         random-weight GGUFs of real Llama shapes (Q4_0, Q4_K_M, Q8_0), cached
    perplexity     perplexity over a text file in windows, ours and llama.cpp's
                   (`torchllama perplexity`)
    kv_cache_size  KV-cache bytes per token and per context for every attention variant
                   (`torchllama kv-cache`)
"""
