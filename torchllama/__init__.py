"""torchllama: a from-scratch PyTorch implementation of Llama 2 and the decoder-only models around it.

Python API::

    import torchllama
    model, tokenizer = torchllama.load()            # embedded SmolLM2-135M-Instruct (GGUF)
    print(torchllama.generate(model, tokenizer, "The capital of France is", max_new_tokens=16))
"""

from torchllama.checkpoint import (convert, default_model_path, load, load_tokenizer,
                                   read_model_args, save)
from torchllama.config import PRESETS, LayerSpec, ModelArgs, get_preset, read_model_config
from torchllama.errors import (ArgumentError, ContextLengthError, ModelFileError,
                               TorchLlamaError, TrainingError)
from torchllama.generation.session import (Session, encode_chat, encode_prompt, generate,
                                           llama2_chat_ids)
from torchllama.generation.sampling import SamplingParams, sample, token_logprobs
from torchllama.generation.stopping import StopStrings
from torchllama.generation.text import StreamDecoder, TextStream
from torchllama.serving.batch import Completion, generate_batch
from torchllama.bench.kv_cache_size import kv_bytes_per_token, kv_cache_bytes
from torchllama.model import Transformer
from torchllama.tokenizers import Tokenizer

__all__ = [
    "load", "save", "convert", "load_tokenizer", "default_model_path", "generate",
    "llama2_chat_ids", "generate_batch", "Completion", "token_logprobs", "StopStrings", "TextStream", "Session", "SamplingParams",
    "StreamDecoder", "encode_prompt", "encode_chat", "sample", "ModelArgs", "PRESETS",
    "get_preset", "Transformer", "Tokenizer", "TorchLlamaError", "ModelFileError",
    "ArgumentError", "ContextLengthError", "TrainingError", "LayerSpec", "read_model_config",
    "kv_cache_bytes", "kv_bytes_per_token", "read_model_args",
]
