"""Measurements of the model and its engine, side by side with peers.

    runs           decode / prefill throughput (ours, transformers, llama.cpp), the server
                   bench and the speculative-decoding bench
    load           the serving load test (many clients, prefix cache, structured-output cost)
    train          training throughput against transformers
    peer           llama.cpp through llama-cpp-python (the speed peer; never a dependency)
    perplexity     perplexity over a text file in windows, ours and llama.cpp's
    kv_cache_size  KV-cache bytes per token and per context for every attention variant
"""
