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

`train()` builds a `PretrainTrainer` (the run: dataset, model, optimizer, batches, data position)
and calls its `fit()`, the loop of `torchllama.train.trainer.Trainer` that finetuning shares.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from torchllama.config import ModelArgs, get_preset, read_model_config
from torchllama.errors import ArgumentError, ModelFileError, TrainingError
from torchllama.model import Transformer
from torchllama.nn.moe import balance_loss
from torchllama.train import checkpointing as ckpt_io
from torchllama.train.data import (eval_windows, load_tokens, read_meta, sha256_file,
                                   tokenizer_sha256, TokenBatches, unigram_loss, verify_data)
from torchllama.train.distributed import (DistContext, all_reduce_mean, all_reduce_sum,
                                          apply_activation_checkpointing, barrier,
                                          gradient_sync, init_distributed, shutdown_distributed,
                                          unwrap, wrap_model)
from torchllama.train.optim import (LRSchedule, count_params, flops_per_token, init_weights,
                                    make_optimizer)
from torchllama.train.trainer import LOG_FILE, Trainer, perplexity, write_text

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

@dataclass
class TrainingData:
    """A dataset folder checked against its meta.json, and the tokenizer it was made with.

    Attributes:
        folder: the dataset folder (`torchllama prepare-data`'s --out).
        meta: its meta.json.
        tokenizer: the `Tokenizer` named by meta.json (checked by SHA-256).
        tokenizer_path: where that tokenizer is.
        meta_sha256: SHA-256 of meta.json (identifies the dataset in checkpoints).
    """

    folder: Path
    meta: dict
    tokenizer: Any
    tokenizer_path: Path
    meta_sha256: str


def open_dataset(folder: Path) -> TrainingData:
    """Read and verify a dataset and load its tokenizer.

    Raises:
        ModelFileError: a missing or damaged dataset, a missing tokenizer, or a tokenizer that
            changed since the dataset was prepared.
    """
    from torchllama.checkpoint import load_tokenizer

    meta = read_meta(folder)
    verify_data(folder, meta)
    tok_path = Path(meta["tokenizer"]["path"])
    if not tok_path.exists():
        raise ModelFileError(f"{folder / 'meta.json'}: its tokenizer {tok_path} is missing")
    if tokenizer_sha256(tok_path) != meta["tokenizer"]["sha256"]:
        raise ModelFileError(f"{tok_path} has changed since {folder} was prepared with it "
                             "(SHA-256 differs): the dataset was built with another tokenizer; "
                             "run `torchllama prepare-data --force` again")
    return TrainingData(folder, meta, load_tokenizer(tok_path), tok_path,
                        sha256_file(folder / "meta.json"))


def checkpoint_to_resume(config: TrainConfig, run_dir: Path) -> Optional[Path]:
    """The checkpoint a --resume run continues from (None for a fresh run), after checking
    that the run folder suits the request (collective: ends with a barrier).

    Raises:
        ArgumentError: --resume without a checkpoint, a fresh run into a folder that holds
            one, or --out naming a file.
    """
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
    return resume_from


def resumed_run(config: TrainConfig, saved: dict[str, Any], data: TrainingData,
                resume_from: Path, is_main: bool) -> tuple[TrainConfig, ModelArgs]:
    """The options and model of a resumed run: the checkpoint's, with options given again
    replacing them (`resumed_config`; rank 0 prints what changed).

    Raises:
        TrainingError: the checkpoint was trained with another tokenizer, or --preset/--config
            describe another model than the checkpoint's.
    """
    config, notes = resumed_config(config, saved["config"])
    if is_main:
        for note in notes:
            print(f"--resume: {note}", flush=True)
    if saved.get("data_meta_sha256") != data.meta_sha256 and is_main:
        print(f"--resume: {data.folder} is not the dataset the run was trained on so far (same "
              "tokenizer): training goes on, on the new data", flush=True)
    if saved["tokenizer_sha256"] != data.meta["tokenizer"]["sha256"]:
        raise TrainingError(f"{resume_from} was trained with another tokenizer than "
                            f"{data.folder}'s ({data.tokenizer_path})")
    args = ModelArgs(**saved["model_args"])
    if config.preset is not None or config.config is not None:
        wanted = model_args_for_run(config, data.meta["tokenizer"]["vocab_size"])
        diff = [f"{f.name} {getattr(args, f.name)!r} in the checkpoint, "
                f"{getattr(wanted, f.name)!r} now" for f in dataclasses.fields(ModelArgs)
                if getattr(args, f.name) != getattr(wanted, f.name)]
        if diff:
            raise TrainingError(f"--resume: {resume_from} is a checkpoint of a different "
                                f"model ({'; '.join(diff)})")
    return config, args


def batch_shape(config: TrainConfig, args: ModelArgs, world_size: int) -> tuple[int, int]:
    """(seq_len, grad_accum) of a run: --seq-len (default the model's max_seq_len), and
    --grad-accum or the one --batch-tokens implies.

    Raises:
        ArgumentError: seq_len above max_seq_len, or --batch-tokens not a multiple of
            world_size · batch_size · seq_len.
    """
    seq_len = config.seq_len or args.max_seq_len
    if seq_len > args.max_seq_len:
        raise ArgumentError(f"--seq-len {seq_len} exceeds the model's max_seq_len "
                            f"{args.max_seq_len}")
    if config.batch_tokens is None:
        return seq_len, config.grad_accum
    per_micro = world_size * config.batch_size * seq_len
    if config.batch_tokens % per_micro:
        raise ArgumentError(f"--batch-tokens {config.batch_tokens} is not a multiple of "
                            f"processes·batch-size·seq-len = {per_micro}")
    return seq_len, config.batch_tokens // per_micro


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
        return PretrainTrainer(config, ctx).fit()
    finally:
        shutdown_distributed()


class PretrainTrainer(Trainer):
    """`torchllama train`'s run: a Transformer trained from its initial weights (or resumed
    from a checkpoint of the run) on a prepared dataset, in one process or under torchrun.

    Beyond `Trainer`'s state: the run's options and ModelArgs, the dataset and tokenizer, the
    model as built (`model`), wrapped for DDP/FSDP (`wrapped`) and compiled (`runnable`), the
    training batches and validation windows, and the data position (micro-steps and tokens
    seen at step `step0`, where this process started).
    """

    def __init__(self, config: TrainConfig, ctx: DistContext):
        data = open_dataset(Path(config.data))
        run_dir = Path(config.out)
        resume_from = checkpoint_to_resume(config, run_dir)
        saved = ckpt_io.read_train_state(resume_from) if resume_from else None
        if saved is not None:
            config, args = resumed_run(config, saved, data, resume_from, ctx.is_main)
        else:
            args = model_args_for_run(config, data.meta["tokenizer"]["vocab_size"])
        self.config, self.ctx, self.data, self.args = config, ctx, data, args
        self.seq_len, grad_accum = batch_shape(config, args, ctx.world_size)
        self.use_bf16 = config.dtype == "bfloat16" or (
            config.dtype == "auto" and ctx.device.type == "cuda"
            and torch.cuda.is_bf16_supported())
        self.train_dtype = torch.bfloat16 if self.use_bf16 else torch.float32
        model, optimizer, step, saved = self._build_model(resume_from)
        schedule = LRSchedule.for_run(config.lr, config.min_lr, config.warmup_steps,
                                      config.max_steps, max_warmup=1000)
        super().__init__(model, optimizer, [p for p in model.parameters() if p.requires_grad],
                         schedule, run_dir=run_dir, step=step, grad_accum=grad_accum,
                         grad_clip=config.grad_clip, eval_every=config.eval_every,
                         save_every=config.save_every or config.eval_every,
                         progress=config.progress, is_main=ctx.is_main, device=ctx.device)
        self.resume_from = resume_from
        self.last["checkpoint"] = str(resume_from) if resume_from else None
        self._load_batches()
        self.tokens_per_step = ctx.world_size * grad_accum * config.batch_size * self.seq_len
        self._measure_flops()
        self.open_log(keep_old=resume_from is not None and self.log_path.exists())
        self._announce()
        barrier()
        # Data position and tokens seen continue from the checkpoint's (also if a resumed run
        # changed --grad-accum or the batch shape).
        self.step0 = step
        self.micro0 = saved["micro_step"] if saved is not None else 0
        self.tokens0 = saved.get("tokens", step * self.tokens_per_step) \
            if saved is not None else 0

    # ---- building the run ------------------------------------------------------------------

    def autocast(self):
        """The forward's autocast context: bf16 with --dtype bfloat16, else none."""
        if not self.use_bf16:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def _build_model(self, resume_from: Optional[Path]):
        """(model, optimizer, step, saved state or None): the same initial weights on every rank
        (same seed), wrapped for DDP/FSDP, the checkpoint's weights, optimizer moments and RNG
        states when resuming, then compiled with --compile."""
        config, ctx, args = self.config, self.ctx, self.args
        torch.manual_seed(config.seed)
        model = Transformer(args).to(ctx.device)
        init_weights(model, args.n_layers)
        if config.activation_checkpointing:
            apply_activation_checkpointing(model)
        self.fsdp = ctx.distributed and config.parallel == "fsdp"
        self.wrapped = wrap_model(model, config.parallel, ctx)
        optimizer = make_optimizer(model, config.lr, config.weight_decay,
                                   fused=ctx.device.type == "cuda")
        step, saved = 0, None
        if resume_from is not None:
            saved = ckpt_io.load_checkpoint(resume_from, model, optimizer, ctx, fsdp=self.fsdp)
            step = saved["step"]
        self.runnable = torch.compile(self.wrapped) if config.compile else self.wrapped
        return model, optimizer, step, saved

    def _load_batches(self) -> None:
        """The token splits, the training batches of this rank and its share of the
        validation windows (every rank gets as many: FSDP ranks must run the same forwards)."""
        config, ctx, data = self.config, self.ctx, self.data
        self.train_tokens = load_tokens(data.folder, "train", data.meta)
        self.val_tokens = load_tokens(data.folder, "val", data.meta)
        self.batches = TokenBatches(self.train_tokens, self.seq_len, config.batch_size,
                                    config.seed, ctx.rank, ctx.world_size)
        windows = eval_windows(self.val_tokens, self.seq_len,
                               config.eval_batches * config.batch_size * ctx.world_size)
        windows = windows[:len(windows) // ctx.world_size * ctx.world_size]
        self.val_windows = windows[ctx.rank::ctx.world_size]          # this rank's share

    def _measure_flops(self) -> None:
        """Training FLOPs per token and the device's peak FLOP/s, for MFU."""
        n_params = count_params(self.model, exclude_embeddings=not self.args.tie_embeddings)
        self.flops_per_token = flops_per_token(self.args, n_params, self.seq_len)
        if self.config.peak_tflops is not None:
            self.peak, self.peak_source = self.config.peak_tflops * 1e12, "--peak-tflops"
        else:
            self.peak, self.peak_source = peak_flops(self.device, self.train_dtype)

    def _announce(self) -> None:
        """Rank 0: write OUT/run.json and print the run's summary and the loss baselines."""
        if not self.is_main:
            return
        config, args, ctx = self.config, self.args, self.ctx
        run_info = {"config": dataclasses.asdict(config), "model_args": dataclasses.asdict(args),
                    "parameters": count_params(self.model), "seq_len": self.seq_len,
                    "grad_accum": self.grad_accum, "world_size": ctx.world_size,
                    "tokens_per_step": self.tokens_per_step, "dtype": str(self.train_dtype),
                    "device": str(self.device), "peak_flops": self.peak,
                    "peak_flops_source": self.peak_source,
                    "data": str(self.data.folder.resolve()),
                    "tokenizer": str(self.data.tokenizer_path),
                    "unigram_val_loss": unigram_loss(self.train_tokens, self.val_tokens,
                                                     args.vocab_size)}
        write_text(self.run_dir / "run.json", json.dumps(run_info, indent=2) + "\n")
        print(f"model: {count_params(self.model):,} parameters ({args.n_layers} layers, dim "
              f"{args.dim}, vocab {args.vocab_size}); {self.tokens_per_step:,} tokens per step "
              f"({ctx.world_size} process(es) × {self.grad_accum} micro-steps × "
              f"{config.batch_size} × {self.seq_len}); {self.train_dtype}; {self.device}"
              + (f"; resuming at step {self.step} from {self.resume_from}"
                 if self.resume_from else ""), flush=True)
        if len(self.val_tokens):
            print(f"baseline: a unigram model (token frequencies) has val_loss "
                  f"{run_info['unigram_val_loss']:.4f}; uniform: ln V = "
                  f"{math.log(args.vocab_size):.4f}", flush=True)

    # ---- the data position -----------------------------------------------------------------

    def micro_at(self, step: int) -> int:
        """Micro-steps done (the data position) after `step` optimizer steps."""
        return self.micro0 + (step - self.step0) * self.grad_accum

    def tokens_at(self, step: int) -> int:
        """Training tokens seen after `step` optimizer steps."""
        return self.tokens0 + (step - self.step0) * self.tokens_per_step

    # ---- the Trainer's steps ---------------------------------------------------------------

    def forward_backward(self) -> float:
        """grad_accum micro-steps on this rank's batches; DDP/FSDP synchronise the gradients on
        the last one. Returns the loss averaged over micro-steps and ranks."""
        loss_sum = torch.zeros((), device=self.device)
        aux_sum, self.aux_loss = torch.zeros((), device=self.device), None
        for k in range(self.grad_accum):
            batch = self.batches.batch(self.micro_at(self.step) + k)           # (B, T + 1)
            batch = batch.to(self.device, non_blocking=True)
            with gradient_sync(self.runnable, k == self.grad_accum - 1):
                loss = next_token_loss(self.runnable, batch, self.autocast)
                aux = balance_loss(self.runnable)     # experts' load balancing, if asked
                ((loss if aux is None else loss + aux) / self.grad_accum).backward()
            loss_sum += loss.detach()
            if aux is not None:
                aux_sum += aux.detach()
                self.aux_loss = float(aux_sum / (k + 1))      # logged beside the loss
        return float(all_reduce_mean(loss_sum / self.grad_accum))

    def log_entry(self, loss: float, lr: float, grad_norm: float, seconds: float) -> dict:
        """The step's entry with tokens seen, throughput, MFU and epochs."""
        tok_s = self.tokens_per_step / seconds
        aux = {} if self.aux_loss is None else {"aux_loss": self.aux_loss}
        return {**super().log_entry(loss, lr, grad_norm, seconds), **aux,
                "tokens": self.tokens_at(self.step), "tokens_per_s": tok_s,
                "mfu": self.flops_per_token * tok_s / self.ctx.world_size / self.peak,
                "epoch": self.batches.epoch_of(self.micro_at(self.step))}

    def evaluate(self) -> dict[str, Any]:
        """Validation loss and perplexity (when the split holds a window) and a text sample
        (with --sample-tokens), in eval mode."""
        config, out = self.config, {}
        self.runnable.eval()
        if len(self.val_tokens) > self.seq_len:
            val_loss = evaluate(self.runnable, self.val_windows, config.batch_size,
                                self.autocast, self.device)    # the module's evaluate()
            out["val_loss"], out["val_ppl"] = val_loss, perplexity(val_loss)
        if config.sample_tokens:
            out["sample"] = sample_text(
                self.wrapped if self.fsdp else self.model, self.data.tokenizer,
                config.sample_prompt, config.sample_tokens, config.seed * 1_000_003 + self.step,
                self.device, self.autocast)
        self.runnable.train()
        return out

    def report(self, entry: dict) -> list[str]:
        """After an evaluation: losses, throughput and MFU, and the sample."""
        if "val_loss" not in entry and "sample" not in entry:
            return []
        line = f"step {entry['step']}: loss {entry['loss']:.4f}"
        if "val_loss" in entry:
            line += f", val_loss {entry['val_loss']:.4f} (ppl {entry['val_ppl']:.1f})"
        lines = [line + f", {entry['tokens_per_s']:,.0f} tok/s, MFU {entry['mfu']:.1%}"]
        if "sample" in entry:
            lines.append("  sample: " + entry["sample"].strip().replace("\n", "\n  "))
        return lines

    def non_finite_error(self, loss: float, grad_norm: float) -> TrainingError:
        good = ckpt_io.latest_checkpoint(self.run_dir)
        return TrainingError(
            f"the loss became {loss} (gradient norm {grad_norm}) at step {self.step + 1}; "
            f"stopping. The last good checkpoint is "
            f"{good if good else 'none (no checkpoint was saved yet)'}; lower --lr "
            "or --grad-clip and --resume")

    def train_state(self) -> dict[str, Any]:
        """train_state.pt's run fields at the current step (see torchllama.train.checkpointing;
        its keys are the checkpoint format: keep them)."""
        return {"step": self.step, "micro_step": self.micro_at(self.step),
                "tokens": self.tokens_at(self.step),
                "model_args": dataclasses.asdict(self.args),
                "config": dataclasses.asdict(self.config), "seq_len": self.seq_len,
                "grad_accum": self.grad_accum,
                "tokenizer_sha256": self.data.meta["tokenizer"]["sha256"],
                "data_meta_sha256": self.data.meta_sha256,
                "lr_schedule": dataclasses.asdict(self.schedule)}

    def save_checkpoint(self) -> Path:
        """Checkpoint the current step (collective; `checkpointing.save_checkpoint`)."""
        return ckpt_io.save_checkpoint(self.run_dir, self.step, self.model, self.optimizer,
                                       self.train_state(), self.data.tokenizer, self.ctx,
                                       fsdp=self.fsdp, keep=self.config.keep)

    def fit(self) -> dict[str, Any]:
        """Train to --max-steps; returns {"step", "loss", "val_loss", "checkpoint", "tokens",
        "rank"}. Ranks leave together (a Gloo rank exiting early can abort the other one)."""
        if self.step >= self.max_steps and self.is_main:
            print(f"{self.run_dir} is already at step {self.step} ≥ --max-steps "
                  f"{self.max_steps}: nothing to train (raise --max-steps to train on)",
                  flush=True)
        last = super().fit()
        barrier()
        return {**last, "tokens": self.tokens_at(self.step), "rank": self.ctx.rank}
