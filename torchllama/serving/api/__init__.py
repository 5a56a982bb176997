"""One module per API surface, each a translation between its protocol and the one request
path (`core`): no API has a generation loop of its own.

    core          the request path (Generation → Run of Choices → Updates / Outputs), errors,
                  the shapes the OpenAI APIs share
    chat          OpenAI's chat completions
    completions   OpenAI's completions
    embeddings    OpenAI's embeddings
    adapters      vLLM's runtime LoRA adapter endpoints

Protocol modules never import each other; what they share lives in `core`.
"""
