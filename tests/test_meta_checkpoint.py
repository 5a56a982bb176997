"""Meta checkpoints (params.json + consolidated.NN.pth + tokenizer.model): loading, shard merging,
dtypes, params.json parsing and every error a broken folder can cause.

Checkpoints are tiny random models written here in Meta's layout; shards are cut by this file's
own implementation of fairscale's split rules (not the loader's), so a wrong merge rule fails.
The tokenizer.model is Llama 2's vocabulary, rebuilt from the GGUF vocab in shared/testdata.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import warnings
from pathlib import Path

import pytest
import torch

import torchllama
from torchllama.checkpoint import meta
from torchllama.config import ModelArgs, get_preset
from torchllama.errors import ModelFileError
from torchllama.model import Transformer

# fairscale's model parallelism as Meta's llama/model.py uses it, written out independently of
# torchllama.checkpoint.meta: ColumnParallelLinear splits dim 0, RowParallelLinear and
# ParallelEmbedding dim 1, RMSNorm gains are replicated.
COLUMN_PARALLEL = ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
                   "feed_forward.w1.weight", "feed_forward.w3.weight", "output.weight")
ROW_PARALLEL = ("attention.wo.weight", "feed_forward.w2.weight", "tok_embeddings.weight")

SMALL = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, norm_eps=1e-5)
PROMPT = torch.tensor([[1, 15043, 3186, 29892, 920]])  # <s> Hello world , how


# ---- helpers -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sp_model(llama_spm_tokenizer) -> bytes:
    """Llama 2's SentencePiece tokenizer.model, serialized."""
    return llama_spm_tokenizer._sp.serialized_model_proto()


def random_state(args: ModelArgs, seed: int = 0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """A random Transformer's state dict (norm gains random too, so replication is visible)."""
    torch.manual_seed(seed)
    model = Transformer(args)
    state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    for n, t in state.items():
        if n.endswith("norm.weight"):
            t.copy_(1 + 0.1 * torch.randn_like(t))
    return {n: t.to(dtype) for n, t in state.items()}


def split_state(state: dict[str, torch.Tensor], n: int, head_dim: int) -> list[dict]:
    """Cut a full state dict into n model-parallel shards as Meta's checkpoints are cut, with the
    replicated `rope.freqs` Meta's files carry."""
    freqs = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    shards: list[dict] = [{} for _ in range(n)]
    for name, t in state.items():
        suffix = name.split(".", 2)[2] if name.startswith("layers.") else name
        if suffix in COLUMN_PARALLEL:
            pieces = t.chunk(n, dim=0)
        elif suffix in ROW_PARALLEL:
            pieces = t.chunk(n, dim=1)
        else:
            assert suffix.endswith("norm.weight"), name
            pieces = [t] * n
        assert all(p.shape == pieces[0].shape for p in pieces) and len(pieces) == n, name
        for shard, p in zip(shards, pieces):
            shard[name] = p.clone()  # clone: each file holds only its slice
    for shard in shards:
        shard["rope.freqs"] = freqs.to(next(iter(state.values())).dtype)
    return shards


def params_of(args: ModelArgs, vocab_size: int = -1, **extra) -> dict:
    """A params.json as Meta writes it (no hidden size, no max_seq_len, vocab_size -1)."""
    p = dict(dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads,
             multiple_of=args.multiple_of, norm_eps=args.norm_eps, vocab_size=vocab_size)
    if args.n_kv_heads != args.n_heads:
        p["n_kv_heads"] = args.n_kv_heads
    if args.ffn_dim_multiplier is not None:
        p["ffn_dim_multiplier"] = args.ffn_dim_multiplier
    p.update(extra)
    return p


def write_checkpoint(folder: Path, shards: list[dict], params: dict, sp_model: bytes | None,
                     tokenizer_in_parent: bool = False) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "params.json").write_text(json.dumps(params))
    for i, shard in enumerate(shards):
        torch.save(shard, folder / f"consolidated.{i:02d}.pth")
    if sp_model is not None:
        (folder.parent if tokenizer_in_parent else folder).joinpath("tokenizer.model") \
            .write_bytes(sp_model)
    return folder


def small_args(**changes) -> ModelArgs:
    return ModelArgs(**{**SMALL, "vocab_size": 32000, "max_seq_len": 4096, **changes})


@pytest.fixture
def checkpoint(tmp_path, sp_model):
    """(folder, args, state) of a valid 2-shard float32 checkpoint to break in error tests."""
    args = small_args()
    state = random_state(args)
    folder = write_checkpoint(tmp_path / "llama-2-tiny", split_state(state, 2, args.head_dim),
                              params_of(args), sp_model)
    return folder, args, state


def load_error(folder: Path) -> str:
    with pytest.raises(ModelFileError) as e:
        torchllama.load(folder, progress=False)
    return str(e.value)


def reference_logits(args: ModelArgs, state: dict[str, torch.Tensor]) -> torch.Tensor:
    model = Transformer(args)
    model.load_state_dict(state)
    with torch.no_grad():
        return model.eval()(PROMPT)


# ---- loading -----------------------------------------------------------------------------------


def test_single_shard_roundtrip(tmp_path, sp_model, capsys):
    args = small_args()
    state = random_state(args)
    folder = write_checkpoint(tmp_path / "llama-2-tiny", split_state(state, 1, args.head_dim),
                              params_of(args), sp_model, tokenizer_in_parent=True)

    model, tok = torchllama.load(folder, progress=True)
    assert "loading weights" in capsys.readouterr().err

    assert model.args == args  # vocab 32000 from the tokenizer, max_seq_len 4096 by default
    loaded = model.state_dict()
    assert loaded.keys() == state.keys()
    for name, t in state.items():
        assert loaded[name].dtype == torch.float32 and torch.equal(loaded[name], t), name
    with torch.no_grad():
        torch.testing.assert_close(model(PROMPT), reference_logits(args, state),
                                   rtol=1e-5, atol=1e-5)

    assert tok.encode("Hello world") == [15043, 3186]
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.vocab_size) == (1, 2, True, 32000)
    assert tok.source == str(tmp_path / "tokenizer.model")  # Meta's layout: one level up


def test_single_shard_in_target_dtype_is_memory_mapped(tmp_path, sp_model):
    """1 shard already in the target dtype: the loader returns the file's pages, no copy."""
    args = small_args()
    state = random_state(args, dtype=torch.bfloat16)
    folder = write_checkpoint(tmp_path / "m", split_state(state, 1, args.head_dim),
                              params_of(args), sp_model)
    _, loaded, _ = meta.read_meta(folder, torch.bfloat16, progress=False)
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("needs /proc/self/maps")
    shard = str(folder / "consolidated.00.pth")
    ranges = [tuple(int(x, 16) for x in line.split()[0].split("-"))
              for line in maps.read_text().splitlines() if line.endswith(shard)]
    assert ranges, "the shard is not memory-mapped"
    for name, t in loaded.items():
        assert any(lo <= t.data_ptr() < hi for lo, hi in ranges), f"{name} was copied"
        assert torch.equal(t, state[name])


@pytest.mark.parametrize("n_shards, shape", [
    (2, dict(n_heads=4, n_kv_heads=2)),                         # GQA
    (4, dict(n_heads=4, n_kv_heads=4)),                         # MHA
    (4, dict(n_heads=8, n_kv_heads=4)),                         # GQA, one kv head pair per shard
    (8, dict(dim=128, n_heads=16, n_kv_heads=8, multiple_of=64,
             ffn_dim_multiplier=1.3)),                          # 70B's pattern: 8 kv heads, 8 shards
], ids=["2-gqa", "4-mha", "4-gqa", "8-like-70b"])
def test_sharded_matches_unsharded(tmp_path, sp_model, n_shards, shape):
    args = small_args(**shape)
    state = random_state(args, seed=n_shards)
    folder = write_checkpoint(tmp_path / "m", split_state(state, n_shards, args.head_dim),
                              params_of(args), sp_model)
    assert len(list(folder.glob("consolidated.*.pth"))) == n_shards
    model, _ = torchllama.load(folder, progress=False)
    assert model.args == args
    loaded = model.state_dict()
    assert loaded.keys() == state.keys()
    for name, t in state.items():
        assert torch.equal(loaded[name], t), name
    with torch.no_grad():
        torch.testing.assert_close(model(PROMPT), reference_logits(args, state),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_shards", [1, 2], ids=["1-shard", "2-shards"])
@pytest.mark.parametrize("stored, target", [(torch.bfloat16, torch.float32),
                                            (torch.float32, torch.bfloat16),
                                            (torch.float32, torch.float16)],
                         ids=["bf16-to-f32", "f32-to-bf16", "f32-to-f16"])
def test_dtype_conversion_is_exact(tmp_path, sp_model, n_shards, stored, target):
    args = small_args()
    state = random_state(args, dtype=stored)
    folder = write_checkpoint(tmp_path / "m", split_state(state, n_shards, args.head_dim),
                              params_of(args), sp_model)
    model, _ = torchllama.load(folder, dtype=target, progress=False)
    loaded = model.state_dict()
    for name, t in state.items():
        assert loaded[name].dtype == target, name
        assert torch.equal(loaded[name], t.to(target)), name


def test_max_seq_len_from_params_and_override(tmp_path, sp_model):
    args = small_args(max_seq_len=256)
    state = random_state(args)
    folder = write_checkpoint(tmp_path / "m", split_state(state, 1, args.head_dim),
                              params_of(args, max_seq_len=256, max_batch_size=32), sp_model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # max_batch_size is a known, ignored field: no warning
        model, _ = torchllama.load(folder, progress=False)
    assert model.args == args
    model, _ = torchllama.load(folder, max_seq_len=64, progress=False)
    assert model.args.max_seq_len == 64 and model.rope[0].freqs_cis.shape[0] == 64


def test_unknown_params_field_warns_and_loads(tmp_path, sp_model):
    args = small_args()
    folder = write_checkpoint(tmp_path / "m", split_state(random_state(args), 1, args.head_dim),
                              params_of(args, some_future_field=3), sp_model)
    with pytest.warns(UserWarning, match=r"params\.json: ignoring unknown field\(s\) "
                                         r"'some_future_field'"):
        model, _ = torchllama.load(folder, progress=False)
    assert model.args == args


# ---- params.json → ModelArgs -------------------------------------------------------------------

# Meta's params.json of the Llama 2 releases, verbatim.
LLAMA2_PARAMS = {
    "llama2-7b": {"dim": 4096, "multiple_of": 256, "n_heads": 32, "n_layers": 32,
                  "norm_eps": 1e-05, "vocab_size": -1},
    "llama2-13b": {"dim": 5120, "multiple_of": 256, "n_heads": 40, "n_layers": 40,
                   "norm_eps": 1e-05, "vocab_size": -1},
    "llama2-70b": {"dim": 8192, "multiple_of": 4096, "ffn_dim_multiplier": 1.3, "n_heads": 64,
                   "n_kv_heads": 8, "n_layers": 80, "norm_eps": 1e-05, "vocab_size": -1},
}


@pytest.mark.parametrize("preset, hidden", [("llama2-7b", 11008), ("llama2-13b", 13824),
                                            ("llama2-70b", 28672)])
def test_llama2_params_match_presets(preset, hidden):
    args = meta.model_args_from_params(LLAMA2_PARAMS[preset], 32000, "params.json")
    assert args == get_preset(preset)
    assert args.ffn_hidden_dim == hidden and args.max_seq_len == 4096


def test_params_explicit_values():
    params = {**LLAMA2_PARAMS["llama2-7b"], "vocab_size": 32016, "rope_theta": 1e6,
              "ffn_dim_multiplier": None, "n_kv_heads": None, "use_scaled_rope": False}
    args = meta.model_args_from_params(params, 32000, "params.json", max_seq_len=16384)
    assert (args.vocab_size, args.rope_theta, args.n_kv_heads, args.max_seq_len) == \
        (32016, 1e6, 32, 16384)


@pytest.mark.parametrize("change, message", [
    ({"vocab_size": 31999}, r"vocab_size is 31999 but the tokenizer has 32000 tokens"),
    ({"dim": "4096"}, r"field 'dim' is \"4096\", expected an integer"),
    ({"norm_eps": True}, r"field 'norm_eps' is true, expected a number"),
    ({"n_heads": 33}, r"does not describe a valid model: .*n_heads \(33\) must divide dim"),
    ({"n_kv_heads": 5}, r"does not describe a valid model: .*n_kv_heads \(5\)"),
    ({"use_scaled_rope": "yes"}, r"field 'use_scaled_rope' is \"yes\", expected true or false"),
    ({"use_scaled_rope": True, "rope_scaling": {"type": "linear", "factor": 2.0}},
     r"both use_scaled_rope .* and rope_scaling are set"),
    ({"moe_args": {"num_experts": 16}}, r"moe_args=.* mixture of experts.*not supported yet"),
], ids=["vocab-too-small", "dim-str", "eps-bool", "heads", "kv-heads", "scaled-rope-str",
        "scaled-rope-and-rope-scaling", "moe"])
def test_params_errors(change, message):
    with pytest.raises(ModelFileError, match=r"^/x/params\.json: " + message):
        meta.model_args_from_params({**LLAMA2_PARAMS["llama2-7b"], **change}, 32000,
                                    "/x/params.json")


def test_params_vocab_from_tokenizer_needed():
    with pytest.raises(ModelFileError, match=r"vocab_size is -1 .* no tokenizer"):
        meta.model_args_from_params(LLAMA2_PARAMS["llama2-7b"], None, "params.json")


@pytest.mark.parametrize("field", meta.REQUIRED_FIELDS)
def test_missing_params_field(checkpoint, field):
    folder, args, _ = checkpoint
    params = params_of(args)
    del params[field]
    (folder / "params.json").write_text(json.dumps(params))
    assert load_error(folder) == f"{folder / 'params.json'}: required field {field!r} is missing"


@pytest.mark.parametrize("text, message", [
    ('{"dim": 64,', "invalid JSON"),
    ("[64, 2]", "expected a JSON object of hyperparameters, found a list"),
])
def test_bad_params_json(checkpoint, text, message):
    folder, _, _ = checkpoint
    (folder / "params.json").write_text(text)
    assert load_error(folder).startswith(f"{folder / 'params.json'}: {message}")


def test_use_scaled_rope_is_meta_llama3_scaling(checkpoint):
    # Llama 3.1+: the llama3 rule with the constants of Meta's apply_scaling (tests/test_llama3.py
    # compares the logits with transformers')
    folder, args, _ = checkpoint
    (folder / "params.json").write_text(json.dumps(params_of(args, use_scaled_rope=True)))
    assert torchllama.read_model_args(folder).rope_scaling == meta.META_ROPE_SCALING


# ---- broken weight files -----------------------------------------------------------------------


def test_no_weight_files(checkpoint):
    folder, _, _ = checkpoint
    for f in folder.glob("consolidated.*.pth"):
        f.unlink()
    assert load_error(folder).startswith(f"{folder}: no consolidated.*.pth weight files")


def test_missing_shard_in_numbering(checkpoint):
    folder, _, _ = checkpoint
    (folder / "consolidated.01.pth").rename(folder / "consolidated.02.pth")
    assert load_error(folder).startswith(f"{folder}: shard consolidated.01.pth is missing")


def test_shards_of_different_sizes(checkpoint):
    folder, args, state = checkpoint
    shards = split_state(state, 2, args.head_dim)
    name = "layers.1.feed_forward.w2.weight"
    shards[1][name] = shards[1][name][:, :-8].clone()
    torch.save(shards[1], folder / "consolidated.01.pth")
    msg = load_error(folder)
    assert msg == (f"shards of different sizes: tensor {name} has shape (64, 96) in "
                   f"{folder / 'consolidated.00.pth'} but (64, 88) in "
                   f"{folder / 'consolidated.01.pth'}")


def test_shards_with_different_tensors(checkpoint):
    folder, args, state = checkpoint
    shards = split_state(state, 2, args.head_dim)
    del shards[1]["layers.0.ffn_norm.weight"]
    torch.save(shards[1], folder / "consolidated.01.pth")
    assert load_error(folder) == (f"{folder}: shards hold different tensors: "
                                  "layers.0.ffn_norm.weight only in consolidated.00.pth")


def test_replicated_norms_must_agree(checkpoint):
    folder, args, state = checkpoint
    shards = split_state(state, 2, args.head_dim)
    shards[1]["norm.weight"] = shards[1]["norm.weight"] * 1.5
    torch.save(shards[1], folder / "consolidated.01.pth")
    msg = load_error(folder)
    assert msg.startswith(f"replicated tensor norm.weight differs between "
                          f"{folder / 'consolidated.00.pth'} and {folder / 'consolidated.01.pth'}")


def write_single(folder: Path, shard: dict) -> None:
    for f in folder.glob("consolidated.*.pth"):
        f.unlink()
    torch.save(shard, folder / "consolidated.00.pth")


def test_missing_tensor(checkpoint):
    folder, _, state = checkpoint
    write_single(folder, {n: t for n, t in state.items() if n != "layers.1.attention.wk.weight"})
    assert load_error(folder) == (f"{folder / 'consolidated.00.pth'}: missing tensors "
                                  "layers.1.attention.wk.weight")


def test_unexpected_tensor(checkpoint):
    folder, _, state = checkpoint
    write_single(folder, {**state, "layers.2.attention.wq.weight": torch.zeros(64, 64)})
    assert load_error(folder) == (f"{folder / 'consolidated.00.pth'}: unexpected tensors "
                                  "layers.2.attention.wq.weight")


def test_params_dim_does_not_match_weights(checkpoint):
    folder, args, _ = checkpoint
    (folder / "params.json").write_text(json.dumps(params_of(args, dim=128)))
    msg = load_error(folder)
    assert msg.startswith(f"{folder} (consolidated.00.pth ... consolidated.01.pth): tensor "
                          "tok_embeddings.weight has shape (32000, 64) (merged from 2 shards), "
                          f"expected (32000, 128) from {folder / 'params.json'}")


@pytest.mark.parametrize("field, value, message", [
    ("dim", 10**12, r"dim=1000000000000, .* describe 2\.2e\+25 parameters, more than any"),
    ("vocab_size", 10**13, r"vocab_size=10000000000000, .* parameters, more than any"),
    ("multiple_of", 10**15, r"hidden size 1000000000000000 describe .* parameters"),
    ("n_layers", 10**6, r"n_layers=1000000, more than any model \(4096\)"),
])
def test_inflated_params_are_a_clear_error(checkpoint, field, value, message):
    # were: RuntimeError "Storage size calculation overflowed" (dim), or minutes building a
    # million layers on the meta device (n_layers)
    folder, args, _ = checkpoint
    (folder / "params.json").write_text(json.dumps(params_of(args, **{field: value})))
    msg = load_error(folder)
    assert msg.startswith(f"{folder / 'params.json'}: ")
    assert re.search(message, msg), msg


def test_params_hidden_size_does_not_match_weights(checkpoint):
    folder, args, _ = checkpoint
    (folder / "params.json").write_text(json.dumps(params_of(args, multiple_of=256)))
    msg = load_error(folder)
    assert "tensor layers.0.feed_forward.w1.weight has 192 rows (merged from 2 shards)" in msg
    assert "gives a SwiGLU hidden size of 256 (Meta's rule from dim=64, multiple_of=256" in msg


def test_truncated_shard(checkpoint):
    folder, _, _ = checkpoint
    f = folder / "consolidated.01.pth"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) * 2 // 3])
    assert load_error(folder).startswith(f"{f}: truncated or corrupt checkpoint")


@pytest.mark.parametrize("content, message", [
    (b"", "empty file"),
    (b"\x80\x02}q\x00.", "not a PyTorch checkpoint in torch.save's zip format"),
])
def test_not_a_checkpoint(checkpoint, content, message):
    folder, _, _ = checkpoint
    (folder / "consolidated.00.pth").write_bytes(content)
    assert load_error(folder).startswith(f"{folder / 'consolidated.00.pth'}: {message}")


def test_not_a_dict_of_tensors(checkpoint):
    folder, _, state = checkpoint
    write_single(folder, {**state, "step": 1000})
    assert load_error(folder) == (f"{folder / 'consolidated.00.pth'}: entry 'step' is not a "
                                  "tensor under a str name (found int)")


class _Payload:
    """Unpickling this calls os.system: it would create the marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def test_malicious_pickle_is_refused_and_not_run(checkpoint):
    folder, _, state = checkpoint
    marker = folder / "pwned"
    write_single(folder, {**state, "tok_embeddings.weight": _Payload(marker)})
    msg = load_error(folder)
    assert msg.startswith(f"{folder / 'consolidated.00.pth'}: refused to load")
    assert "would run code" in msg
    assert not marker.exists()
    # The payload is real: an unsafe load would have run it.
    torch.load(folder / "consolidated.00.pth", weights_only=False)
    assert marker.exists()


# ---- tokenizer ---------------------------------------------------------------------------------


def test_no_tokenizer(checkpoint):
    folder, _, _ = checkpoint
    (folder / "tokenizer.model").unlink()
    assert load_error(folder) == f"{folder}: no tokenizer.model in {folder} or its parent"
    # A tokenizer.json (what convert --to meta writes for BPE vocabularies) is read instead.
    (folder / "tokenizer.json").write_text("{}")
    assert "not a valid Hugging Face tokenizer.json" in load_error(folder)


def test_tiktoken_tokenizer_is_read(checkpoint):
    # Llama 3's tokenizer.model (tests/test_llama3.py): a text file is read as tiktoken's format
    folder, _, _ = checkpoint
    (folder / "tokenizer.model").write_text("IQ== 0\nIg== 1\nIw== 2\n")
    assert load_error(folder) == (f"{folder / 'tokenizer.model'}: not a byte-level BPE "
                                  "vocabulary: 253 single bytes have no token (first: 0x00)")


def test_folder_tokenizer_wins_over_parent(checkpoint, tmp_path):
    folder, _, _ = checkpoint
    (tmp_path / "tokenizer.model").write_bytes(b"not used")
    _, tok = torchllama.load(folder, progress=False)
    assert tok.source == str(folder / "tokenizer.model")
