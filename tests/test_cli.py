"""The command line as a user runs it: golden output on the embedded model, the chat REPL, and
one clear line (no traceback) for each kind of bad input."""

import os
import subprocess
import sys

import gguf
import pytest

from torchllama.cli import main


def run_cli(*args, stdin=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "torchllama", *args], input=stdin,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONIOENCODING": "utf-8"})


def test_golden_capital_of_france(smollm2_gguf):
    result = run_cli("generate", "--prompt", "The capital of France is", "--temperature", "0",
                     "--max-new-tokens", "16")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("The capital of France is Paris")
    assert "tok/s" in result.stderr


def test_chat_repl_keeps_the_conversation_and_its_cache(smollm2_gguf):
    turns = "What is the capital of France?\nAnd what is the capital of Germany?\n/exit\n"
    # float32: the Q4_1 file's own weights with int8 activations (the default, as llama.cpp
    # computes them) answer this prompt "L'Étoile, la Marseillaise, …" at temperature 0, and so
    # does llama.cpp itself ("L'Étoile, la Cité, …"); the exact dequantized weights say Paris.
    result = run_cli("chat", "--temperature", "0", "--max-new-tokens", "40", "--dtype", "float32",
                     stdin=turns)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout and "Berlin" in result.stdout
    summaries = [line for line in result.stderr.splitlines() if "tok/s" in line]
    assert len(summaries) == 2
    # Turn 2 re-renders the whole conversation but prefills only what is not cached yet.
    prompt_tokens, prefilled = [int(w.strip("([")) for w in summaries[1].split()[:4:3]]
    assert prefilled < prompt_tokens / 2, summaries[1]


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory, smollm2_gguf):
    d = tmp_path_factory.mktemp("bad")
    truncated = d / "truncated.gguf"
    truncated.write_bytes(smollm2_gguf.read_bytes()[:2_000_000])
    gemma = d / "gemma.gguf"
    writer = gguf.GGUFWriter(str(gemma), "falcon")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    text = d / "notes.gguf"
    text.write_text("not a model\n")
    return {"truncated": truncated, "gemma": gemma, "text": text, "missing": d / "nope.gguf"}


@pytest.mark.parametrize("case, args, words", [
    ("missing", ["--model", "{missing}"], "no such file"),
    ("truncated", ["--model", "{truncated}"], "truncated or corrupt GGUF"),
    ("text", ["--model", "{text}"], "not a GGUF file"),
    ("gemma", ["--model", "{gemma}"], "architecture 'falcon'"),
    ("temperature", ["--temperature", "-1"], "temperature must be ≥ 0"),
    ("top_p_zero", ["--top-p", "0"], "top_p must be in (0, 1]"),
    ("top_p_big", ["--top-p", "1.5"], "top_p must be in (0, 1]"),
    ("top_k", ["--top-k", "-2"], "top_k must be an integer ≥ 0"),
    ("max_new", ["--max-new-tokens", "0"], "--max-new-tokens must be ≥ 1"),
    ("dtype", ["--dtype", "float8"], "--dtype 'float8' is not supported"),
    ("kv_cache_dtype", ["--kv-cache-dtype", "fp8"], "--kv-cache-dtype 'fp8' is not supported; "
     "use one of auto, float32, float16, bfloat16, q8_0"),
    ("too_long", ["--prompt", "hello " * 9000], "the context holds 8192"),
])
@pytest.mark.usefixtures("shared_cli_models")          # one real load for the cases that load
def test_bad_input_gives_one_clear_line(bad_files, capsys, case, args, words):
    args = [a.format(**{k: str(v) for k, v in bad_files.items()}) for a in args]
    if "--prompt" not in args:
        args += ["--prompt", "Hi"]
    assert main(["generate", *args]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    message = [line for line in err if line.startswith("torchllama: error:")]
    assert len(message) == 1 and words in message[0], err
    assert not any("Traceback" in line for line in err)
    if case in bad_files:
        assert str(bad_files[case]) in message[0]       # names the file


def test_bad_input_exit_code_and_debug_traceback(bad_files):
    result = run_cli("generate", "--model", str(bad_files["gemma"]), "--prompt", "Hi")
    assert result.returncode == 1
    assert result.stderr.strip().startswith("torchllama: error:") and "Traceback" not in result.stderr
    result = run_cli("generate", "--model", str(bad_files["gemma"]), "--prompt", "Hi", "--debug")
    assert result.returncode != 0 and "Traceback" in result.stderr


def test_help_lists_options_from_signatures():
    result = run_cli("generate", "--help")
    assert result.returncode == 0
    for flag in ("--prompt", "--model", "--max-new-tokens", "--temperature", "--top-k",
                 "--top-p", "--seed", "--chat", "--dtype"):
        assert flag in result.stdout
    assert "nucleus sampling" in result.stdout                 # help text from the docstring


@pytest.mark.usefixtures("shared_cli_models")          # three runs, one load
def test_seed_makes_sampling_reproducible(smollm2_gguf, capsys):
    def sample(seed):
        args = ["generate", "--prompt", "My favourite animal is", "--temperature", "1.0",
                "--top-k", "50", "--top-p", "0.95", "--max-new-tokens", "24", "--seed", seed]
        assert main(args) == 0
        return capsys.readouterr().out

    first, again, other = sample("7"), sample("7"), sample("8")
    assert first == again and first != other
    assert first.startswith("My favourite animal is")
