"""The `nanovllm` command at a terminal (a pseudo-terminal): chat's commands, Ctrl-C and Ctrl-D; Ctrl-C elsewhere."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

import pytest

pexpect = pytest.importorskip("pexpect")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", TERM="dumb")
# a long reply, so there is time to interrupt it; a small pool, so the model loads quickly
MAX_TOKENS = 4000
LONG = ["--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--max-model-len", "4096", "--max-num-seqs", "2"]
INTERRUPT_SECONDS = 60  # from Ctrl-C to the prompt: a few engine steps, even on a loaded machine
PROMPT = "\r\n> "


def as_from_a_shell() -> None:
    """In the child before exec: Ctrl-C back to its default, as a shell's foreground command starts. An ignored
    SIGINT survives exec and Python then leaves it ignored; a suite started as a background job of a
    non-interactive shell (`make test &`) ignores SIGINT, and so would every command it starts."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def spawn(*args: str) -> pexpect.spawn:
    child = pexpect.spawn(sys.executable, ["-m", "nanovllm.cli", *args], env=ENV, cwd=ROOT, encoding="utf-8",
                          timeout=180, dimensions=(24, 200), preexec_fn=as_from_a_shell)
    return child


def test_chat_at_a_terminal_help_interrupt_and_end_of_input():
    child = spawn("chat", *LONG)
    try:
        child.expect("Loading the embedded SmolLM2-135M-Instruct")
        child.expect(r"KV cache: .* tokens")
        child.expect(PROMPT)
        child.sendline("/help")
        child.expect("/reset")
        child.expect(PROMPT)
        assert "unknown command" not in child.before
        child.sendline("/nonsense")
        child.expect("unknown command '/nonsense'")
        child.expect(PROMPT)

        for message in ("Tell me a long story about a dragon.", "Now one about a cat."):
            child.sendline(message)
            child.expect_exact(message + "\r\n")  # the terminal's echo
            child.expect(r"\S[\s\S]{11}")  # the reply streams (any 12 characters of it)...
            interrupted_at = time.monotonic()
            child.sendintr()  # ...and Ctrl-C stops it, back at the prompt, the engine ready for the next one
            child.expect(r"\(interrupted\)", timeout=INTERRUPT_SECONDS)
            rest_of_reply = child.before
            child.expect(PROMPT, timeout=INTERRUPT_SECONDS)
            # stopped within a few engine steps: a small part of the MAX_TOKENS reply (~4 characters a token)
            assert time.monotonic() - interrupted_at < INTERRUPT_SECONDS
            assert len(rest_of_reply) < MAX_TOKENS // 4, rest_of_reply

        child.send("half a line")
        child.sendintr()  # Ctrl-C at the prompt drops the line, as a shell does
        child.expect(PROMPT)
        child.sendeof()  # Ctrl-D quits
        child.expect(pexpect.EOF)
        transcript = child.before
    finally:
        child.close()
    assert child.exitstatus == 0, transcript
    assert "Traceback" not in transcript


def test_a_ctrl_c_taken_by_another_thread_still_drops_the_line_at_the_prompt():
    # The kernel may hand a process's SIGINT to any of its threads; send it to one that is not the main thread.
    libc = ctypes.CDLL(None, use_errno=True)
    child = spawn("chat", "--max-tokens", "4")
    try:
        child.expect(PROMPT)
        child.sendline("Hi")  # one reply first, so the engine's threads exist
        child.expect(PROMPT)
        others = [int(t) for t in os.listdir(f"/proc/{child.pid}/task") if int(t) != child.pid]
        assert others, "the chat has no thread besides its main one"
        child.send("half a line")
        child.expect_exact("half a line")
        assert libc.tgkill(child.pid, others[0], signal.SIGINT) == 0, ctypes.get_errno()
        child.expect(PROMPT, timeout=30)
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_generate_without_prompts_at_a_terminal_says_it_reads_stdin():
    child = spawn("generate", "--quiet")
    try:
        child.expect("Reading prompts from stdin, one per line; end with Ctrl-D.")
        child.sendeof()  # nothing: no prompts, and nothing loaded
        child.expect("no prompts")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 2


def test_generate_under_sigint_exits_130_without_a_traceback():
    proc = subprocess.Popen([sys.executable, "-m", "nanovllm.cli", "generate", *LONG, "Tell me a long story."],
                            env=ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=as_from_a_shell)
    try:
        seen = ""
        deadline = time.monotonic() + 180
        while "KV cache:" not in seen:  # loaded: it is generating now
            line = proc.stderr.readline()
            assert line and time.monotonic() < deadline, f"no KV cache line; stderr: {seen}"
            seen += line
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "interrupted" in err
