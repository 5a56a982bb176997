"""Anatomy: look inside a real model — attention maps, head roles, RoPE, norms, sampling, the
logit lens, the loss landscape — as one report (`torchllama anatomy`) or from Python::

    from torchllama import anatomy
    report = anatomy.run(only="attention,heads")        # the embedded SmolLM2, default text
    report["heads"].tensors["induction"]                 # (n_layers, n_heads) scores
    report["heads"].figures[0].figure                    # a matplotlib Figure
    anatomy.write_report(report, "anatomy-out")          # index.html, figures/*.png, anatomy.json
    report["rope"].explorers[0].data                     # what the page's RoPE explorer draws

The capture API works on any `Transformer`: `capture_attention(model)` records every layer's
attention probabilities during a forward pass, `residual_stream(model, tokens)` the residual
stream after each block; `torchllama.anatomy.scores` scores attention patterns.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch

from torchllama.anatomy.capture import AttentionCapture, capture_attention, residual_stream
from torchllama.anatomy.report import (DEFAULT_TEXT, OPT_IN, SECTIONS, AnatomyContext, Explorer,
                                       Figure, Report, Section, Table, check_out_folder, parse_only,
                                       run_sections, token_labels, write_report)
from torchllama.errors import ArgumentError, ModelFileError

#: the most tokens of text analysed (attention maps are drawn for the first MAP_TOKENS of them)
MAX_TOKENS = 256


def build_context(model: Optional[str | os.PathLike] = None, text: Optional[str] = None, *,
                  text_file: Optional[str | os.PathLike] = None, max_tokens: int = MAX_TOKENS,
                  seed: int = 0, loaded=None) -> AnatomyContext:
    """Load the model (float32) and tokenize the text for a report.

    Args:
        model: a checkpoint path, a packaged name or a `torchllama train` run folder (None: the
            embedded SmolLM2-135M-Instruct).
        text / text_file: the text to analyse (default `DEFAULT_TEXT`); at most one.
        max_tokens: keep the first max_tokens tokens (and the model's context at most); the
            page states the truncation.
        seed: seed of every random choice of the sections.
        loaded: an already loaded (model, tokenizer) pair to use instead of loading `model`.

    Raises:
        ArgumentError: both text and text_file, an unreadable or empty text, max_tokens < 8.
        ModelFileError: a run folder without a checkpoint, or an unloadable model.
    """
    import torchllama

    if text is not None and text_file is not None:
        raise ArgumentError("give --text or --text-file, not both")
    if text_file is not None:
        try:
            text = Path(text_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ArgumentError(f"--text-file {text_file}: cannot read it as UTF-8 text ({e})")
    text = DEFAULT_TEXT if text is None else text
    if not text.strip():
        raise ArgumentError("--text: the text is empty")
    if max_tokens < 8:
        raise ArgumentError(f"max_tokens must be ≥ 8, got {max_tokens}")
    run_dir = None
    if model is not None and Path(model).is_dir() and (Path(model) / "log.jsonl").exists():
        run_dir = Path(model)
        if not (run_dir / "latest").exists() and not any(run_dir.glob("step-*")):
            raise ModelFileError(f"--model {run_dir}: a training run folder without a checkpoint "
                                 f"yet (no latest/ or step-*/); train it for at least one "
                                 f"checkpoint interval first")
    if loaded is None:
        loaded = torchllama.load(model, dtype="float32")
    net, tokenizer = loaded
    net = net.float().eval()
    net.clear_caches()
    ids = tokenizer.encode(text, bos=tokenizer.add_bos and tokenizer.bos_id is not None)
    notes = []
    limit = min(max_tokens, net.args.max_seq_len)
    if len(ids) > limit:
        notes.append(f"The text has {len(ids):,} tokens; the report analyses the first {limit} "
                     f"(--max-tokens, at most the model's context of {net.args.max_seq_len:,}).")
        ids = ids[:limit]
        text = tokenizer.decode([i for i in ids if i != tokenizer.bos_id])
    name = str(model) if model is not None else "SmolLM2-135M-Instruct (embedded)"
    return AnatomyContext(model=net, tokenizer=tokenizer, model_name=name, text=text,
                          tokens=torch.tensor([ids]), labels=token_labels(tokenizer, ids),
                          notes=notes, run_dir=run_dir, seed=seed)


def run(model: Optional[str | os.PathLike] = None, text: Optional[str] = None, *,
        text_file: Optional[str | os.PathLike] = None, only: Optional[str | list[str]] = None,
        max_tokens: int = MAX_TOKENS, seed: int = 0, loaded=None,
        options: Optional[dict] = None) -> Report:
    """Build the context (`build_context`) and run the sections (`parse_only(only)`; by
    default every section but the opt-in ones, and the loss landscape only for a run folder).
    `options` go to the sections (ctx.options, e.g. "long_text_file").

    Returns:
        a `Report`: report["heads"] is the Section of that name, with figures, data, tensors.

    Raises:
        ArgumentError / ModelFileError: as `build_context` and `parse_only`.
    """
    names = parse_only(only)
    ctx = build_context(model, text, text_file=text_file, max_tokens=max_tokens, seed=seed,
                        loaded=loaded)
    ctx.options.update(options or {})
    if only is None and ctx.run_dir is None:
        names = [n for n in names if n != "landscape"]
        ctx.notes.append("The loss landscape is left out: it needs a training run "
                         "(--model RUN, a torchllama train folder).")
    return run_sections(ctx, names)


__all__ = ["run", "build_context", "write_report", "capture_attention", "residual_stream",
           "AttentionCapture", "AnatomyContext", "Report", "Section", "Figure", "Table", "Explorer",
           "SECTIONS",
           "OPT_IN", "DEFAULT_TEXT", "parse_only", "check_out_folder", "run_sections", "token_labels", "MAX_TOKENS"]
