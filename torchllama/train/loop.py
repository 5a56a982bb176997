"""The training loop: minimise next-token cross-entropy with AdamW, evaluate, sample, checkpoint.

One optimizer step:

    for k in 0..grad_accum-1:                        micro-step m = step·grad_accum + k
        x = batch(m)                                 (B, T+1) ids: this rank's rows
        loss_k = model(x[:, :-1], targets=x[:, 1:])  mean cross-entropy over B·T tokens, the
                                                     output layer fused with the loss
                                                     (bf16 autocast inside with --dtype bfloat16)
        backward(loss_k / grad_accum)                gradients summed over micro-steps; DDP/FSDP
                                                     average them over ranks on the last one
    clip ‖g‖₂ to grad_clip; lr = lr_at(step); AdamW step

so the gradient is that of the mean loss over the global batch of
world_size · grad_accum · B · T tokens, whatever the split into processes and micro-steps.

Runs are exactly reproducible on the CPU: the initial weights come from `seed`, batches are a
pure function of (seed, micro-step), the learning rate a pure function of the step, and the only
other randomness (text samples at evaluations) uses its own generator seeded by (seed, step).
A resumed run restores weights, optimizer moments, step and RNG states, and so continues with the
same losses, bit for bit, as a run that never stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from torchllama.checkpoint import atomic_output
from torchllama.config import ModelArgs, get_preset, read_model_config
from torchllama.errors import ArgumentError, ModelFileError, TrainingError
from torchllama.model import Transformer
from torchllama.train import checkpointing as ckpt_io
from torchllama.train.data import (eval_windows, load_tokens, read_meta, sha256_file,
                                   tokenizer_sha256, TokenBatches, unigram_loss, verify_data)
from torchllama.train.distributed import (DistContext, all_reduce_mean, all_reduce_sum,
                                          apply_activation_checkpointing, barrier,
                                          gradient_sync, init_distributed, shutdown_distributed,
                                          unwrap, wrap_model)
from torchllama.train.optim import count_params, flops_per_token, init_weights, lr_at, \
    make_optimizer
from torchllama.train.plot import read_log

LOG_FILE = "log.jsonl"
PLOT_FILE = "loss.png"


@dataclass(kw_only=True)
class TrainConfig:
    """Settings of a training run (the options of `torchllama train`).

    Attributes:
        data: dataset folder from `torchllama prepare-data`.
        out: run folder (log.jsonl, loss.png, step-* checkpoints, latest).
        preset: model preset name (its vocab_size is replaced by the tokenizer's).
        config: YAML or JSON file of ModelArgs fields (instead of a preset).
        max_steps: optimizer steps to train for.
        batch_size: sequences per micro-step per process (B).
        seq_len: tokens per sequence (T; default: the model's max_seq_len).
        grad_accum: micro-steps per optimizer step.
        batch_tokens: global batch in tokens; sets grad_accum = batch_tokens / (world·B·T).
        lr: peak learning rate.
        min_lr: final learning rate of the cosine schedule (default lr / 10).
        warmup_steps: linear warmup steps (default: 10% of max_steps, at most 1000).
        weight_decay: AdamW decoupled weight decay on the linear weight matrices.
        grad_clip: maximum global gradient L2 norm (0 = no clipping).
        eval_every: evaluate (validation loss, perplexity, text samples) every N steps.
        eval_batches: validation batches (of world·B sequences) per evaluation.
        save_every: checkpoint every N steps (default: eval_every), and at the end.
        keep: number of newest checkpoints kept.
        seed: seed of the initial weights, the batch order and the samples.
        resume: continue the run in `out` from its latest checkpoint, with its model and
            options (options given again with other values replace the saved ones).
        dtype: float32, or bfloat16 (autocast; float32 master weights); auto = bfloat16 on
            GPUs that support it, else float32.
        compile: torch.compile the model.
        device: cpu, cuda, cuda:N or auto.
        parallel: ddp or fsdp, under torchrun.
        activation_checkpointing: recompute each block's activations in backward.
        sample_prompt: text the samples at each evaluation start from (default: BOS only).
        sample_tokens: tokens sampled at each evaluation (0 = no samples).
        peak_tflops: the device's peak dense TFLOP/s for MFU (default: a table for known GPUs,
            a measured matmul rate on CPUs).
        progress: show a progress bar (rank 0).
    """

    data: str
    out: str
    preset: Optional[str] = None
    config: Optional[str] = None
    max_steps: int = 1000
    batch_size: int = 8
    seq_len: Optional[int] = None
    grad_accum: int = 1
    batch_tokens: Optional[int] = None
    lr: float = 1e-3
    min_lr: Optional[float] = None
    warmup_steps: Optional[int] = None
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_batches: int = 10
    save_every: Optional[int] = None
    keep: int = 3
    seed: int = 1337
    resume: bool = False
    dtype: str = "auto"
    compile: bool = False
    device: str = "auto"
    parallel: str = "ddp"
    activation_checkpointing: bool = False
    sample_prompt: Optional[str] = None
    sample_tokens: int = 64
    peak_tflops: Optional[float] = None
    progress: bool = True

    def check(self) -> None:
        """Raises ArgumentError naming the option that is out of range."""
        for name in ("max_steps", "batch_size", "grad_accum", "eval_every", "eval_batches",
                     "keep"):
            if getattr(self, name) < 1:
                raise ArgumentError(f"--{name.replace('_', '-')} must be ≥ 1, got "
                                    f"{getattr(self, name)}")
        for name in ("seq_len", "batch_tokens", "save_every"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ArgumentError(f"--{name.replace('_', '-')} must be ≥ 1, got {value}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ArgumentError(f"--lr must be a positive number, got {self.lr}")
        if self.min_lr is not None and not 0 <= self.min_lr <= self.lr:
            raise ArgumentError(f"--min-lr must be in [0, lr], got {self.min_lr}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ArgumentError(f"--warmup-steps must be ≥ 0, got {self.warmup_steps}")
        if not (self.weight_decay >= 0 and self.grad_clip >= 0 and self.sample_tokens >= 0
                and math.isfinite(self.weight_decay) and math.isfinite(self.grad_clip)):
            raise ArgumentError("--weight-decay, --grad-clip and --sample-tokens must be finite "
                                "and ≥ 0")
        if self.batch_tokens is not None and self.grad_accum != 1:
            raise ArgumentError("give --grad-accum or --batch-tokens (which sets grad_accum), "
                                "not both")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ArgumentError(f"--dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        if (self.preset is None) == (self.config is None) and not self.resume:
            raise ArgumentError("give the model as --preset NAME or --config FILE (one of them)")
        if self.preset is not None and self.config is not None:
            raise ArgumentError("give --preset or --config, not both")


# Options that a resumed run takes from its checkpoint unless given again; those marked exact
# change the batches or the updates, so changing them means not continuing the same run.
_RUN_OPTIONS = ("max_steps", "batch_size", "seq_len", "grad_accum", "batch_tokens", "lr",
                "min_lr", "warmup_steps", "weight_decay", "grad_clip", "eval_every",
                "eval_batches", "save_every", "keep", "seed", "dtype", "compile", "parallel",
                "activation_checkpointing", "sample_prompt", "sample_tokens", "peak_tflops")
_EXACT_OPTIONS = ("batch_size", "seq_len", "grad_accum", "batch_tokens", "lr", "min_lr",
                  "warmup_steps", "weight_decay", "grad_clip", "seed", "dtype")


def resumed_config(config: TrainConfig, saved: dict[str, Any]) -> tuple[TrainConfig, list[str]]:
    """The options of a resumed run: each option left at its default takes the checkpoint's
    value, so `--resume` alone continues the run as it was started; an option given with another
    value replaces the saved one. Returns the config and notes for the user on what changed
    (changes to options that shape the batches or updates say the run will not continue
    exactly)."""
    defaults = TrainConfig(data="", out="")
    changes: dict[str, Any] = {}
    notes = []
    for name in _RUN_OPTIONS:
        if name not in saved:
            continue
        given, was = getattr(config, name), saved[name]
        if given == getattr(defaults, name):
            changes[name] = was                                   # not given: keep the run's
        elif given != was:
            exact = " (the run will not continue exactly)" if name in _EXACT_OPTIONS else ""
            notes.append(f"--{name.replace('_', '-')} {given!r} replaces the run's {was!r}{exact}")
    return dataclasses.replace(config, **changes), notes


# --------------------------------------------------------------------------------------------
# Model args
# --------------------------------------------------------------------------------------------

def model_args_for_run(config: TrainConfig, vocab_size: int) -> ModelArgs:
    """The run's ModelArgs from --preset or --config. A preset's vocab_size becomes the
    tokenizer's; a config file may give a larger one (spare rows), never a smaller one.

    Raises:
        ArgumentError: unknown preset, bad config file or invalid field values (the message
            names the file and the field).
    """
    if config.preset is not None:
        return get_preset(config.preset).replace(vocab_size=vocab_size)
    fields = read_model_config(config.config)
    fields.setdefault("vocab_size", vocab_size)
    try:
        args = ModelArgs(**fields)
    except (ArgumentError, TypeError) as e:
        raise ArgumentError(f"--config {config.config}: {e}") from None
    if args.vocab_size < vocab_size:
        raise ArgumentError(f"--config {config.config}: vocab_size {args.vocab_size} is smaller "
                            f"than the tokenizer's {vocab_size}")
    return args


# --------------------------------------------------------------------------------------------
# Peak FLOP/s for MFU
# --------------------------------------------------------------------------------------------

# Dense (no sparsity) peak TFLOP/s from the vendors' data sheets: (bf16 tensor core, tf32/fp32).
GPU_PEAK_TFLOPS = {"H200": (989.0, 494.0), "H100 SXM": (989.0, 494.0),
                   "H100 PCIe": (756.0, 378.0), "H100": (989.0, 494.0),
                   "A100": (312.0, 156.0), "L40S": (362.0, 183.0), "L4": (121.0, 60.0),
                   "A10": (125.0, 62.5), "RTX 4090": (165.0, 82.6), "V100": (125.0, 15.7)}


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """(peak FLOP/s of one device, where the number comes from).

    GPUs: the data-sheet figure of a known model (GPU_PEAK_TFLOPS; bf16, or tf32 for float32).
    CPUs have no single published number: we measure the best of a few large matmuls in the
    training dtype, so CPU MFU reads "share of what this CPU's BLAS reaches".
    """
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, (bf16, fp32) in GPU_PEAK_TFLOPS.items():
            if key in name:
                return (bf16 if dtype == torch.bfloat16 else fp32) * 1e12, f"{name} data sheet"
        return float("nan"), f"{name}: unknown peak (pass --peak-tflops)"
    n = 1024
    g = torch.Generator().manual_seed(0)                 # not the global RNG (exact resume)
    a = torch.randn(n, n, generator=g).to(dtype)
    b = torch.randn(n, n, generator=g).to(dtype)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best, f"measured {n}³ {str(dtype).removeprefix('torch.')} matmul"


# --------------------------------------------------------------------------------------------
# Loss, evaluation, samples
# --------------------------------------------------------------------------------------------

def next_token_loss(model, batch: torch.Tensor, autocast) -> torch.Tensor:
    """Mean cross-entropy of predicting batch[:, 1:] from batch[:, :-1] (the model's fused
    output projection + loss, `torchllama.nn.loss.linear_cross_entropy`).

    Args:
        batch: (B, T + 1) int64 token ids.

    Returns:
        scalar float32 loss in nats: −(1/(B·T)) Σ log softmax(logits)[target].
    """
    inputs, targets = batch[:, :-1], batch[:, 1:]                 # (B, T), (B, T)
    with autocast():
        return model(inputs, targets=targets)     # () fp32: output layer fused with the loss


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, batch_size: int, autocast,
             device: torch.device) -> float:
    """Mean validation loss (nats per token) over this rank's windows, averaged over ranks
    weighted by token counts. windows: (n, T + 1) int64 (may be empty on some ranks)."""
    total = torch.zeros(2, dtype=torch.float64, device=device)   # (Σ loss·tokens, tokens)
    for i in range(0, len(windows), batch_size):
        batch = windows[i:i + batch_size].to(device)
        loss = next_token_loss(model, batch, autocast)
        n = batch[:, 1:].numel()
        total += torch.stack([loss.double() * n, torch.tensor(n, dtype=torch.float64,
                                                              device=device)])
    total = all_reduce_sum(total)
    return float(total[0] / total[1]) if total[1] > 0 else float("nan")


@torch.no_grad()
def sample_text(model, tokenizer, prompt: Optional[str], max_new_tokens: int, seed: int,
                device: torch.device, autocast, temperature: float = 0.8, top_k: int = 200
                ) -> str:
    """A continuation of `prompt` (BOS + prompt; BOS alone when None) sampled with temperature and
    top-k, recomputing the whole window each step (no KV cache, so it works on any wrapper,
    FSDP included: every rank runs the same forwards with the same generator)."""
    from torchllama.generation.sampling import SamplingParams, sample

    params = SamplingParams(temperature=temperature, top_k=top_k)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    prompt_ids = tokenizer.encode(prompt or "", bos=tokenizer.bos_id is not None)
    if not prompt_ids:
        prompt_ids = [0]
    ids = list(prompt_ids)
    max_len = unwrap(model).args.max_seq_len
    for _ in range(max_new_tokens):
        window = torch.tensor([ids[-max_len:]], device=device)        # (1, ≤ max_seq_len)
        with autocast():
            logits = model(window)[:, -1].float().cpu()              # (1, V)
        token = int(sample(logits, params, generator)[0])
        if token in tokenizer.stop_ids:
            break
        ids.append(token)
    return tokenizer.decode(ids)          # prompt + continuation, decoded together (spaces)


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------

def _write_text(path: Path, text: str) -> None:
    with atomic_output(path, folder=False, force=True) as tmp:
        tmp.write_text(text)


def train(config: TrainConfig) -> dict[str, Any]:
    """Train a model as `config` says; see the module docstring for what one step does.

    Returns:
        {"step", "loss", "val_loss", "checkpoint", "tokens", "rank"} of the finished run.

    Raises:
        ArgumentError: bad options, or an existing run in `out` without --resume.
        ModelFileError: a missing, damaged or mismatched dataset or checkpoint.
        TrainingError: the loss or gradient became NaN/inf (the last good checkpoint is kept),
            or the checkpoint to resume belongs to a different model or dataset.
    """
    config.check()
    ctx = init_distributed(config.device)
    try:
        return _train(config, ctx)
    finally:
        shutdown_distributed()


def _train(config: TrainConfig, ctx: DistContext) -> dict[str, Any]:
    from torchllama.checkpoint import load_tokenizer

    run_dir = Path(config.out)
    data_dir = Path(config.data)
    meta = read_meta(data_dir)
    verify_data(data_dir, meta)
    tok_path = Path(meta["tokenizer"]["path"])
    if not tok_path.exists():
        raise ModelFileError(f"{data_dir / 'meta.json'}: its tokenizer {tok_path} is missing")
    if tokenizer_sha256(tok_path) != meta["tokenizer"]["sha256"]:
        raise ModelFileError(f"{tok_path} has changed since {data_dir} was prepared with it "
                             "(SHA-256 differs): the dataset was built with another tokenizer; "
                             "run `torchllama prepare-data --force` again")
    tokenizer = load_tokenizer(tok_path)
    data_hash = sha256_file(data_dir / "meta.json")

    # Resume or start.
    resume_from = ckpt_io.latest_checkpoint(run_dir) if config.resume else None
    if config.resume and resume_from is None:
        raise ArgumentError(f"--resume: {run_dir} has no checkpoint to resume from (a run "
                            "stopped before its first checkpoint starts again without --resume)")
    if not config.resume and ckpt_io.list_checkpoints(run_dir):
        raise ArgumentError(f"{run_dir} already holds a training run; pass --resume to continue "
                            "it, or choose another --out")
    if run_dir.exists() and not run_dir.is_dir():
        raise ArgumentError(f"--out {run_dir} is a file, not a folder")
    barrier()            # every rank has checked the folder before rank 0 writes into it
    saved = ckpt_io.read_train_state(resume_from) if resume_from else None
    if saved is not None:
        config, notes = resumed_config(config, saved["config"])
        if ctx.is_main:
            for note in notes:
                print(f"--resume: {note}", flush=True)
        if saved.get("data_meta_sha256") != data_hash and ctx.is_main:
            print(f"--resume: {data_dir} is not the dataset the run was trained on so far (same "
                  "tokenizer): training goes on, on the new data", flush=True)
        if saved["tokenizer_sha256"] != meta["tokenizer"]["sha256"]:
            raise TrainingError(f"{resume_from} was trained with another tokenizer than "
                                f"{data_dir}'s ({tok_path})")
        args = ModelArgs(**saved["model_args"])
        if config.preset is not None or config.config is not None:
            wanted = model_args_for_run(config, meta["tokenizer"]["vocab_size"])
            diff = [f"{f.name} {getattr(args, f.name)!r} in the checkpoint, "
                    f"{getattr(wanted, f.name)!r} now" for f in dataclasses.fields(ModelArgs)
                    if getattr(args, f.name) != getattr(wanted, f.name)]
            if diff:
                raise TrainingError(f"--resume: {resume_from} is a checkpoint of a different "
                                    f"model ({'; '.join(diff)})")
    else:
        args = model_args_for_run(config, meta["tokenizer"]["vocab_size"])
    seq_len = config.seq_len or args.max_seq_len
    if seq_len > args.max_seq_len:
        raise ArgumentError(f"--seq-len {seq_len} exceeds the model's max_seq_len "
                            f"{args.max_seq_len}")
    grad_accum = config.grad_accum
    if config.batch_tokens is not None:
        per_micro = ctx.world_size * config.batch_size * seq_len
        if config.batch_tokens % per_micro:
            raise ArgumentError(f"--batch-tokens {config.batch_tokens} is not a multiple of "
                                f"processes·batch-size·seq-len = {per_micro}")
        grad_accum = config.batch_tokens // per_micro
    warmup = config.warmup_steps if config.warmup_steps is not None else \
        min(1000, config.max_steps // 10)
    min_lr = config.min_lr if config.min_lr is not None else config.lr / 10
    save_every = config.save_every or config.eval_every
    device = ctx.device
    use_bf16 = config.dtype == "bfloat16" or (
        config.dtype == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported())
    train_dtype = torch.bfloat16 if use_bf16 else torch.float32

    def autocast():
        if not use_bf16:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=torch.bfloat16)

    # Model: the same initial weights on every rank (same seed), then wrapped.
    torch.manual_seed(config.seed)
    model = Transformer(args).to(device)
    init_weights(model, args.n_layers)
    if config.activation_checkpointing:
        apply_activation_checkpointing(model)
    fsdp = ctx.distributed and config.parallel == "fsdp"
    wrapped = wrap_model(model, config.parallel, ctx)
    optimizer = make_optimizer(model, config.lr, config.weight_decay,
                               fused=device.type == "cuda")
    step = 0
    if resume_from is not None:
        saved = ckpt_io.load_checkpoint(resume_from, model, optimizer, ctx, fsdp=fsdp)
        step = saved["step"]
    runnable = torch.compile(wrapped) if config.compile else wrapped

    train_tokens = load_tokens(data_dir, "train", meta)
    val_tokens = load_tokens(data_dir, "val", meta)
    batches = TokenBatches(train_tokens, seq_len, config.batch_size, config.seed, ctx.rank,
                           ctx.world_size)
    val_windows = eval_windows(val_tokens, seq_len,
                               config.eval_batches * config.batch_size * ctx.world_size)
    # Every rank gets the same number of windows (FSDP ranks must run the same forwards).
    val_windows = val_windows[:len(val_windows) // ctx.world_size * ctx.world_size]
    val_windows = val_windows[ctx.rank::ctx.world_size]           # this rank's share

    n_params = count_params(model, exclude_embeddings=not args.tie_embeddings)
    flops_tok = flops_per_token(args, n_params, seq_len)
    if config.peak_tflops is not None:
        peak, peak_source = config.peak_tflops * 1e12, "--peak-tflops"
    else:
        peak, peak_source = peak_flops(device, train_dtype)
    tokens_per_step = ctx.world_size * grad_accum * config.batch_size * seq_len

    log_path = run_dir / LOG_FILE
    log: list[dict] = []
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        for stale in run_dir.glob(".tmp-step-*"):                # from a killed save
            shutil.rmtree(stale, ignore_errors=True)
        log = [e for e in read_log(run_dir) if e.get("step", 0) <= step] \
            if log_path.exists() and resume_from else []    # a fresh start: no old lines
        _write_text(log_path, "".join(json.dumps(e) + "\n" for e in log))                                # drop steps after the checkpoint
        run_info = {"config": dataclasses.asdict(config), "model_args": dataclasses.asdict(args),
                    "parameters": count_params(model), "seq_len": seq_len,
                    "grad_accum": grad_accum, "world_size": ctx.world_size,
                    "tokens_per_step": tokens_per_step, "dtype": str(train_dtype),
                    "device": str(device), "peak_flops": peak, "peak_flops_source": peak_source,
                    "data": str(data_dir.resolve()), "tokenizer": str(tok_path),
                    "unigram_val_loss": unigram_loss(train_tokens, val_tokens, args.vocab_size)}
        _write_text(run_dir / "run.json", json.dumps(run_info, indent=2) + "\n")
        print(f"model: {count_params(model):,} parameters ({args.n_layers} layers, dim "
              f"{args.dim}, vocab {args.vocab_size}); {tokens_per_step:,} tokens per step "
              f"({ctx.world_size} process(es) × {grad_accum} micro-steps × {config.batch_size} "
              f"× {seq_len}); {train_dtype}; {device}"
              + (f"; resuming at step {step} from {resume_from}" if resume_from else ""),
              flush=True)
        if len(val_tokens):
            print(f"baseline: a unigram model (token frequencies) has val_loss "
                  f"{run_info['unigram_val_loss']:.4f}; uniform: ln V = "
                  f"{math.log(args.vocab_size):.4f}", flush=True)
    barrier()

    # Data position and tokens seen continue from the checkpoint's (also if a resumed run
    # changed --grad-accum or the batch shape).
    step0 = step
    micro0 = saved["micro_step"] if saved is not None else 0
    tokens0 = saved.get("tokens", step0 * tokens_per_step) if saved is not None else 0

    def micro_at(s: int) -> int:
        return micro0 + (s - step0) * grad_accum

    def tokens_at(s: int) -> int:
        return tokens0 + (s - step0) * tokens_per_step

    def state_at(s: int) -> dict[str, Any]:
        return {"step": s, "micro_step": micro_at(s), "tokens": tokens_at(s),
                "model_args": dataclasses.asdict(args),
                "config": dataclasses.asdict(config), "seq_len": seq_len,
                "grad_accum": grad_accum, "tokenizer_sha256": meta["tokenizer"]["sha256"],
                "data_meta_sha256": data_hash,
                "lr_schedule": {"lr": config.lr, "min_lr": min_lr, "warmup_steps": warmup,
                                "max_steps": config.max_steps}}

    def save(s: int) -> Path:
        return ckpt_io.save_checkpoint(run_dir, s, model, optimizer, state_at(s), tokenizer,
                                       ctx, fsdp=fsdp, keep=config.keep)

    from tqdm import tqdm

    bar = tqdm(total=config.max_steps, initial=step, desc="training", unit="step",
               disable=not (config.progress and ctx.is_main), dynamic_ncols=True)
    params = [p for p in model.parameters() if p.requires_grad]
    last = {"step": step, "loss": None, "val_loss": None,
            "checkpoint": str(resume_from) if resume_from else None}
    if step >= config.max_steps and ctx.is_main:
        print(f"{run_dir} is already at step {step} ≥ --max-steps {config.max_steps}: nothing "
              "to train (raise --max-steps to train on)", flush=True)
    try:
        while step < config.max_steps:
            lr = lr_at(step, config.lr, warmup, config.max_steps, min_lr)
            for group in optimizer.param_groups:
                group["lr"] = lr
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            loss_sum = torch.zeros((), device=device)
            for k in range(grad_accum):
                batch = batches.batch(micro_at(step) + k).to(device, non_blocking=True)
                with gradient_sync(runnable, k == grad_accum - 1):
                    loss = next_token_loss(runnable, batch, autocast)
                    (loss / grad_accum).backward()
                loss_sum += loss.detach()
            loss = all_reduce_mean(loss_sum / grad_accum)
            if config.grad_clip > 0:
                grad_norm = torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
            else:
                grad_norm = torch.nn.utils.get_total_norm(
                    [p.grad for p in params if p.grad is not None])
            if hasattr(grad_norm, "full_tensor"):                # FSDP2: a DTensor
                grad_norm = grad_norm.full_tensor()
            loss_value, norm_value = float(loss), float(grad_norm)
            if not (math.isfinite(loss_value) and math.isfinite(norm_value)):
                good = ckpt_io.latest_checkpoint(run_dir)
                raise TrainingError(
                    f"the loss became {loss_value} (gradient norm {norm_value}) at step "
                    f"{step + 1}; stopping. The last good checkpoint is "
                    f"{good if good else 'none (no checkpoint was saved yet)'}; lower --lr "
                    "or --grad-clip and --resume")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - t0
            step += 1
            tok_s = tokens_per_step / seconds
            entry = {"step": step, "loss": loss_value, "lr": lr, "grad_norm": norm_value,
                     "tokens": tokens_at(step), "tokens_per_s": tok_s,
                     "mfu": flops_tok * tok_s / ctx.world_size / peak,
                     "epoch": batches.epoch_of(micro_at(step))}
            if step % config.eval_every == 0 or step == config.max_steps:
                runnable.eval()
                if len(val_tokens) > seq_len:
                    val_loss = evaluate(runnable, val_windows, config.batch_size, autocast,
                                        device)
                    entry["val_loss"], entry["val_ppl"] = val_loss, math.exp(min(val_loss, 700))
                    last["val_loss"] = val_loss
                if config.sample_tokens:
                    entry["sample"] = sample_text(
                        wrapped if fsdp else model, tokenizer, config.sample_prompt,
                        config.sample_tokens, config.seed * 1_000_003 + step, device, autocast)
                runnable.train()
            if ctx.is_main:
                log.append(entry)
                with open(log_path, "a") as f:
                    f.write(json.dumps(entry) + "\n")
                bar.set_postfix(loss=f"{loss_value:.3f}", lr=f"{lr:.2e}",
                                tok_s=f"{tok_s:,.0f}", refresh=False)
                bar.update(1)
                if "val_loss" in entry or "sample" in entry:
                    line = f"step {step}: loss {loss_value:.4f}"
                    if "val_loss" in entry:
                        line += f", val_loss {entry['val_loss']:.4f} (ppl {entry['val_ppl']:.1f})"
                    bar.write(line + f", {tok_s:,.0f} tok/s, MFU {entry['mfu']:.1%}")
                    if "sample" in entry:
                        bar.write("  sample: " + entry["sample"].strip().replace("\n", "\n  "))
            last.update(step=step, loss=loss_value)
            if step % save_every == 0 or step == config.max_steps:
                last["checkpoint"] = str(save(step))
    finally:
        bar.close()
    if ctx.is_main:
        from torchllama.train.plot import plot_log
        plot_log(run_dir)
    barrier()             # leave together: a Gloo rank exiting early can abort the other one
    last["tokens"] = tokens_at(step)
    last["rank"] = ctx.rank
    return last
