"""The continuous-batching engine: requests joining and leaving at any step get exactly the tokens
they would get alone (greedy), each in its own cache row at its own positions, through chunked
prefills, the prefix cache and cancellations; for full, sliding-window and MLA caches."""

import copy
import threading
import time

import pytest
import torch

from torchllama.config import get_preset
from torchllama.serving.engine import Engine, QueueFull, Request
from torchllama.errors import ArgumentError, ContextLengthError
from torchllama.generation.session import Session
from torchllama.generation.sampling import SamplingParams


class StubTokenizer:
    stop_ids = frozenset()


@pytest.fixture(scope="module", params=["float32", "int4"])
def tiny_model(request):
    """The debug preset (128-token context) in float32 and with int4 weights (torchllama's
    block kernels where they are built: the default path of quantized models)."""
    torch.manual_seed(0)
    from torchllama.model import Transformer
    from torchllama.transforms.quantize import quantize_model
    model = Transformer(get_preset("debug")).eval()
    return model if request.param == "float32" else quantize_model(model, "int4")


def alone(model, prompt, n, sampling=SamplingParams()):
    session = Session(copy.deepcopy(model), StubTokenizer())
    return list(session.generate(prompt, n, sampling, stop_ids=frozenset()))


class Client:
    """Collects one request's tokens and finish reason (cancels itself after `cancel_after`)."""

    def __init__(self, prompt, max_tokens, sampling=SamplingParams(), stop_ids=frozenset(),
                 cancel_after=None):
        self.tokens, self.reason, self.done = [], None, threading.Event()
        self.cancel_after = cancel_after
        self.request = Request(prompt, max_tokens, sampling, stop_ids, self._token, self._finish)

    def _token(self, event):
        self.tokens.append(event.token_id)
        if len(self.tokens) == self.cancel_after:
            self.request.cancel()             # as the server does when a client goes away

    def _finish(self, reason):
        self.reason = reason
        self.done.set()


def run(engine, plan):
    """plan: [(delay_s, Client)], submitted in order after each delay; waits for all."""
    for delay, client in plan:
        time.sleep(delay)
        engine.submit(client.request)
    for _, client in plan:
        assert client.done.wait(60), "request did not finish"


def test_joining_and_leaving_at_any_step(tiny_model):
    engine = Engine(copy.deepcopy(tiny_model), max_batch_size=3).start()
    try:
        prompts = [[5, 6, 7], list(range(10, 40)), [50], list(range(60, 70)), [80, 81]]
        lengths = [20, 8, 30, 12, 25]
        clients = [Client(p, n) for p, n in zip(prompts, lengths)]
        # Staggered: a 30-token prompt arrives after a 3-token one has started (the rows at
        # different positions); more requests than rows wait for a free one.
        run(engine, [(0.0, clients[0]), (0.01, clients[1]), (0.0, clients[2]),
                     (0.02, clients[3]), (0.0, clients[4])])
        for prompt, n, client in zip(prompts, lengths, clients):
            assert client.tokens == alone(tiny_model, prompt, n)
            assert client.reason == "length"
        assert engine.steps < sum(lengths)          # requests shared decode steps
    finally:
        engine.shutdown()


def test_context_ends_with_length(tiny_model):
    engine = Engine(copy.deepcopy(tiny_model), max_batch_size=2).start()
    try:
        long_runner = Client([1, 2, 3, 4], 200)              # wants more than the context
        late = Client(list(range(20, 50)), 60)              # joins later, behind it
        run(engine, [(0.0, long_runner), (0.05, late)])
        assert long_runner.reason == "length"
        assert len(long_runner.tokens) == 128 - 4            # stopped by the context
        assert long_runner.tokens == alone(tiny_model, [1, 2, 3, 4], 124)
        assert late.tokens == alone(tiny_model, list(range(20, 50)), 60)
    finally:
        engine.shutdown()


def test_stop_ids_sampling_and_cancel(tiny_model):
    engine = Engine(copy.deepcopy(tiny_model), max_batch_size=4).start()
    try:
        free = alone(tiny_model, [7, 8, 9], 12)
        stopper = Client([7, 8, 9], 12, stop_ids=frozenset({free[5]}))
        params = SamplingParams(temperature=1.0, top_k=40, seed=3)
        sampled = Client([7, 8, 9], 12, params)
        cancelled = Client([1, 2], 100, cancel_after=3)
        run(engine, [(0.0, stopper), (0.0, sampled)])
        assert stopper.tokens == free[:free.index(free[5])] and stopper.reason == "stop"
        assert sampled.tokens == alone(tiny_model, [7, 8, 9], 12, params)
        engine.submit(cancelled.request)
        assert cancelled.done.wait(10) and cancelled.reason == "cancelled"
        assert len(cancelled.tokens) == 3
        deadline = time.time() + 5
        while engine.active and time.time() < deadline:
            time.sleep(0.01)
        assert engine.active == 0                             # its row is free again
        after = Client([7, 8, 9], 5)
        run(engine, [(0.0, after)])
        assert after.tokens == free[:5]
    finally:
        engine.shutdown()


class LetterTokenizer:
    """Token i is the letter chr(65 + i % 26): text whose stop strings span tokens."""

    @staticmethod
    def decode(ids):
        return "".join(chr(65 + i % 26) for i in ids)


def test_a_stop_string_finishes_its_row_in_the_same_step(tiny_model):
    from torchllama.generation.text import TextStream

    prompt = [7, 8, 9]
    free = alone(tiny_model, prompt, 12)
    full = LetterTokenizer.decode(free)
    stop = full[4:6]                                   # the 5th and 6th tokens' letters
    cut = full.index(stop)                             # (or earlier, if they appear before)
    engine = Engine(copy.deepcopy(tiny_model), max_batch_size=2).start()
    try:
        events = []
        client = Client(prompt, 12)
        client.request.text = TextStream(LetterTokenizer(), prompt, [stop])
        client.request.on_token = lambda e, f=client.request.on_token: (events.append(e), f(e))
        run(engine, [(0.0, client)])
    finally:
        engine.shutdown()
    assert client.reason == "stop"
    assert client.tokens == free[:cut + len(stop)]          # up to the stop string's last token
    assert "".join(e.text for e in events) + client.request.tail == full[:cut]
    assert [e.stopped for e in events] == [False] * (len(events) - 1) + [True]
    assert engine.steps == len(client.tokens) - 1           # no step after it


def test_offline_batches_end_at_their_stop_strings(tiny_model):
    from torchllama.serving.batch import complete

    prompts = [[7, 8, 9], [1, 2], [30, 31, 32, 33]]
    free = [alone(tiny_model, p, 10) for p in prompts]
    stop = LetterTokenizer.decode(free[0])[3:5]
    results = list(complete(copy.deepcopy(tiny_model), prompts, 10, tokenizer=LetterTokenizer(),
                            stop=[stop], max_batch_size=2))
    for tokens, result in zip(free, results):
        text = LetterTokenizer.decode(tokens)
        if stop in text:
            end = text.index(stop) + len(stop)
            assert result.token_ids == tokens[:end] and result.finish_reason == "stop"
            assert result.text == text[:end - len(stop)]
        else:
            assert result.token_ids == tokens and result.finish_reason == "length"
            assert result.text == text
    assert results[0].finish_reason == "stop"


def test_submit_errors_and_queue_bound(tiny_model):
    engine = Engine(copy.deepcopy(tiny_model), max_batch_size=1, max_queue=1)   # not started
    with pytest.raises(ArgumentError, match="empty"):
        engine.submit(Client([], 1).request)
    with pytest.raises(ArgumentError, match="max_tokens"):
        engine.submit(Client([1], 0).request)
    with pytest.raises(ContextLengthError, match="at most 127"):
        engine.submit(Client(list(range(128)), 1).request)
    engine.submit(Client([1], 1).request)
    with pytest.raises(QueueFull):
        engine.submit(Client([2], 1).request)


# --------------------------------------------------------------------------------------------
# Batched and chunked prefill
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def long_model():
    """The debug preset with a 4096-token context, for prompts longer than a prefill chunk."""
    import dataclasses

    from torchllama.model import Transformer
    torch.manual_seed(0)
    return Transformer(dataclasses.replace(get_preset("debug"), max_seq_len=4096)).eval()


def random_prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (n,), generator=g).tolist()


def record_forwards(engine, log, with_start_pos=False):
    """Append ("forward", (B, T)) to log at every forward pass of the engine's model (and its
    start_pos: an int for a prefill chunk, a (B,) tensor for a decode step)."""
    engine.model.register_forward_pre_hook(
        lambda module, args: log.append(("forward", tuple(args[0].shape)) +
                                        ((args[1],) if with_start_pos else ())))


def test_requests_arriving_together_are_prefilled_in_their_own_rows(tiny_model):
    prompts = [[5, 6, 7], list(range(10, 40)), [50], list(range(60, 70))]
    lengths = [6, 9, 12, 5]
    # Each prompt alone in its row, at most `prefill_chunk` prompt tokens per iteration: with 32,
    # [3] and the first 29 of [30], then the last one of [30], [1] and [10].
    for chunk, forwards in ((512, [(1, 3), (1, 30), (1, 1), (1, 10)]),
                            (32, [(1, 3), (1, 29), (1, 1), (1, 1), (1, 10)])):
        engine = Engine(copy.deepcopy(tiny_model), max_batch_size=4, prefill_chunk=chunk)
        calls = []
        record_forwards(engine, calls, with_start_pos=True)
        clients = [Client(p, n) for p, n in zip(prompts, lengths)]
        for client in clients:                  # all waiting when the engine starts
            engine.submit(client.request)
        engine.start()
        try:
            for client in clients:
                assert client.done.wait(60)
            for prompt, n, client in zip(prompts, lengths, clients):
                assert client.tokens == alone(tiny_model, prompt, n)
            prefills = [shape for _, shape, start_pos in calls if isinstance(start_pos, int)]
            assert prefills == forwards and engine.prefills == len(forwards)
            first_decode = next(i for i, (_, _, p) in enumerate(calls) if not isinstance(p, int))
            if chunk == 512:                               # then one step for all four rows
                assert calls[first_decode][1] == (4, 1)
        finally:
            engine.shutdown()


def test_long_prompt_is_prefilled_in_chunks_between_decode_steps(long_model):
    engine = Engine(copy.deepcopy(long_model), max_batch_size=2, prefill_chunk=512).start()
    timeline = []
    record_forwards(engine, timeline)
    try:
        running = Client([1, 2, 3], 300)
        long = Client(random_prompt(2000, 1), 6)
        running.request.on_token = lambda e, f=running.request.on_token: (
            timeline.append(("running", e.token_id)), f(e))
        long.request.on_token = lambda e, f=long.request.on_token: (
            timeline.append(("long", e.token_id)), f(e))
        engine.submit(running.request)
        while len(running.tokens) < 3:
            time.sleep(0.001)
        engine.submit(long.request)
        assert long.done.wait(60) and running.done.wait(60)
        # Chunks of 512 tokens (the last 464), the running stream getting tokens between them.
        chunks = [i for i, (kind, shape) in enumerate(timeline)
                  if kind == "forward" and shape[1] > 3]
        assert [timeline[i][1] for i in chunks] == [(1, 512)] * 3 + [(1, 464)]
        first_long = next(i for i, (kind, _) in enumerate(timeline) if kind == "long")
        between = [kind for kind, _ in timeline[chunks[0]:first_long]]
        assert between.count("running") >= 3
        assert long.tokens == alone(long_model, long.request.prompt_ids, 6)
        assert running.tokens == alone(long_model, [1, 2, 3], 300)
    finally:
        engine.shutdown()


def test_chunked_prefills_overlap_and_run_alone(long_model):
    """A long prompt admitted while another is mid-prefill shares the iterations' prefill budget
    with it; a long prompt with nothing else running advances alone."""
    engine = Engine(copy.deepcopy(long_model), max_batch_size=3, prefill_chunk=256).start()
    try:
        running = Client([9, 8, 7], 200)
        first = Client(random_prompt(1500, 2), 20)
        second = Client(random_prompt(2500, 3), 20)
        engine.submit(running.request)
        while not running.tokens:
            time.sleep(0.001)
        engine.submit(first.request)
        engine.submit(second.request)
        for client in (running, first, second):
            assert client.done.wait(60)
        alone_prompt = random_prompt(1000, 4)
        by_itself = Client(alone_prompt, 10)
        run(engine, [(0.0, by_itself)])
        assert running.tokens == alone(long_model, [9, 8, 7], 200)
        assert first.tokens == alone(long_model, first.request.prompt_ids, 20)
        assert second.tokens == alone(long_model, second.request.prompt_ids, 20)
        assert by_itself.tokens == alone(long_model, alone_prompt, 10)
    finally:
        engine.shutdown()
