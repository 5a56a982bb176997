"""Generation around the model: from prompt ids to sampled tokens to text.

    session      Session (prefill, then decode one token at a time on a KV cache), generate,
                 prompt and chat encoding, compile_decode
    steps        the two forward passes generation is made of: prefill and decode_one_token
    sampling     logits processors (penalties, bias, temperature, top-k, top-p, min-p) and sample
    text         TextStream: token ids → text deltas, cut at stop strings (StreamDecoder's
                 incremental detokenizing + StopStrings), for the CLI and the serving engine
    stopping     StopStrings: stop strings found across token boundaries
    speculative  drafters and the rejection sampler of exact speculative decoding
    grammar      structured output: token masks from llguidance

Nothing here imports the serving engine (`torchllama.serving` builds on this package).
"""
