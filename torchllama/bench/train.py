"""Training throughput of our Transformer side by side with HF transformers' `LlamaForCausalLM`
built from the same config, holding the same weights, on the same batch, in the same process.

One measured step is one full optimizer step: forward, cross-entropy loss, backward, AdamW step,
zero_grad. Both models run the identical loop (`_train_step`); only the loss call differs (ours
is our training path with the output layer fused into the loss).
Runs are interleaved (ours, HF, ours, HF, ...) after one warm-up run each, and each figure is the
median of `repeats` runs of `steps` steps. The machine may be shared and noisy: compare the ratio,
measured in the same run, rather than the absolute numbers.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.nn.functional as F

from torchllama.bench.timing import measure as _measure
from torchllama.checkpoint.hf import hf_config, to_hf_state_dict
from torchllama.config import ModelArgs, get_preset
from torchllama.errors import ArgumentError
from torchllama.model import Transformer
from torchllama.train.optim import count_params, init_weights, make_optimizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_pair(args: ModelArgs, seed: int = 0):
    """Our Transformer initialised with `init_weights` (seeded) and a transformers
    `LlamaForCausalLM` from the same config (`hf_config`, SDPA attention) holding the same
    weights, both fp32 and in train mode.

    Raises:
        ImportError: transformers is not installed (it is a test-only dependency).
    """
    try:
        import transformers
    except ImportError as e:
        raise ImportError("the training benchmark against HF needs transformers "
                          "(pip install transformers), or pass with_hf=False") from e
    torch.manual_seed(seed)
    ours = Transformer(args)
    init_weights(ours, args.n_layers)
    config = transformers.LlamaConfig(**hf_config(args, torch.float32, None, None),
                                      attn_implementation="sdpa")
    hf = transformers.LlamaForCausalLM(config)
    hf.load_state_dict(to_hf_state_dict(ours), strict=True)
    if args.tie_embeddings and hf.lm_head.weight is not hf.model.embed_tokens.weight:
        raise RuntimeError("transformers did not tie lm_head to embed_tokens")
    return ours.train(), hf.train()


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over fp32 logits (B, T, V) and targets (B, T)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _train_step(loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], optimizer,
                inputs, targets, autocast: bool, device_type: str = "cpu") -> torch.Tensor:
    """One optimizer step: forward + loss under optional bf16 autocast, backward, AdamW step,
    zero_grad. Returns the loss (detached)."""
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
        loss = loss_fn(inputs, targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def run_train_bench(preset: str = "shakespeare-small", batch_size: int = 8, seq_len: int = 256,
                    dtype: str = "float32", steps: int = 10, repeats: int = 3,
                    with_hf: bool = True, write: Callable[[str], None] = print,
                    device: str = "cpu", compile: bool = False) -> dict:
    """Measure training tokens/s of our Transformer and, with `with_hf`, of transformers'
    LlamaForCausalLM built from the same `ModelArgs`; print a side-by-side table.

    Both models hold the same initial weights (ours from `init_weights`, copied into HF with the
    q/k permutation), see the same random batch of token ids (B, T+1) split into inputs
    [:, :-1] and targets [:, 1:], and run the same step: forward, loss, backward, AdamW
    (`make_optimizer`, lr 3e-4: decay on linear weight matrices only — the grouping is by
    parameter kind, so it applies to HF's modules unchanged), zero_grad. The loss: ours is our
    training path, `forward(inputs, targets=...)`, whose output projection is fused with the
    cross-entropy (`torchllama.nn.loss.linear_cross_entropy`, no (B, T, V) logits); HF returns its
    logits (use_cache=False) and F.cross_entropy over them in fp32 gives the loss, as HF's own
    loss function does. With dtype "bfloat16" both run forward
    and loss under `torch.autocast("cpu", dtype=torch.bfloat16)`, weights and optimizer state in
    fp32.

    Args:
        preset: a `torchllama.config` preset name.
        batch_size, seq_len: B and T of every step (T ≤ the preset's max_seq_len).
        dtype: "float32" or "bfloat16" (autocast).
        steps: optimizer steps per timed run.
        repeats: timed runs per model (median reported), after one warm-up run each.
        with_hf: also measure transformers (imported lazily; ImportError if missing).
        write: where the table goes.
        device: cpu or cuda (bf16 autocast on that device; CUDA runs are synchronised).
        compile: torch.compile both models (the GPU MFU setting: bf16 + SDPA + compile).

    Returns:
        dict with preset, batch_size, seq_len, dtype, steps, repeats, threads, n_params,
        tokens_per_step, torchllama_tok_s, torchllama_ms_per_step, torchllama_initial_loss, and
        with HF transformers_tok_s, transformers_ms_per_step, transformers_initial_loss, ratio
        (ours / HF tokens/s). The initial losses are computed before any step on the same batch:
        equal (to fp32 rounding) when the two really are the same model.

    Raises:
        ArgumentError: unknown preset or dtype, non-positive sizes, seq_len above max_seq_len.
        ImportError: with_hf and transformers is not installed.
    """
    args = _checked_preset(preset, batch_size, seq_len, dtype, steps, repeats)
    autocast = dtype == "bfloat16"
    ours, hf = _models(args, with_hf)
    from torchllama.train.distributed import resolve_device

    dev = resolve_device(device)
    ours = ours.to(dev)
    hf = hf.to(dev) if hf is not None else None
    g = torch.Generator().manual_seed(1)
    batch = torch.randint(0, args.vocab_size, (batch_size, seq_len + 1), generator=g)  # (B, T+1)
    batch = batch.to(dev)
    inputs, targets = batch[:, :-1], batch[:, 1:]                                      # (B, T)
    loss_fns = _loss_fns(ours, hf, compile)
    initial_loss = {}
    with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
        for name, loss_fn in loss_fns.items():
            initial_loss[name] = loss_fn(inputs, targets).item()
    models = {"torchllama": ours, "transformers": hf}
    runs = {name: _timed_run(loss_fn, make_optimizer(models[name], lr=3e-4), inputs, targets,
                             steps, autocast, dev)
            for name, loss_fn in loss_fns.items()}
    rates = _measure(runs, repeats)
    result = {"preset": preset, "batch_size": batch_size, "seq_len": seq_len, "dtype": dtype,
              "steps": steps, "repeats": repeats, "threads": torch.get_num_threads(),
              "n_params": count_params(ours), "tokens_per_step": batch_size * seq_len}
    return _report(result, args, ours, rates, initial_loss, dev, write)


def _timed_run(loss_fn, optimizer, inputs: torch.Tensor, targets: torch.Tensor, steps: int,
               autocast: bool, dev: torch.device) -> Callable[[], tuple[int, float]]:
    """A run for `measure`: `steps` optimizer steps on (B, T) inputs and targets, returning
    (tokens, seconds); CUDA work is waited for."""
    def run() -> tuple[int, float]:
        t0 = time.perf_counter()
        for _ in range(steps):
            _train_step(loss_fn, optimizer, inputs, targets, autocast, dev.type)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return inputs.numel() * steps, time.perf_counter() - t0
    return run


def _checked_preset(preset: str, batch_size: int, seq_len: int, dtype: str, steps: int,
                    repeats: int) -> ModelArgs:
    """The preset's ModelArgs, after checking the benchmark's arguments.

    Raises:
        ArgumentError: unknown preset or dtype, non-positive sizes, seq_len above max_seq_len.
    """
    if dtype not in _DTYPES:
        raise ArgumentError(f"--dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    args = get_preset(preset)
    if min(batch_size, seq_len, steps, repeats) < 1:
        raise ArgumentError("batch_size, seq_len, steps and repeats must be positive")
    if seq_len > args.max_seq_len:
        raise ArgumentError(f"seq_len {seq_len} exceeds preset {preset!r}'s max_seq_len "
                            f"{args.max_seq_len}")
    return args


def _models(args: ModelArgs, with_hf: bool):
    """(ours, HF's or None) in train mode: `build_pair`, or ours alone initialised the same
    way."""
    if with_hf:
        ours, hf = build_pair(args)
    else:
        torch.manual_seed(0)
        ours, hf = Transformer(args), None
        init_weights(ours, args.n_layers)
        ours.train()
    return ours, hf


def _loss_fns(ours, hf, compile: bool) -> dict[str, Callable]:
    """name → loss(inputs, targets), compiled with `compile`. Ours: the training path,
    forward(targets=...) with the output layer fused into the loss (torchllama.nn.loss). HF: its
    logits, then F.cross_entropy (HF's own loss does the same)."""
    run_ours = torch.compile(ours) if compile else ours
    loss_fns = {"torchllama": lambda x, y: run_ours(x, targets=y)}  # () fp32
    if hf is not None:
        run_hf = torch.compile(hf) if compile else hf
        loss_fns["transformers"] = lambda x, y: _loss(
            run_hf(input_ids=x, use_cache=False).logits, y)
    return loss_fns


def _report(result: dict, args: ModelArgs, ours, rates: dict[str, float],
            initial_loss: dict[str, float], dev: torch.device,
            write: Callable[[str], None]) -> dict:
    """Write the table (tokens/s, ms/step, initial loss and MFU per model, and the ratio) and
    return `result` with those figures added."""
    from torchllama.train.loop import peak_flops
    from torchllama.train.optim import flops_per_token

    preset, dtype, seq_len = result["preset"], result["dtype"], result["seq_len"]
    autocast, tokens_per_step = dtype == "bfloat16", result["tokens_per_step"]
    write(f"preset {preset} ({result['n_params'] / 1e6:.2f}M parameters), {dtype}"
          f"{' autocast' if autocast else ''}, batch {result['batch_size']} x {seq_len} tokens, "
          f"{result['threads']} threads; {result['steps']} optimizer steps per run, median of "
          f"{result['repeats']} runs, interleaved")
    flops_tok = flops_per_token(
        args, count_params(ours, exclude_embeddings=not args.tie_embeddings), seq_len)
    peak, peak_source = peak_flops(dev, torch.bfloat16 if autocast else torch.float32)
    write(f"{'':14}{'tok/s':>10}{'ms/step':>10}{'initial loss':>14}{'MFU':>8}")
    for name, rate in rates.items():
        mfu = flops_tok * rate / peak
        write(f"{name:14}{rate:10.1f}{tokens_per_step / rate * 1e3:10.1f}"
              f"{initial_loss[name]:14.6f}{mfu:8.1%}")
        result.update({f"{name}_tok_s": rate, f"{name}_ms_per_step": tokens_per_step / rate * 1e3,
                       f"{name}_initial_loss": initial_loss[name], f"{name}_mfu": mfu})
    write(f"MFU: (6N + 12·L·H·Q·T)·tok/s over a peak of {peak / 1e12:.2f} TFLOP/s "
          f"({peak_source})")
    if "transformers" in rates:
        result["ratio"] = rates["torchllama"] / rates["transformers"]
        write(f"{'ratio':14}{result['ratio']:9.2f}x")
    return result


def result_runs(result: dict):
    """The figures of `run_train_bench` as `torchllama.bench.results` runs."""
    from torchllama.bench.results import Figure, Run

    peer = "transformers" if "transformers_tok_s" in result else None
    figures = [Figure("training", "tok/s", result["torchllama_tok_s"],
                      result.get("transformers_tok_s")),
               Figure("optimizer step", "ms", result["torchllama_ms_per_step"],
                      result.get("transformers_ms_per_step"), False)]
    return [Run(f"{result['preset']} ({result['dtype']}, batch {result['batch_size']} × "
                f"{result['seq_len']})", figures, peer,
                "LlamaForCausalLM of the same config and weights" if peer else None)]

