"""The `nanovllm` command, driven as a subprocess: generate (arguments, file, stdin) and chat (stdin)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def nanovllm(*args, stdin: str | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "nanovllm.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_generate_embedded_model_answers():
    result = nanovllm("generate", "--max-tokens", "24", "--quiet", "--max-model-len", "512",
                      "What is the capital of France?")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "### Prompt: What is the capital of France?" in result.stdout
    assert "Paris" in result.stdout
    assert "tok/s" in result.stdout


def test_chat_keeps_the_conversation_through_stdin():
    result = nanovllm("chat", "--max-tokens", "32", "--max-model-len", "1024",
                      stdin="What is the capital of France?\nAnd what is the capital of Italy?\n/exit\n")
    assert result.returncode == 0, result.stderr[-2000:]
    replies = result.stdout.strip().splitlines()
    assert any("Paris" in r for r in replies)
    assert any("Rome" in r for r in replies), "the second answer needs the first turn's context"


def test_text_prompt_to_a_model_without_tokenizer_is_an_error(tiny_qwen3):
    # a tokenizer-less model folder: prompts must be token ids, so text prompts are a clear error
    result = nanovllm("generate", "--model", tiny_qwen3, "--quiet", "hello")
    assert result.returncode == 2
    assert "no tokenizer" in result.stderr


def test_generate_reads_prompts_from_a_file_and_stdin(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Name three primary colors.\n\nWhat is 2 plus 2?\n")
    result = nanovllm("generate", "--max-tokens", "8", "--quiet", "--max-model-len", "512", "--file", str(prompts),
                      stdin="Write one sentence about the sea.\n")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "### Prompt: Name three primary colors." in result.stdout
    assert "### Prompt: What is 2 plus 2?" in result.stdout
    assert "Prompt: Write one sentence about the sea." not in result.stdout, "stdin is read only without prompts"
    result = nanovllm("generate", "--max-tokens", "8", "--quiet", "--max-model-len", "512",
                      stdin="Write one sentence about the sea.\n")
    assert "### Prompt: Write one sentence about the sea." in result.stdout


@pytest.mark.parametrize("args, words", [
    (["generate", "--max-tokens", "0", "hi"], ["max_tokens", "0"]),
    (["generate", "--model", "/no/such/model", "hi"], ["/no/such/model"]),
    (["generate", "--temperature", "-1", "hi"], ["temperature"]),
])
def test_bad_flags_give_a_clear_error(args, words):
    result = nanovllm(*args, "--quiet")
    assert result.returncode == 2
    for w in words:
        assert w in result.stderr


def test_help_documents_every_engine_flag():
    result = nanovllm("generate", "--help")
    for flag in ("--max-model-len", "--max-num-seqs", "--dtype", "--device", "--temperature", "--top-p",
                 "--max-tokens", "--kvcache-block-size", "--tensor-parallel-size", "--kv-cache-memory-bytes"):
        assert flag in result.stdout
