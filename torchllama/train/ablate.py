"""The ablation: which architecture choices matter, measured on the same data (`torchllama ablate`).

Every variant is the `shakespeare-small` model (6 layers, dim 256, 8 heads, 4 KV heads, SwiGLU,
RMSNorm, RoPE, tied embeddings) with one choice changed, trained by the same `train()` with the
same data, seed, batches, tokens, learning-rate schedule and optimizer. The parameter budget is
kept equal: each variant's MLP hidden size is chosen so that its non-embedding parameters (all
but the token and position embeddings, as Kaplan et al. 2020 count them) match the baseline's to
within one MLP width step of 8 (a few hundred parameters of 3.3 M). Models are built with a
context of 4× the training length, so every variant is also evaluated at 2× and 4× the length it
was trained on (the same validation text, windows of that length): the length generalisation of
each position encoding (Press et al. 2022).

Outputs in OUT: one run folder per variant (resumable: finished variants are not retrained),
results.json, ablation.md (the table) and ablation.png (validation loss, and loss against
evaluation length), written atomically.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from torchllama.config import ModelArgs, get_preset
from torchllama.errors import ArgumentError

#: name → (what it changes, ModelArgs changes from the baseline). The baseline is Llama's block.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "baseline": ("Llama: pre-RMSNorm, SwiGLU, RoPE, GQA (8 q / 4 kv heads)", {}),
    "layernorm": ("LayerNorm (with bias) instead of RMSNorm",
                  dict(norm="layernorm", norm_bias=True)),
    "post-norm": ("post-norm: N(x + F(x))", dict(norm_placement="post")),
    "sandwich": ("sandwich norms (Gemma 2/3)", dict(norm_placement="sandwich")),
    "qk-norm": ("QK-norm", dict(qk_norm=True)),
    "relu": ("ReLU MLP (4·d)", dict(mlp="relu")),
    "gelu": ("GELU MLP (4·d)", dict(mlp="gelu")),
    "geglu": ("GeGLU MLP", dict(mlp="geglu")),
    "parallel": ("parallel attention + MLP block", dict(parallel_block=True)),
    "sinusoidal": ("sinusoidal positions (embeddings × √d, as Vaswani et al. §3.4)",
                   dict(position="sinusoidal", embed_scale=True)),
    "learned": ("learned absolute positions", dict(position="learned")),
    "t5-bias": ("T5 relative bias", dict(position="t5")),
    "alibi": ("ALiBi", dict(position="alibi")),
    "nope": ("no position encoding (NoPE)", dict(position="none")),
    "mha": ("MHA (8 kv heads)", dict(n_kv_heads=8)),
    "mqa": ("MQA (1 kv head)", dict(n_kv_heads=1)),
    "mla": ("MLA (kv_lora_rank 128, rope 16)",
            dict(attention="mla", n_kv_heads=8, kv_lora_rank=128, qk_nope_head_dim=32,
                 qk_rope_head_dim=16, v_head_dim=32)),
    "moe": ("mixture of experts: 8 of half the MLP's width, 2 per token (the baseline's "
            "active parameters), Switch balance loss α = 0.01",
            dict(n_experts=8, n_experts_per_token=2, moe_aux_loss_coef=0.01)),
    "baseline-seed2": ("the baseline again with another seed: the noise level", {}),
}

#: Variants trained with another seed (init and batch order) than the others.
SEEDS = {"baseline-seed2": 2}

POSITION_VARIANTS = ("baseline", "sinusoidal", "learned", "t5-bias", "alibi", "nope")


def count_parameters(args: ModelArgs) -> tuple[int, int]:
    """(all parameters, those other than the token and position embeddings), counted on the
    meta device; a tied output matrix counts once."""
    from torchllama.model import Transformer

    with torch.device("meta"):
        model = Transformer(args)
    embeddings = {id(model.tok_embeddings.weight)}
    if hasattr(model, "pos_embeddings"):
        embeddings |= {id(p) for p in model.pos_embeddings.parameters()}
    params = {id(p): p for p in model.parameters()}
    total = sum(p.numel() for p in params.values())
    return total, total - sum(p.numel() for i, p in params.items() if i in embeddings)


def non_embedding_params(args: ModelArgs) -> int:
    """Parameters other than the token and position embeddings."""
    return count_parameters(args)[1]


def budget_matched(args: ModelArgs, target: int, step: int = 8) -> ModelArgs:
    """`args` with the MLP hidden size that brings its non-embedding parameters closest to
    `target` (a multiple of `step`). Parameters grow linearly with the hidden size."""
    h0 = args.ffn_hidden_dim
    p0 = non_embedding_params(args)
    per_unit = (non_embedding_params(args.replace(hidden_dim=h0 + step)) - p0) / step
    hidden = max(step, round((h0 + (target - p0) / per_unit) / step) * step)
    return args.replace(hidden_dim=hidden)


def ablation_args(name: str, vocab_size: int, context: int) -> ModelArgs:
    """The ModelArgs of a variant: shakespeare-small with its changes, a context of `context`
    positions and the baseline's non-embedding parameter budget (a mixture of experts: its
    active parameters, the experts k of 1/k the MLP's width).

    Raises:
        ArgumentError: unknown variant (the message lists them).
    """
    if name not in VARIANTS:
        raise ArgumentError(f"unknown variant {name!r}; variants: {', '.join(VARIANTS)}")
    base = get_preset("shakespeare-small").replace(vocab_size=vocab_size, max_seq_len=context)
    changes = VARIANTS[name][1]
    if not changes:
        return base
    if changes.get("n_experts"):          # equal ACTIVE parameters: k experts of F·(1/k) each
        width = round(base.ffn_hidden_dim / changes["n_experts_per_token"] / 32) * 32
        return base.replace(**changes, moe_hidden_dim=width)   # (SiLU rows: multiples of 32)
    return budget_matched(base.replace(**changes), non_embedding_params(base))


def _check_existing_run(run: Path, args: ModelArgs) -> None:
    """A run folder left by an earlier ablation must hold the same model (it is then resumed or
    found finished); one of another configuration is not replaced.

    Raises:
        ArgumentError: the folder holds a run of other ModelArgs (names the fields).
    """
    from torchllama.train.checkpointing import latest_checkpoint, read_train_state

    ckpt = latest_checkpoint(run) if run.is_dir() else None
    if ckpt is None:
        return
    saved = read_train_state(ckpt)["model_args"]
    diff = [f"{k} {saved.get(k)!r} there, {v!r} now" for k, v in dataclasses.asdict(args).items()
            if saved.get(k) != v]
    if diff:
        raise ArgumentError(f"{run} holds a run of another configuration ({'; '.join(diff)}): "
                            "remove it or choose another --out")


@torch.no_grad()
def length_losses(model, val_tokens, lengths: list[int], tokens_per_length: int,
                  batch_size: int = 8) -> dict[int, float]:
    """Mean next-token loss (nats) of windows of each length over the validation split: the same
    text for every length (about tokens_per_length tokens each)."""
    from torchllama.train.data import eval_windows

    out = {}
    for length in lengths:
        windows = eval_windows(val_tokens, length, max(1, tokens_per_length // length))
        total, count = 0.0, 0
        for i in range(0, len(windows), batch_size):
            batch = windows[i:i + batch_size]
            loss = model(batch[:, :-1], targets=batch[:, 1:])
            total += float(loss) * batch[:, 1:].numel()
            count += batch[:, 1:].numel()
        out[length] = total / count if count else float("nan")
    return out


def run_ablation(data: str, out: str, steps: int = 100, variants: Optional[list[str]] = None,
                 seq_len: int = 128, batch_size: int = 16, lr: float = 2e-3,
                 seed: int = 1337, eval_tokens: int = 16384, progress: bool = True,
                 write: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Train every variant on the same data and write the comparison (see the module docstring).

    Args:
        data: dataset folder (`torchllama prepare-data`).
        out: output folder.
        steps: optimizer steps per variant.
        variants: names from VARIANTS (default: all).
        seq_len: training length (the models' context is 4× this).
        batch_size: sequences per step.
        lr: peak learning rate (warmup 10% of the steps, cosine to lr/10).
        seed: the same seed (init, batch order) for every variant.
        eval_tokens: validation tokens per evaluation length.
        progress: progress bars.
        write: where the lines of the report go.

    Returns:
        One dict per variant: name, description, parameters, non-embedding parameters, val loss
        at 1×, 2× and 4× the training length, training tokens/s, KV cache bytes per token.

    Raises:
        ArgumentError: unknown variant, bad sizes.
        ModelFileError: a missing or damaged dataset.
    """
    from torchllama.train.data import load_tokens, read_meta
    from torchllama.train.loop import TrainConfig, train

    names = list(variants or VARIANTS)
    for name in names:
        if name not in VARIANTS:
            raise ArgumentError(f"unknown variant {name!r}; variants: {', '.join(VARIANTS)}")
    if steps < 1 or seq_len < 2 or batch_size < 1:
        raise ArgumentError("--steps, --seq-len and --batch-size must be ≥ 1 (seq-len ≥ 2)")
    meta = read_meta(Path(data))
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    val_tokens = load_tokens(data, "val", meta)
    results = []
    for i, name in enumerate(names):
        args = ablation_args(name, meta["tokenizer"]["vocab_size"], 4 * seq_len)
        run = out_dir / name
        config_file = _write_model_config(out_dir / f"{name}.model.json", args)
        _check_existing_run(run, args)
        write(f"[{i + 1}/{len(names)}] {name}: {VARIANTS[name][0]} "
              f"({non_embedding_params(args):,} non-embedding parameters)")
        t0 = time.perf_counter()
        result = train(TrainConfig(
            data=data, out=str(run), config=str(config_file), max_steps=steps,
            batch_size=batch_size, seq_len=seq_len, lr=lr, warmup_steps=max(1, steps // 10),
            eval_every=steps, eval_batches=1, sample_tokens=0, seed=SEEDS.get(name, seed),
            dtype="float32", device="cpu", progress=progress,
            resume=(run / "latest").exists()))
        r = _variant_result(name, args, run, result.get("loss"), val_tokens, seq_len,
                            eval_tokens, SEEDS.get(name, seed))
        r["seconds"] = time.perf_counter() - t0
        results.append(r)
        write(f"    val loss {r['val_loss']:.4f} (2×: {r['val_loss_2x']:.4f}, 4×: "
              f"{r['val_loss_4x']:.4f}), {r['tokens_per_s']:,.0f} tok/s")
    settings = {"steps": steps, "seq_len": seq_len, "batch_size": batch_size, "lr": lr,
                "seed": seed, "tokens": steps * batch_size * seq_len, "data": str(data),
                "eval_tokens": eval_tokens}
    _write_report(out_dir, settings, results, seq_len, write)
    return results


def _write_model_config(path: Path, args: ModelArgs) -> Path:
    """Write a variant's ModelArgs as the JSON file `train --config` reads; returns `path`."""
    from torchllama.checkpoint import atomic_output

    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(ModelArgs)}
    with atomic_output(path, folder=False, force=True) as tmp:
        tmp.write_text(json.dumps(fields, indent=2) + "\n")
    return path


def _variant_result(name: str, args: ModelArgs, run: Path, train_loss: Optional[float],
                    val_tokens, seq_len: int, eval_tokens: int, seed: int) -> dict[str, Any]:
    """A trained variant's row of the results (all but "seconds"): its sizes, the validation
    loss of its latest checkpoint at 1×, 2× and 4× the training length, the median training
    tokens/s (after 5 warm-up steps) and its KV cache bytes per token."""
    from torchllama.bench.kv_cache_size import kv_bytes_per_token
    from torchllama.checkpoint import load
    from torchllama.model import parameter_counts

    model, _ = load(run, progress=False)
    losses = length_losses(model, val_tokens, [seq_len, 2 * seq_len, 4 * seq_len], eval_tokens)
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    rates = [e["tokens_per_s"] for e in log[min(5, len(log) - 1):]]
    total, non_embedding = count_parameters(args)
    idle = total - parameter_counts(args)[1]            # experts a token is not sent to
    return {"name": name, "description": VARIANTS[name][0], "seed": seed,
            "parameters": total, "non_embedding_parameters": non_embedding,
            "active_non_embedding_parameters": non_embedding - idle,
            "hidden_dim": args.ffn_hidden_dim,
            "val_loss": losses[seq_len], "val_loss_2x": losses[2 * seq_len],
            "val_loss_4x": losses[4 * seq_len], "train_loss": train_loss,
            "tokens_per_s": statistics.median(rates) if rates else float("nan"),
            "kv_bytes_per_token": kv_bytes_per_token(args, "bfloat16")}


def _write_report(out_dir: Path, settings: dict[str, Any], results: list[dict[str, Any]],
                  seq_len: int, write: Callable[[str], None]) -> None:
    """results.json, ablation.md and ablation.png in `out_dir` (atomically), and the table
    through `write`."""
    from torchllama.checkpoint import atomic_output

    with atomic_output(out_dir / "results.json", folder=False, force=True) as tmp:
        tmp.write_text(json.dumps({"settings": settings, "results": results}, indent=2) + "\n")
    table = markdown_table(results, seq_len)
    with atomic_output(out_dir / "ablation.md", folder=False, force=True) as tmp:
        tmp.write_text(table + "\n")
    plot_ablation(results, seq_len, out_dir / "ablation.png")
    write("\n" + table)


def markdown_table(results: list[dict[str, Any]], seq_len: int) -> str:
    """The results as a Markdown table, baseline first, with each loss's difference to it
    (a mixture of experts' parameters: total and active non-embedding)."""
    base = next((r for r in results if r["name"] == "baseline"), None)

    def delta(r, key):
        if base is None or r is base:
            return ""
        return f" ({r[key] - base[key]:+.3f})"

    def active(r):
        n = r.get("active_non_embedding_parameters", r["non_embedding_parameters"])
        return "" if n == r["non_embedding_parameters"] else f"; {n:,} active"

    lines = [f"| variant | what changes | val loss @{seq_len} | @{2 * seq_len} | @{4 * seq_len} "
             "| tokens/s | parameters (non-emb.) | KV bytes/token (bf16) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(
            f"| {r['name']} | {r['description']} | {r['val_loss']:.3f}{delta(r, 'val_loss')} "
            f"| {r['val_loss_2x']:.3f} | {r['val_loss_4x']:.3f} | {r['tokens_per_s']:,.0f} "
            f"| {r['parameters']:,} ({r['non_embedding_parameters']:,}{active(r)}) "
            f"| {r['kv_bytes_per_token']:,} |")
    return "\n".join(lines)


def plot_ablation(results: list[dict[str, Any]], seq_len: int, path: Path) -> None:
    """Validation loss per variant (bars), and loss against evaluation length for each variant
    (lines), written atomically to `path` (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from torchllama.checkpoint import atomic_output

    fig, (bars, lines) = plt.subplots(1, 2, figsize=(13, 5))
    names = [r["name"] for r in results]
    losses = [r["val_loss"] for r in results]
    bars.barh(names[::-1], losses[::-1], color="tab:blue")
    low = min(losses)
    bars.set_xlim(low - 0.15, max(losses) + 0.05)
    bars.set_xlabel(f"validation loss at {seq_len} tokens (nats/token)")
    bars.set_title("same data, tokens, seed and parameter budget")
    colors = plt.get_cmap("tab20").colors
    for i, r in enumerate(results):
        ys = [r["val_loss"], r["val_loss_2x"], r["val_loss_4x"]]
        style = "-" if r["name"] in POSITION_VARIANTS else ":"
        lines.plot([seq_len, 2 * seq_len, 4 * seq_len], ys, style, marker="o", label=r["name"],
                   color=colors[i % len(colors)])
    lines.set_xscale("log", base=2)
    lines.set_xticks([seq_len, 2 * seq_len, 4 * seq_len], [f"{seq_len} (trained)",
                                                         str(2 * seq_len), str(4 * seq_len)])
    lines.set_xlabel("evaluation length (tokens)")
    lines.set_ylabel("validation loss")
    lines.set_title("length generalisation (solid: position encodings)")
    finite = [v for r in results for v in (r["val_loss"], r["val_loss_2x"], r["val_loss_4x"])
              if math.isfinite(v)]
    if finite:
        lines.set_ylim(min(finite) - 0.1, min(max(finite), min(finite) + 4) + 0.1)
    lines.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    with atomic_output(path, folder=False, force=True) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
