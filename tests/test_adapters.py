"""Many LoRA adapters on one server (`transforms.multi_lora`, `serve --adapter NAME=DIR`,
/v1/load_lora_adapter, /v1/unload_lora_adapter).

Oracles: the single-adapter `LoRALinear` model (`transforms.lora`, the finetuning path) for
the batched update's math, in float32; the same request sent alone for every request of a
mixed batch (the engine's guarantee: the same bits whatever else runs); a server without a
prefix cache for answers that a cache keyed without the adapter would change.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import json
import shutil
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

openai = pytest.importorskip("openai")

from torchllama.transforms.lora import LoRAConfig, apply_lora, lora_modules, save_adapter  # noqa
from torchllama.transforms.multi_lora import add_adapter, install, read_adapter  # noqa: E402

PROMPTS = ["Tell me about the sea.", "Name a fruit.", "What is rain?", "Say hello.",
           "Describe a cat.", "Count to three.", "Where is Paris?", "Why is the sky blue?"]
TARGETS = {"one": ("wq", "wv", "w2"), "two": ("wk", "wo", "w1", "w3")}


def make_adapter(model, folder, targets, seed: int, size: float):
    """A PEFT adapter of random A and B (B ~ N(0, size²)) for `model`; returns the model with
    it applied (`LoRALinear`s)."""
    adapted = copy.deepcopy(model)
    config = LoRAConfig(r=4, alpha=8, targets=targets)
    torch.manual_seed(seed)
    apply_lora(adapted, config)
    with torch.no_grad():
        for module in lora_modules(adapted).values():
            module.lora_B.normal_(0.0, size)
    folder.mkdir()
    save_adapter(adapted, config, folder)
    return adapted


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory, smollm2_auto):
    tmp = tmp_path_factory.mktemp("adapters")
    model = smollm2_auto[0]
    for seed, (name, targets) in enumerate(TARGETS.items()):
        make_adapter(model, tmp / name, targets, seed, 0.3)     # large enough to change
    return {name: str(tmp / name) for name in TARGETS}


def test_batched_updates_equal_the_finetuning_modules_and_are_batch_invariant(
        smollm2, tmp_path):
    """Float32 SmolLM2: each adapter's logits equal the `LoRALinear` model's (1e-4: the same
    products in another order); rows of one batch with base/one/two equal each alone."""
    model = copy.deepcopy(smollm2[0])
    model.clear_caches()                         # (the shared model may carry other tests')
    references = {name: make_adapter(model, tmp_path / name, targets, seed, 0.01)
                  for seed, (name, targets) in enumerate(TARGETS.items())}
    adapters = install(model)
    for name in TARGETS:
        add_adapter(adapters, read_adapter(model, name, tmp_path / name))
    ids = torch.tensor([smollm2[1].encode("The capital of France is")])
    with torch.inference_mode():
        base = model(ids)[0, -1]
        alone = {}
        for name, reference in references.items():
            with adapters.selecting([adapters.ids[name]]):
                alone[name] = model(ids)[0, -1]
            expected = reference(ids)[0, -1]
            assert (alone[name] - expected).abs().max() < 1e-4, name
            assert (alone[name] - base).abs().max() > 1e-2, name        # it does something
        with adapters.selecting([adapters.ids["two"], -1, adapters.ids["one"]]):
            batch = model(ids.repeat(3, 1))[:, -1]
    assert torch.equal(batch[0], alone["two"]) and torch.equal(batch[1], base) and \
        torch.equal(batch[2], alone["one"])


def test_bad_adapters_name_the_problem(smollm2_auto, tmp_path):
    from torchllama.errors import ModelFileError

    model = copy.deepcopy(smollm2_auto[0])
    dora = copy.deepcopy(model)
    install(model)
    with pytest.raises(ModelFileError, match="adapter_config.json"):
        read_adapter(model, "x", tmp_path)
    config = LoRAConfig(r=2, alpha=4, targets=("wq",), dora=True)
    apply_lora(dora, config)
    (tmp_path / "dora").mkdir()
    save_adapter(dora, config, tmp_path / "dora")
    with pytest.raises(ModelFileError, match="DoRA"):
        read_adapter(model, "x", tmp_path / "dora")


def test_serve_adapter_values_split_into_base_and_named():
    from torchllama.cli import _adapters
    from torchllama.errors import ArgumentError

    assert _adapters(["a=/x", "run", "b=/y=z"]) == ("run", {"a": "/x", "b": "/y=z"})
    for bad in (["x", "y"], ["a=/x", "a=/y"], ["=/x"], ["a="]):
        with pytest.raises(ArgumentError):
            _adapters(bad)


# --------------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(smollm2_gguf, adapter_dirs):
    """SmolLM2 at the default dtype, adapter "one" loaded at start ("two" loaded by tests)."""
    from torchllama.bench.serve import serve_in_thread
    from torchllama.serving.app import create_app, load_for_engine

    model, tokenizer = load_for_engine(str(smollm2_gguf), "auto", progress=False)
    root = str(Path(adapter_dirs["one"]).parent)
    app = create_app(model, tokenizer, "base", adapters={"one": adapter_dirs["one"]},
                     allow_adapter_loading=True, adapter_root=root)
    with serve_in_thread(app) as url:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                           timeout=120) as client:
            yield url, client


def post(url: str, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def ask(client, model: str, prompt: str, max_tokens: int = 16, stream: bool = False) -> str:
    kwargs = dict(model=model, messages=[{"role": "user", "content": prompt}],
                  max_tokens=max_tokens, temperature=0)
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0].message.content
    return "".join(e.choices[0].delta.content or "" for e in
                   client.chat.completions.create(stream=True, **kwargs) if e.choices)


def test_a_mixed_batch_gives_every_request_its_answer_alone(server, adapter_dirs):
    url, client = server
    status, _ = post(url, "/v1/load_lora_adapter", {"lora_name": "two",
                                                     "lora_path": adapter_dirs["two"]})
    assert status == 200
    ids = [m.id for m in client.models.list().data]
    assert ids == ["base", "one", "two"]
    jobs = [(["base", "one", "two"][i % 3], p) for i, p in enumerate(PROMPTS)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda j: ask(client, *j), jobs))
    alone = [ask(client, *j) for j in jobs]
    assert together == alone
    by_model = {m: ask(client, m, PROMPTS[0]) for m in ("base", "one", "two")}
    assert client.chat.completions.create(model="two", max_tokens=1, messages=[
        {"role": "user", "content": "hi"}]).model == "two"
    assert len(set(by_model.values())) == 3                 # each adapter changes the answer


def test_loading_while_eight_streams_run_loses_none(server, adapter_dirs):
    url, client = server
    jobs = [(["base", "one"][i % 2], p) for i, p in enumerate(PROMPTS)]
    alone = [ask(client, m, p, 48) for m, p in jobs]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        streams = [pool.submit(ask, client, m, p, 48, True) for m, p in jobs]
        time.sleep(0.5)
        status, body = post(url, "/v1/load_lora_adapter", {"lora_name": "three",
                                                           "lora_path": adapter_dirs["two"]})
        results = [f.result() for f in streams]
    assert status == 200, body
    assert results == alone
    assert ask(client, "three", PROMPTS[0]) == ask(client, "two", PROMPTS[0])


def test_unloading_waits_for_the_requests_using_the_adapter(server, adapter_dirs):
    url, client = server
    post(url, "/v1/load_lora_adapter", {"lora_name": "four", "lora_path": adapter_dirs["one"]})
    expected = ask(client, "four", PROMPTS[1], 64)
    got: dict = {}

    def long_request():
        got["text"] = ask(client, "four", PROMPTS[1], 64, stream=True)
        got["done"] = time.monotonic()

    worker = threading.Thread(target=long_request)
    worker.start()
    time.sleep(0.3)
    running = "done" not in got                  # (64 tokens take ~0.6 s or more here)
    status, _ = post(url, "/v1/unload_lora_adapter", {"lora_name": "four"})
    unloaded = time.monotonic()
    worker.join()
    # Detaching the adapter mid-request would change the rest of the answer. The stream's
    # last bytes and the unload's answer come on two connections, so they may arrive in
    # either order (CI once saw the stream end 0.9 ms after the unload's answer): the
    # stream must end within a moment of the answer, not a request's length later.
    assert running and status == 200 and got["text"] == expected
    assert got["done"] - unloaded < 0.1
    assert "four" not in [m.id for m in client.models.list().data]


@pytest.mark.parametrize("path,body,status,param,says", [
    ("/v1/load_lora_adapter", {"lora_name": "one", "lora_path": "two"}, 400, "lora_name",
     "already"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "nope"}, 400, "lora_path",
     "no such folder"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/etc"}, 403, "lora_path",
     "inside"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nope"}, 403, "lora_path",
     "inside"),                                  # (outside: the same answer, existing or not)
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "one/../two"}, 400, "lora_path",
     "'..'"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "é" * 300}, 400, "lora_path",
     "cannot read"),                             # (found by the schema fuzzing: was a 500)
    ("/v1/unload_lora_adapter", {"lora_name": "nope"}, 404, "lora_name", "no LoRA adapter"),
])
def test_bad_adapter_requests(server, path, body, status, param, says):
    got, answer = post(server[0], path, body)
    assert got == status and answer["error"]["param"] == param, answer
    assert says in answer["error"]["message"]


def test_a_symlink_out_of_the_root_is_refused(server, adapter_dirs, tmp_path):
    """A folder inside the root that is a symlink to one outside, and an adapter folder whose
    weights file links out: both 403, nothing read."""
    root = Path(adapter_dirs["one"]).parent
    outside = tmp_path / "outside"
    shutil.copytree(adapter_dirs["one"], outside)
    (root / "linked").symlink_to(outside, target_is_directory=True)
    (root / "file_linked").mkdir()
    for f in Path(adapter_dirs["one"]).iterdir():
        (root / "file_linked" / f.name).symlink_to(outside / f.name)
    for folder in ("linked", "file_linked"):
        status, answer = post(server[0], "/v1/load_lora_adapter",
                              {"lora_name": folder, "lora_path": folder})
        assert status == 403 and "inside" in answer["error"]["message"], answer


def _broken(source: str, folder: Path, how: str) -> Path:
    """A copy of an adapter broken one way."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, folder)
    weights = load_file(str(folder / "adapter_model.safetensors"))
    key = sorted(weights)[0]
    if how == "nan":
        weights[key][0, 0] = float("nan")
    elif how == "shape":
        weights[key] = weights[key][:, :-1].contiguous()
    elif how == "dtype":
        weights[key] = weights[key].to(torch.int32)
    elif how == "extra":
        weights["base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight"] = \
            weights[key].clone()
    elif how == "rank":
        config = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**config, "r": 0}))
    elif how == "json":
        (folder / "adapter_config.json").write_text("{not json")
    elif how == "targets":
        config = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps(
            {**config, "target_modules": ["conv_in"]}))
    save_file(weights, str(folder / "adapter_model.safetensors"))
    return folder


@pytest.mark.parametrize("how,says", [
    ("nan", "NaN"), ("shape", "this model needs"), ("dtype", "floating-point"),
    ("extra", "belong to no target module"), ("rank", "r must be"), ("json", "JSON"),
    ("targets", "not a LoRA configuration")])
def test_a_malformed_adapter_is_a_400_and_serving_goes_on(server, adapter_dirs, how, says):
    url, client = server
    root = Path(adapter_dirs["one"]).parent
    before = ask(client, "base", PROMPTS[2])
    _broken(adapter_dirs["one"], root / f"broken_{how}", how)
    status, answer = post(url, "/v1/load_lora_adapter",
                          {"lora_name": f"broken_{how}", "lora_path": f"broken_{how}"})
    assert status == 400 and says in answer["error"]["message"], answer
    assert f"broken_{how}" not in [m.id for m in client.models.list().data]
    assert ask(client, "base", PROMPTS[2]) == before
    assert ask(client, "one", PROMPTS[2]) == ask(client, "one", PROMPTS[2])


def test_runtime_loading_is_off_by_default(adapter_dirs):
    """Without --allow-adapter-loading, load and unload are 403 and name the switch; nothing
    is read (the engine is never asked)."""
    from torchllama.serving.adapters import Adapters
    from torchllama.serving.api.core import APIError

    adapters = Adapters(engine=None, model_name="base")
    for call in (adapters.load("x", adapter_dirs["one"]), adapters.unload("one")):
        with pytest.raises(APIError) as e:
            asyncio.run(call)
        assert e.value.status == 403 and "--allow-adapter-loading" in e.value.message


def test_serve_refuses_a_missing_adapter_root():
    from torchllama.cli import main

    assert main(["serve", "--adapter-root", "/nope/none"]) == 1


def test_the_prefix_cache_keeps_adapters_apart(server):
    """A long prompt on the base, then on adapter "one": no hit (the base's keys are not the
    adapter's); again on "one": a hit, the same answer."""
    from torchllama.bench.load import _metric

    url, client = server
    messages = [{"role": "system", "content": "Adapters apart. " + " ".join(PROMPTS * 8)},
                {"role": "user", "content": "Which one?"}]     # several blocks, all new

    def answer(model: str) -> str:
        return client.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                              temperature=0).choices[0].message.content

    answer("base")
    hits = _metric(url, "torchllama_prefix_cache_hits_total", None)
    first = answer("one")
    assert _metric(url, "torchllama_prefix_cache_hits_total", None) == hits
    assert answer("one") == first
    assert _metric(url, "torchllama_prefix_cache_hits_total", None) == hits + 1
