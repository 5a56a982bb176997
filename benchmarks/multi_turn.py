"""Multi-turn chats against `torchllama serve`: the block prefix cache reuses the answers too.

1. A --turns-turn chat with a ~--system-token system prompt, resent in full every turn
   (temperature 0, --max-tokens a turn), on a server with the prefix cache and on one without
   (prefix_cache_mb=0): per turn its prompt, its new tokens (beyond the previous turn's prompt
   and answer), what each server prefilled (`/metrics`), and whether the answers are equal.
   Issue 30's target: every turn prefills ≤ its new tokens + one block; answers equal.
2. Eight chats at once sharing the system prompt, --chat-turns turns each: the blocks the cache
   holds against the blocks eight copies of the system prompt alone would take.

    .venv/bin/python benchmarks/multi_turn.py [--model PATH] [--turns 20] [--system 1000]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--system", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--chats", type=int, default=8)
    ap.add_argument("--chat-turns", type=int, default=4)
    args = ap.parse_args()
    import torch
    from openai import OpenAI

    from torchllama.bench.load import QUESTIONS, _metric
    from torchllama.generation.session import encode_chat
    from torchllama.serving.prefix_cache import common_prefix
    from torchllama.bench.multi_turn import replay_chat, system_prompt
    from torchllama.bench.serve import serve_in_thread
    from torchllama.checkpoint import resolve_model_path
    from torchllama.serving.app import create_app, load_for_engine
    from torchllama.serving.prefix_cache import BLOCK_SIZE

    path = str(resolve_model_path(args.model))
    model, tokenizer = load_for_engine(path, "auto", progress=False)
    system = system_prompt(tokenizer, args.system)
    print(f"{Path(path).name}; CPU capability {torch.backends.cpu.get_cpu_capability()}; "
          f"block {BLOCK_SIZE} tokens")
    runs = {}
    for budget in (512, 0):
        with serve_in_thread(create_app(model, tokenizer, "m", prefix_cache_mb=budget)) as url:
            client = OpenAI(base_url=f"{url}/v1", api_key="none")
            t0 = time.perf_counter()
            runs[budget] = replay_chat(client, url, system, args.turns, args.max_tokens)
            print(f"cache {'on ' if budget else 'off'}: {time.perf_counter() - t0:.1f} s")
        model.clear_caches()
    print(f"{'turn':>4}{'prompt':>8}{'new':>6}{'prefilled':>11}{'no cache':>10}{'equal':>7}")
    worst = 0
    for i, (on, off) in enumerate(zip(runs[512], runs[0])):
        worst = max(worst, on.prefilled - on.new_tokens)
        print(f"{i + 1:>4}{on.prompt_tokens:>8}{on.new_tokens:>6}{on.prefilled:>11}"
              f"{off.prefilled:>10}{str(on.answer == off.answer):>7}")
    equal = sum(a.answer == b.answer for a, b in zip(runs[512], runs[0]))
    print(f"answers equal: {equal} of {args.turns}; most a turn prefilled beyond its new tokens: "
          f"{worst} (a block is {BLOCK_SIZE})")

    with serve_in_thread(create_app(model, tokenizer, "m")) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="none")
        with concurrent.futures.ThreadPoolExecutor(args.chats) as pool:
            chats = list(pool.map(lambda c: _chat(client, url, system, c, args), range(args.chats)))
        blocks = int(_metric(url, "torchllama_prefix_cache_entries", None))
        reused = int(_metric(url, "torchllama_prefix_cache_tokens_reused_total", None))
    firsts = [encode_chat(tokenizer, [{"role": "system", "content": system}, {
        "role": "user", "content": f"(1) {QUESTIONS[(3 * c) % len(QUESTIONS)]}"}])
        for c in range(args.chats)]
    shared = min(common_prefix(firsts[0], f) for f in firsts[1:]) // BLOCK_SIZE
    own = sum((t[-1].prompt_tokens + t[-1].completion_tokens - 1) // BLOCK_SIZE - shared
              for t in chats)
    print(f"{args.chats} chats at once sharing a system prompt ({shared} whole blocks), "
          f"{args.chat_turns} turns each: the cache holds {blocks} blocks; at most the chats' "
          f"own {own} + the shared {shared} = {own + shared} expected (a copy per chat: "
          f"{own + args.chats * shared}); tokens reused {reused}")


def _chat(client, url, system, c, args):
    from torchllama.bench.multi_turn import replay_chat

    return replay_chat(client, url, system, args.chat_turns, args.max_tokens, offset=3 * c)


if __name__ == "__main__":
    main()
