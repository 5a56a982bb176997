"""Multi-turn chats replayed against a server: what each turn prefills, from /metrics.

An agent or chat client resends the whole conversation every turn: the system prompt, every
question and every answer it got. `replay_chat` plays such a chat (temperature 0), reading the
server's `torchllama_prompt_tokens_prefilled_total` around each turn; `Turn.new_tokens` is what
the turn brings beyond the previous turn's prompt and answer. With the block prefix cache a
turn prefills at most its new tokens + one block (`torchllama.serving.prefix_cache`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torchllama.bench.load import QUESTIONS, SYSTEMS, _metric

PREFILLED = "torchllama_prompt_tokens_prefilled_total"


@dataclass
class Turn:
    """One turn: its prompt and answer (tokens), the tokens the server prefilled for it, and
    the answer's text."""

    prompt_tokens: int
    completion_tokens: int
    prefilled: int
    answer: str
    new_tokens: int = 0


def system_prompt(tokenizer, tokens: int) -> str:
    """A system prompt of about `tokens` tokens (the load bench's system prompts, repeated)."""
    text, i = "", 0
    while len(tokenizer.encode(text)) < tokens:
        text += SYSTEMS[i % len(SYSTEMS)]
        i += 1
    return text


def replay_chat(client, url: str, system: str, turns: int, max_tokens: int = 16,
                offset: int = 0, api_key: Optional[str] = None) -> list[Turn]:
    """Play a `turns`-turn chat with the openai `client` (questions from the load bench's,
    starting at `offset`), each turn the whole conversation so far, temperature 0; return its
    turns with what the server prefilled for each (one chat at a time on the server)."""
    messages = [{"role": "system", "content": system}]
    out: list[Turn] = []
    for t in range(turns):
        messages.append({"role": "user", "content": f"({t + 1}) "
                                                    f"{QUESTIONS[(offset + t) % len(QUESTIONS)]}"})
        before = _metric(url, PREFILLED, api_key)
        r = client.chat.completions.create(model="m", messages=messages, temperature=0,
                                           max_tokens=max_tokens)
        prefilled = int(_metric(url, PREFILLED, api_key) - before)
        answer = r.choices[0].message.content
        turn = Turn(r.usage.prompt_tokens, r.usage.completion_tokens, prefilled, answer)
        if out:
            turn.new_tokens = turn.prompt_tokens - out[-1].prompt_tokens - \
                out[-1].completion_tokens
        else:
            turn.new_tokens = turn.prompt_tokens
        out.append(turn)
        messages.append({"role": "assistant", "content": answer})
    return out
