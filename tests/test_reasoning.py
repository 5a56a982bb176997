"""Reasoning output: `<think>…</think>` returned as `reasoning_content` (`serving.reasoning`).

Oracles: the text itself (what is between the tags is the reasoning, the rest the answer); the
whole answer for the streamed one (the same seed); the rendered prompt for
`chat_template_kwargs` (Qwen3's enable_thinking). The server runs SmolLM2 with a thinking
template (its own ChatML plus Qwen3's enable_thinking switch), its output forced into a
thinking model's shape by a regex.
"""

from __future__ import annotations

import pytest

from torchllama.serving.reasoning import ReasoningParser, split_reasoning, template_thinks

openai = pytest.importorskip("openai")

ANSWER = "<think>\nThe user greets me.\nI greet back.\n</think>\n\nHello there!"


@pytest.mark.parametrize("step", [1, 2, 3, 5, 8, 64])
def test_pieces_give_the_whole_split(step):
    whole = split_reasoning(ANSWER)
    assert whole == ("\nThe user greets me.\nI greet back.\n", "Hello there!")
    parser, events = ReasoningParser(), []
    for i in range(0, len(ANSWER), step):
        events += parser.feed(ANSWER[i:i + step])
    events += parser.finish()
    assert "".join(t for k, t in events if k == "reasoning") == whole[0]
    assert "".join(t for k, t in events if k == "content") == whole[1]


def test_answers_without_thinking_opened_inside_or_cut_short():
    assert split_reasoning("Hello <thin") == (None, "Hello <thin")
    assert split_reasoning("  Hi") == (None, "  Hi")
    assert split_reasoning("I think.</think>\n\nYes.", inside=True) == ("I think.", "Yes.")
    assert split_reasoning("<think>still thinking", inside=False) == ("still thinking", "")
    assert split_reasoning("<think>\n\n</think>\n\nOk") == ("\n\n", "Ok")


THINKING = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
            "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt "
            "%}{{ '<|im_start|>assistant\n' }}{% if enable_thinking is defined and not "
            "enable_thinking %}{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}")
OPENS = THINKING.replace("{% if enable_thinking is defined", "{{ '<think>\n' }}{% if false")


@pytest.fixture(scope="module")
def serve(smollm2_gguf):
    """serve(template) → an openai client of SmolLM2 with that chat template."""
    import contextlib

    from torchllama.bench.serve import serve_in_thread
    from torchllama.serving.app import create_app, load_for_engine

    model, tokenizer = load_for_engine(str(smollm2_gguf), "auto", progress=False)
    original = tokenizer.chat_template
    stack = contextlib.ExitStack()

    def start(template: str):
        model.clear_caches()
        tokenizer.chat_template = template
        url = stack.enter_context(serve_in_thread(create_app(model, tokenizer, "m")))
        return stack.enter_context(openai.OpenAI(base_url=f"{url}/v1", api_key="none",
                                                 max_retries=0))
    with stack:
        yield start
    tokenizer.chat_template = original


def _streamed(client, **kwargs) -> tuple[str, str]:
    reasoning = content = ""
    for event in client.chat.completions.create(stream=True, **kwargs):
        if event.choices:
            delta = event.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
    return reasoning, content


def test_the_server_returns_reasoning_apart_streamed_or_not(serve):
    assert template_thinks(THINKING) and template_thinks(OPENS)
    client = serve(THINKING)
    kwargs = dict(model="m", messages=[{"role": "user", "content": "Say hi."}], max_tokens=60,
                  temperature=0.8, seed=3,
                  extra_body={"regex": "<think>\n[a-z ]{3,30}\n</think>\n\n[A-Z][a-z ]{2,20}[.!]"})
    message = client.chat.completions.create(**kwargs).choices[0].message
    thought, answer = message.reasoning_content, message.content
    assert thought.startswith("\n") and thought.endswith("\n") and "<" not in thought
    assert answer[0].isupper() and "<" not in answer
    assert _streamed(client, **kwargs) == (thought, answer)
    off = client.chat.completions.create(model="m", max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": "Say hi."}], extra_body={
        "chat_template_kwargs": {"enable_thinking": False}})
    plain = client.chat.completions.create(model="m", max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": "Say hi."}])
    assert off.usage.prompt_tokens > plain.usage.prompt_tokens       # the empty pair added
    assert off.choices[0].message.reasoning_content is None


def test_a_template_that_opens_the_reasoning(serve):
    client = serve(OPENS)
    kwargs = dict(model="m", messages=[{"role": "user", "content": "Say hi."}], max_tokens=60,
                  temperature=0, extra_body={"regex": "[a-z ]{3,30}</think>\n\n[A-Z][a-z ]{2,20}"})
    message = client.chat.completions.create(**kwargs).choices[0].message
    assert message.reasoning_content and "<" not in message.reasoning_content
    assert message.content[0].isupper()
    assert _streamed(client, **kwargs) == (message.reasoning_content, message.content)


def test_chat_shows_the_answer_and_sets_the_reasoning_apart(smollm2_auto, capsys):
    """`torchllama chat` with a thinking model: the answer on stdout, the reasoning on stderr
    (dimmed on a terminal), the history keeps the answer only."""
    from torchllama.cli import _stream_answer
    from torchllama.serving.reasoning import ReasoningParser

    tokenizer = smollm2_auto[1]
    ids = tokenizer.encode(ANSWER)

    class Replay:                                     # a session that "generates" ANSWER
        def generate(self, prompt_ids, max_new_tokens, sampling):
            yield from ids

    reasoning = ReasoningParser()
    assert list(_stream_answer(Replay(), tokenizer, [1], 64, None, reasoning)) == ids
    out, err = capsys.readouterr()
    assert out == "Hello there!\n" and "I greet back." in err
    assert reasoning.content == "Hello there!"
