"""One module per API surface, each a translation between its protocol and the one request
path (`core`): no API has a generation loop of its own.

    core          the request path (Generation → Run of Choices → Updates / Outputs), errors,
                  the shapes the OpenAI APIs share
    chat          OpenAI's chat completions
    completions   OpenAI's completions (prompt scoring: echo with logprobs, max_tokens 0)
    responses     OpenAI's Responses API (and its in-memory store)
    messages      Anthropic's Messages API (and count_tokens)
    embeddings    OpenAI's embeddings
    tokenization  vLLM's /tokenize, /detokenize, /tokenizer_info
    adapters      vLLM's runtime LoRA adapter endpoints

Protocol modules never import each other; what they share lives in `core`.
"""
