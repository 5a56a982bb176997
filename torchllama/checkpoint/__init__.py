"""Checkpoints in, out and between formats: `load(path)` detects GGUF (llama.cpp), Meta
(`params.json` + `consolidated.*.pth`) or Hugging Face (`config.json` + safetensors) and returns
(model, tokenizer); `save` / `convert` write each format atomically.

Modules: common.py (dtypes, building the model, atomic outputs), gguf.py, meta.py, hf.py (one per
format; tensor names and config keys come from the family adapters in `torchllama.families`),
io.py (load, save, convert, load_tokenizer).
"""

from torchllama.checkpoint.common import (DEFAULT_MODEL_FILE, DEFAULT_MODEL_PACKAGE, DTYPES,
                                          atomic_output, build_model, default_model_path,
                                          detect_format, fsync_path, parse_dtype, resolve_dtype,
                                          resolve_model_path, resolve_run_folder)
from torchllama.checkpoint.io import (FORMATS, GGUF_TYPES, READERS, convert, load, load_tokenizer,
                                      read_model_args, save)

__all__ = ["DEFAULT_MODEL_FILE", "DEFAULT_MODEL_PACKAGE", "DTYPES", "FORMATS", "GGUF_TYPES",
           "READERS", "atomic_output", "build_model", "convert", "default_model_path",
           "detect_format", "fsync_path", "load", "parse_dtype", "load_tokenizer", "read_model_args",
           "resolve_dtype", "resolve_model_path", "resolve_run_folder", "save"]
