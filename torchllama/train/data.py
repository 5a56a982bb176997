"""Training data: a SentencePiece tokenizer trained with Llama 2's settings, token files, batches.

    torchllama train-tokenizer --input TEXTS... --vocab-size 4096 --out tok/
        → tok/tokenizer.model (SentencePiece BPE, trained by the `sentencepiece` library)
    torchllama prepare-data --input TEXTS... --tokenizer tok/tokenizer.model --out data/
        → data/train.bin, data/val.bin    flat token ids (uint16 when the vocabulary fits, else
                                          uint32), documents as [BOS] text [EOS], concatenated
          data/meta.json                   tokenizer path + SHA-256, inputs, token counts,
                                          checksums of the .bin files

Each input file is one document; the validation split is a set of whole documents (a seeded
shuffle of the files, taken until `val_fraction` of the tokens), so no text is in both splits. A
single input file is cut at a line break into a training head and a validation tail (nanoGPT's
split of input.txt).

Batches (`TokenBatches`) are a pure function of (seed, micro-step index): epoch e visits the
windows tokens[o_e + k·T : o_e + k·T + T + 1], k = 0..n-1, in a seeded random order, with a seeded
random offset o_e ∈ [0, T). Resuming at a micro-step therefore needs only that index, and each
rank of a distributed run takes its own rows of the same global batch.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np
import torch

from torchllama.errors import ArgumentError, ModelFileError

DATA_FORMAT = "torchllama-tokens"
DATA_VERSION = 1
SPLITS = ("train", "val")


# --------------------------------------------------------------------------------------------
# Inputs and files
# --------------------------------------------------------------------------------------------

def expand_inputs(inputs: Sequence[str | os.PathLike], what: str = "--input") -> list[Path]:
    """Text files from files and folders (a folder contributes its *.txt files, sorted).

    Raises:
        ArgumentError: nothing given, a path that does not exist, or a folder without .txt files.
    """
    if not inputs:
        raise ArgumentError(f"{what}: no input files given")
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.glob("*.txt") if p.is_file())
            if not found:
                raise ArgumentError(f"{what}: folder {path} has no .txt files")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise ArgumentError(f"{what}: {path} does not exist")
    unique, seen = [], set()
    for path in files:                       # a file given twice is one document
        if path.resolve() not in seen:
            seen.add(path.resolve())
            unique.append(path)
    return unique


def read_text(path: Path) -> str:
    """A UTF-8 text file's contents (a BOM is dropped; line endings are kept as they are).

    Raises:
        ArgumentError: the file cannot be read or is not UTF-8.
    """
    try:
        return path.read_bytes().decode("utf-8-sig")
    except OSError as e:
        raise ArgumentError(f"--input: cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ArgumentError(f"--input: {path} is not UTF-8 text ({e.reason} at byte "
                            f"{e.start})") from None


TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "chat_template.jinja", "generation_config.json")


def tokenizer_sha256(path: str | os.PathLike) -> str:
    """SHA-256 identifying a tokenizer: of the file, or for a model folder of its tokenizer
    files (TOKENIZER_FILES that exist, by name and content).

    Raises:
        ModelFileError: a folder without tokenizer.model or tokenizer.json.
    """
    path = Path(path)
    if not path.is_dir():
        return sha256_file(path)
    present = [name for name in TOKENIZER_FILES if (path / name).is_file()]
    if not {"tokenizer.model", "tokenizer.json"} & set(present):
        raise ModelFileError(f"{path}: no tokenizer.model or tokenizer.json in the folder")
    digest = hashlib.sha256()
    for name in present:
        digest.update(name.encode() + b"\0" + sha256_file(path / name).encode())
    return digest.hexdigest()


def sha256_file(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------
# train-tokenizer
# --------------------------------------------------------------------------------------------

# Llama 2's tokenizer.model trainer_spec (read from Meta's file): BPE with byte fallback, digits
# split, no normalisation, a dummy prefix space, whitespace kept; UNK 0, BOS 1, EOS 2, no PAD.
LLAMA2_TRAINER_SPEC = dict(
    model_type="bpe", byte_fallback=True, split_digits=True, normalization_rule_name="identity",
    add_dummy_prefix=True, remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
    split_by_unicode_script=True, split_by_whitespace=True, max_sentencepiece_length=16,
    character_coverage=0.99995, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
    unk_surface=" \u2047 ",
)


def train_tokenizer(inputs: Sequence[str | os.PathLike], vocab_size: int,
                    out: str | os.PathLike, *, force: bool = False,
                    max_lines: int = 2_000_000) -> Path:
    """Train a SentencePiece BPE tokenizer with Llama 2's settings on text files.

    The `sentencepiece` trainer sees the inputs line by line (newlines are then encoded by byte
    fallback as <0x0A>, as in Llama 2). The model is written atomically to OUT/tokenizer.model
    and loads with `SentencePieceTokenizer.from_file` exactly like Meta's.

    Args:
        inputs: text files or folders of .txt files.
        vocab_size: number of pieces, including the 3 control pieces and the 256 byte pieces.
        out: output folder (created).
        force: replace an existing OUT/tokenizer.model.
        max_lines: at most this many (randomly chosen) lines are used for training.

    Returns:
        Path of the written tokenizer.model.

    Raises:
        ArgumentError: missing inputs, an existing tokenizer without `force`, or a vocabulary
            size the text cannot fill (the message gives sentencepiece's limit).
    """
    import sentencepiece as spm

    files = expand_inputs(inputs)
    if vocab_size < 260:
        raise ArgumentError(f"--vocab-size must be ≥ 260 (3 control + 256 byte pieces + some "
                            f"merges), got {vocab_size}")
    out = Path(out)
    dst = out / "tokenizer.model"
    if dst.exists() and not force:
        raise ArgumentError(f"{dst} already exists; pass --force to replace it")

    def lines() -> Iterable[str]:
        for path in files:
            yield from read_text(path).splitlines()

    from torchllama.checkpoint import atomic_output

    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=lines(), model_writer=model, vocab_size=vocab_size,
            input_sentence_size=max_lines, shuffle_input_sentence=True,
            num_threads=os.cpu_count() or 1, minloglevel=2, **LLAMA2_TRAINER_SPEC)
    except RuntimeError as e:
        raise ArgumentError(f"sentencepiece could not train a {vocab_size}-piece vocabulary on "
                            f"{len(files)} file(s): {e}") from None
    out.mkdir(parents=True, exist_ok=True)
    with atomic_output(dst, folder=False, force=True) as tmp:
        tmp.write_bytes(model.getvalue())
    return dst


# --------------------------------------------------------------------------------------------
# prepare-data
# --------------------------------------------------------------------------------------------

#: A document: (file, its characters [start, end), or None for all of them).
Piece = tuple[str, Optional[tuple[int, int]]]

_worker_tokenizer = None


def _init_worker(tokenizer_path: str) -> None:
    global _worker_tokenizer
    torch.set_num_threads(1)
    from torchllama.checkpoint import load_tokenizer
    _worker_tokenizer = load_tokenizer(tokenizer_path)


def _encode_document(piece: Piece) -> list[int]:
    """[BOS] + ids of a document + [EOS], in a worker process. A document is a file's text, or
    the characters [start, end) of it."""
    tok = _worker_tokenizer
    path, span = piece
    text = read_text(Path(path))
    ids = tok.encode(text if span is None else text[span[0]:span[1]])
    return ([tok.bos_id] if tok.bos_id is not None else []) + ids + (
        [tok.eos_id] if tok.eos_id is not None else [])


def _inputs_record(files: list[Path]) -> list[dict]:
    return [{"path": str(p.resolve()), "bytes": p.stat().st_size, "sha256": sha256_file(p)}
            for p in files]


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size ≤ 65536), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def prepare_data(inputs: Sequence[str | os.PathLike], tokenizer: str | os.PathLike,
                 out: str | os.PathLike, *, val_fraction: float = 0.1, seed: int = 0,
                 workers: Optional[int] = None, force: bool = False,
                 progress: bool = True) -> dict:
    """Tokenize text files into train.bin / val.bin token files and meta.json.

    Idempotent: when OUT already holds a dataset made from the same input files (same bytes),
    tokenizer (same SHA-256), val_fraction and seed, and its .bin files are intact, nothing is
    redone. Otherwise an existing OUT is only replaced with `force`. The dataset is written in a
    temporary folder next to OUT and renamed into place.

    Args:
        inputs: text files or folders of .txt files; each file is one document (a single file
            with val_fraction > 0 is cut at a line break into a training head and a
            validation tail).
        tokenizer: a tokenizer.model, tokenizer.json, model folder or GGUF file.
        out: the dataset folder.
        val_fraction: share of tokens, in whole documents, held out for validation (0 ≤ F < 1).
        seed: seed of the shuffle that picks the validation documents.
        workers: tokenizer processes (default: the number of CPUs).
        force: replace an existing, different (or damaged) dataset in OUT; a folder that is not
            a dataset (no meta.json) is never replaced.
        progress: show a progress bar.

    Returns:
        The dataset's metadata (the contents of meta.json).

    Raises:
        ArgumentError: bad arguments, unreadable inputs, too few documents for a validation
            split, an existing different dataset without `force`.
        ModelFileError: the tokenizer cannot be loaded.
    """
    from torchllama.checkpoint import load_tokenizer

    if not 0 <= val_fraction < 1:
        raise ArgumentError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    files = expand_inputs(inputs)
    pieces = _documents(files, val_fraction)
    if workers is not None and workers < 1:
        raise ArgumentError(f"--workers must be ≥ 1, got {workers}")
    tokenizer = Path(tokenizer)
    tok = load_tokenizer(tokenizer)                        # fails early on a bad tokenizer
    settings = {"tokenizer": {"path": str(tokenizer.resolve()),
                              "sha256": tokenizer_sha256(tokenizer),
                              "vocab_size": tok.vocab_size, "bos_id": tok.bos_id,
                              "eos_id": tok.eos_id},
                "inputs": _inputs_record(files), "val_fraction": val_fraction, "seed": seed}
    out = Path(out)
    existing = _up_to_date_dataset(out, settings, force)
    if existing is not None:
        if progress:
            print(f"{out}: up to date ({existing['splits']['train']['tokens']:,} train tokens)")
        return existing
    dtype = token_dtype(tok.vocab_size)
    ids = _tokenize(pieces, tokenizer, dtype, workers or os.cpu_count() or 1, progress)
    val_docs = {1} if len(files) == 1 and len(pieces) == 2 else \
        _validation_documents(ids, val_fraction, seed)
    meta = _write_dataset(out, pieces, ids, val_docs, settings, dtype)
    if progress:
        splits = meta["splits"]
        print(f"{out}: {splits['train']['tokens']:,} train tokens "
              f"({len(splits['train']['documents'])} documents), {splits['val']['tokens']:,} "
              f"val tokens ({len(splits['val']['documents'])} documents), {dtype.name}")
    return meta


def _documents(files: list[Path], val_fraction: float) -> list[Piece]:
    """The documents: one per file. A single file with a validation split is cut in two at the
    line break nearest to (1 − val_fraction) of its characters, as nanoGPT splits input.txt:
    the head is the training document, the tail the validation one.

    Raises:
        ArgumentError: that single file has no line break to cut at.
    """
    if not (val_fraction > 0 and len(files) == 1):
        return [(str(f), None) for f in files]
    text = read_text(files[0])
    cut = text.rfind("\n", 0, int((1 - val_fraction) * len(text))) + 1
    if not 0 < cut < len(text):
        raise ArgumentError(f"--input {files[0]}: too short to hold out {val_fraction:.0%} "
                            "of it at a line break; pass --val-fraction 0 or more text")
    return [(str(files[0]), (0, cut)), (str(files[0]), (cut, len(text)))]


def _up_to_date_dataset(out: Path, settings: dict, force: bool) -> Optional[dict]:
    """The meta.json of the dataset in `out` when it was made with these settings and is
    intact (nothing to redo), else None (`out` is missing, empty, or replaceable with force).

    Raises:
        ArgumentError: `out` is a file or a folder that is not a dataset, or holds another (or a
            damaged) dataset and `force` is not given.
    """
    if out.exists() and not out.is_dir():
        raise ArgumentError(f"--out {out} is a file, not a folder")
    if not (out.exists() and any(out.iterdir())):
        return None
    if not _looks_like_dataset(out):
        raise ArgumentError(f"--out {out} is a folder that is not a torchllama dataset; choose "
                            "another --out (prepare-data only ever replaces a dataset)")
    try:
        existing = read_meta(out)
        verify_data(out, existing)
    except ModelFileError:
        existing = None
    if existing is not None and all(existing.get(k) == v for k, v in settings.items()):
        return existing
    if not force:
        raise ArgumentError(f"{out} already exists and holds another dataset (or a damaged "
                            "one); pass --force to replace it")
    return None


def _tokenize(pieces: list[Piece], tokenizer: Path, dtype: np.dtype, workers: int,
              progress: bool) -> list[np.ndarray]:
    """[BOS] ids [EOS] of every document, (n_i,) `dtype` each, tokenized by `workers`
    processes."""
    from tqdm import tqdm

    ids: list[np.ndarray] = [None] * len(pieces)                # type: ignore[list-item]
    bar = tqdm(total=len(pieces), unit="doc", desc="tokenizing", disable=not progress)
    with ProcessPoolExecutor(workers, initializer=_init_worker,
                             initargs=(str(tokenizer),)) as pool:
        for i, doc in enumerate(pool.map(_encode_document, pieces)):
            ids[i] = np.asarray(doc, dtype=dtype)
            bar.update(1)
    bar.close()
    return ids


def _validation_documents(ids: list[np.ndarray], val_fraction: float, seed: int) -> set[int]:
    """Indices of the validation documents: a seeded shuffle of the documents, taken until
    val_fraction of the tokens (at least one document is left for training)."""
    total = sum(len(a) for a in ids)
    order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed)).tolist()
    val_docs: set[int] = set()
    val_tokens = 0
    for i in order:
        if val_tokens >= val_fraction * total or len(val_docs) == len(ids) - 1:
            break
        val_docs.add(i)
        val_tokens += len(ids[i])
    return val_docs


def _document_name(piece: Piece) -> str:
    """A document as meta.json lists it: the resolved path, with its character span."""
    path, span = piece
    resolved = str(Path(path).resolve())
    return resolved if span is None else f"{resolved} [characters {span[0]}:{span[1]}]"


def _write_dataset(out: Path, pieces: list[Piece], ids: list[np.ndarray], val_docs: set[int],
                   settings: dict, dtype: np.dtype) -> dict:
    """Write train.bin, val.bin and meta.json into a temporary folder renamed to `out`
    (replacing it: checked by the caller); returns the metadata."""
    from torchllama.checkpoint import atomic_output

    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(out, folder=True, force=True) as tmp:
        splits = {}
        for split in SPLITS:
            docs = [i for i in range(len(pieces)) if (i in val_docs) == (split == "val")]
            path = tmp / f"{split}.bin"
            with open(path, "wb") as f:
                for i in docs:
                    f.write(ids[i].tobytes())
            splits[split] = {"file": path.name, "tokens": int(sum(len(ids[i]) for i in docs)),
                             "documents": [_document_name(pieces[i]) for i in docs],
                             "sha256": sha256_file(path)}
        meta = {"format": DATA_FORMAT, "version": DATA_VERSION, **settings,
                "dtype": dtype.name, "splits": splits}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def _looks_like_dataset(folder: Path) -> bool:
    """A folder prepare-data made: its meta.json says so, or (damaged meta.json) it holds a
    train.bin. Only such folders are ever replaced."""
    try:
        return json.loads((folder / "meta.json").read_text()).get("format") == DATA_FORMAT
    except (OSError, ValueError, AttributeError):
        return (folder / "meta.json").is_file() and (folder / "train.bin").is_file()


def read_meta(folder: str | os.PathLike) -> dict:
    """The meta.json of a dataset folder, checked for its format and fields.

    Raises:
        ModelFileError: missing folder or meta.json, not JSON, or not a torchllama dataset.
    """
    folder = Path(folder)
    path = folder / "meta.json"
    if not folder.is_dir():
        raise ModelFileError(f"--data: {folder} is not a folder (make one with "
                             "`torchllama prepare-data`)")
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelFileError(f"{path} is missing: {folder} is not a dataset made by "
                             "`torchllama prepare-data`") from None
    except (OSError, ValueError) as e:
        raise ModelFileError(f"{path}: cannot read it as JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != DATA_FORMAT:
        raise ModelFileError(f"{path}: not a torchllama dataset (format {DATA_FORMAT!r})")
    if meta.get("version") != DATA_VERSION:
        raise ModelFileError(f"{path}: dataset version {meta.get('version')!r}, expected "
                             f"{DATA_VERSION}; run `torchllama prepare-data --force` again")
    try:
        np.dtype(meta["dtype"])
        for split in SPLITS:
            info = meta["splits"][split]
            int(info["tokens"]), str(info["file"]), str(info["sha256"])
        str(meta["tokenizer"]["sha256"]), int(meta["tokenizer"]["vocab_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise ModelFileError(f"{path}: malformed dataset metadata ({type(e).__name__}: {e})"
                             ) from None
    return meta


def verify_data(folder: str | os.PathLike, meta: dict) -> None:
    """Check that the .bin files have the size and SHA-256 recorded in meta.json.

    Raises:
        ModelFileError: a missing, truncated, grown or altered token file.
    """
    folder = Path(folder)
    itemsize = np.dtype(meta["dtype"]).itemsize
    for split in SPLITS:
        info = meta["splits"][split]
        path = folder / info["file"]
        if not path.is_file():
            raise ModelFileError(f"{path} is missing; run `torchllama prepare-data` again")
        size, expected = path.stat().st_size, info["tokens"] * itemsize
        if size != expected:
            raise ModelFileError(f"{path} is {size} bytes, expected {expected} "
                                 f"({info['tokens']} tokens): the dataset is damaged; run "
                                 "`torchllama prepare-data --force` again")
        if sha256_file(path) != info["sha256"]:
            raise ModelFileError(f"{path}: checksum differs from meta.json: the dataset is "
                                 "damaged; run `torchllama prepare-data --force` again")


def load_tokens(folder: str | os.PathLike, split: str, meta: Optional[dict] = None) -> np.ndarray:
    """A split's token ids as a read-only memory map (N,) uint16/uint32, after `verify_data`."""
    meta = meta or read_meta(folder)
    path = Path(folder) / meta["splits"][split]["file"]
    if meta["splits"][split]["tokens"] == 0:
        return np.zeros(0, dtype=meta["dtype"])
    return np.memmap(path, dtype=np.dtype(meta["dtype"]), mode="r")


# --------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------

class TokenBatches:
    """Training windows of a flat token array, addressed by micro-step index (see module doc).

    Args:
        tokens: (N,) token ids.
        seq_len: T; each row holds T + 1 ids (inputs are row[:-1], targets row[1:]).
        batch_size: rows per rank per micro-step (B).
        seed: seed of the window order.
        rank, world_size: this process's share: rows rank·B .. rank·B + B − 1 of each global
            batch of world_size·B rows.

    Raises:
        ArgumentError: fewer than 2·T tokens.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int,
                 rank: int = 0, world_size: int = 1):
        if len(tokens) < 2 * seq_len:
            raise ArgumentError(f"the training split has {len(tokens)} tokens, too few for "
                                f"--seq-len {seq_len} (need at least {2 * seq_len})")
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.windows_per_epoch = (len(tokens) - seq_len) // seq_len
        self._epoch: Optional[tuple[int, int, torch.Tensor]] = None

    def _order(self, epoch: int) -> tuple[int, torch.Tensor]:
        if self._epoch is None or self._epoch[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            offset = int(torch.randint(0, self.seq_len, (1,), generator=g))
            self._epoch = (epoch, offset, torch.randperm(self.windows_per_epoch, generator=g))
        return self._epoch[1], self._epoch[2]

    def epoch_of(self, micro_step: int) -> float:
        """Epochs completed (fractional) after `micro_step` micro-steps."""
        return micro_step * self.world_size * self.batch_size / self.windows_per_epoch

    def batch(self, micro_step: int) -> torch.Tensor:
        """This rank's rows of global micro-batch `micro_step`: (B, T + 1) int64."""
        T, B = self.seq_len, self.batch_size
        first = (micro_step * self.world_size + self.rank) * B      # global window index
        rows = []
        for g in range(first, first + B):
            epoch, k = divmod(g, self.windows_per_epoch)
            offset, order = self._order(epoch)
            start = offset + int(order[k]) * T
            rows.append(torch.from_numpy(self.tokens[start:start + T + 1].astype(np.int64)))
        return torch.stack(rows)                                    # (B, T + 1)


def unigram_loss(train: np.ndarray, val: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy (nats/token) of the validation tokens under the training split's token
    frequencies (add-one smoothed): the loss of a model that ignores context, the baseline a
    trained model must beat."""
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64) + 1.0   # (V,)
    log_p = np.log(counts / counts.sum())                                       # (V,)
    return float(-log_p[val].mean()) if len(val) else float("nan")


def eval_windows(tokens: np.ndarray, seq_len: int, n_rows: int) -> torch.Tensor:
    """`n_rows` (or as many as fit) fixed windows spread evenly over a split: (n, T + 1) int64.
    The same windows at every evaluation, so validation losses are comparable."""
    n_fit = (len(tokens) - 1) // seq_len
    n = min(n_rows, n_fit)
    if n == 0:
        return torch.zeros(0, seq_len + 1, dtype=torch.int64)
    starts = np.linspace(0, (n_fit - 1) * seq_len, n).astype(np.int64)
    return torch.stack([torch.from_numpy(tokens[s:s + seq_len + 1].astype(np.int64))
                        for s in starts])
