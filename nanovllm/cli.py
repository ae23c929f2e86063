"""The `nanovllm` command: generate, chat and serve, with vLLM-style flags."""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time
import warnings

from nanovllm.engine_args import DefaultsHelpFormatter, add_engine_args, engine_kwargs

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a command stopped by Ctrl-C
CHAT_HELP = """commands:
  /help          this list
  /reset         clear the conversation (the --system message stays)
  /exit, /quit   leave (Ctrl-D too)
Ctrl-C stops a reply and returns to the prompt; arrow keys edit the line and recall earlier messages."""


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    from nanovllm.sampling_params import SamplingParams

    names = {f.name for f in dataclasses.fields(SamplingParams)}
    group = parser.add_argument_group("sampling")
    group.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    group.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate per prompt")
    group.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    optional = [("top_p", float, "nucleus sampling: keep the smallest set of tokens with this much mass"),
                ("top_k", int, "keep only the k most likely tokens (0 or -1: all)"),
                ("min_p", float, "drop tokens below this fraction of the top token's probability"),
                ("repetition_penalty", float, "penalise tokens already in the prompt or output (>1)"),
                ("presence_penalty", float, "penalise tokens already generated"),
                ("frequency_penalty", float, "penalise tokens by how often they were generated")]
    for name, kind, text in optional:
        if name in names:
            group.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help=text)
    if "seed" in names:
        group.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")


def sampling_params_from(args: argparse.Namespace):
    from nanovllm.sampling_params import SamplingParams

    names = {f.name for f in dataclasses.fields(SamplingParams)}
    kwargs = dict(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    for name in ("top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        if name in names and getattr(args, name, None) is not None:
            kwargs[name] = getattr(args, name)
    if "seed" in names and getattr(args, "sampling_seed", None) is not None:
        kwargs["seed"] = args.sampling_seed
    return SamplingParams(**kwargs)


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompts)
    if args.file:
        with open(args.file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts or prompts == ["-"]:
        if sys.stdin.isatty():
            print("Reading prompts from stdin, one per line; end with Ctrl-D.", file=sys.stderr, flush=True)
        prompts = [line.rstrip("\n") for line in sys.stdin if line.strip()]
    return prompts


def load_llm(args: argparse.Namespace):
    """The engine of the flags, saying what it loads and the KV pool it got (on stderr; not with --quiet)."""
    from nanovllm import LLM
    from nanovllm.config import EngineConfig
    from nanovllm.engine.summary import kv_cache_line, loading_line

    kwargs = engine_kwargs(args)
    if not args.quiet:
        with warnings.catch_warnings():  # LLM validates the same arguments again, and warns then
            warnings.simplefilter("ignore")
            print(loading_line(EngineConfig(**kwargs)), file=sys.stderr, flush=True)
    llm = LLM(**kwargs)
    if not args.quiet:
        print(kv_cache_line(llm), file=sys.stderr, flush=True)
    return llm


def cmd_generate(args: argparse.Namespace) -> int:
    prompts = read_prompts(args)
    if not prompts:
        print("error: no prompts (give them as arguments, with --file, or on stdin)", file=sys.stderr)
        return 2
    llm = load_llm(args)
    params = sampling_params_from(args)
    use_template = not args.raw and llm.tokenizer is not None and getattr(llm.tokenizer, "chat_template", None)
    inputs = [{"prompt_token_ids": llm.apply_chat_template([{"role": "user", "content": p}]), "prompt": p}
              if use_template else p for p in prompts]
    start = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=not args.quiet)
    seconds = time.perf_counter() - start
    for prompt, out in zip(prompts, outputs):
        print(f"### Prompt: {prompt}")
        print(f"### Completion ({out.finish_reason}): {out.text.strip()}")
        print()
    generated = sum(len(o.token_ids) for o in outputs)
    print(f"{len(outputs)} prompts, {generated} tokens generated in {seconds:.2f} s: {generated / seconds:.1f} tok/s")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    interactive = sys.stdin.isatty()
    if interactive:
        import readline  # noqa: F401  (input() then edits the line and keeps this session's history)
        keep_typed_input_on_interrupt()
        wake_main_thread_on_sigint()
    llm = load_llm(args)
    params = sampling_params_from(args)
    opening = [{"role": "system", "content": args.system}] if args.system else []
    conversation = list(opening)
    if interactive:
        print("nanovllm chat: type a message; /help lists the commands, Ctrl-D quits.")
    while True:
        message = read_message(interactive)
        if message is None:  # end of input (Ctrl-D)
            if interactive:
                print()
            return 0
        if not message:
            continue
        if message.startswith("/"):
            command = message.split()[0]
            if command in ("/exit", "/quit"):
                return 0
            if command == "/help":
                print(CHAT_HELP)
            elif command == "/reset":
                conversation = list(opening)
                print("(conversation cleared)")
            else:
                print(f"unknown command {command!r}: /help lists the commands")
            continue
        conversation.append({"role": "user", "content": message})
        with InterruptFlag() as interrupt:
            prompt = {"prompt_token_ids": llm.apply_chat_template(conversation)}
            reply = stream_reply(llm, prompt, params, interrupt)
        if interrupt.raised:
            print("(interrupted)")
            if not reply:  # nothing was said: the message goes too, as if never sent
                conversation.pop()
                continue
        conversation.append({"role": "assistant", "content": reply})


def read_message(interactive: bool) -> str | None:
    """The next message, stripped; None at end of input. At a terminal Ctrl-C drops the line being typed."""
    if not interactive:
        line = sys.stdin.readline()
        return line.strip() if line else None
    while True:
        try:
            return input("> ").strip()
        except EOFError:
            return None
        except KeyboardInterrupt:
            SIGINTS.handled()
            print()  # a fresh prompt, as a shell gives


def keep_typed_input_on_interrupt() -> None:
    """Ctrl-C leaves what was typed in the terminal's input queue (NOFLSH; restored at exit). A flush can empty the
    queue between readline's select() saying a key is there and its read(), which then blocks inside readline,
    where no signal is looked at, until the next key: a Ctrl-C at the prompt would hang it. Unflushed, the keys are
    read, and the line they were part of is dropped with the KeyboardInterrupt as before."""
    import atexit
    import termios

    fd = sys.stdin.fileno()
    try:
        saved = termios.tcgetattr(fd)
    except termios.error:
        return
    changed = list(saved)
    changed[3] |= termios.NOFLSH  # lflag
    termios.tcsetattr(fd, termios.TCSANOW, changed)
    atexit.register(lambda: termios.tcsetattr(fd, termios.TCSANOW, saved))


class _SigintCount:
    """Ctrl-Cs the watcher saw and those the main thread has dealt with (the watcher wakes it until they match)."""

    def __init__(self):
        self.seen = 0
        self.dealt_with = 0

    def handled(self) -> None:
        self.dealt_with = self.seen


SIGINTS = _SigintCount()
WAKE_EVERY_S = 0.02
WAKE_FOR_S = 1.0  # at most: a SIGINT that raised elsewhere (quitting while loading, say) is not counted


def wake_main_thread_on_sigint() -> None:
    """Make a Ctrl-C always interrupt the main thread's wait for input. The kernel may deliver SIGINT to any thread
    (torch's own, say); Python then only notes it, and input() would go on waiting in select() for the line the
    terminal just discarded. A watcher reads the signal's wakeup byte and sends the main thread no-op SIGUSR1s
    until the Ctrl-C is dealt with: readline looks at signals only when its select() is interrupted, so a wake that
    lands while it handles a key is lost and must come again."""
    import threading

    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    signal.signal(signal.SIGUSR1, lambda signum, frame: None)
    main = threading.main_thread().ident

    def watch() -> None:
        while True:
            received = os.read(read_end, 64)
            if not received:
                return
            if signal.SIGINT in received:
                SIGINTS.seen += 1
                deadline = time.monotonic() + WAKE_FOR_S
                while SIGINTS.dealt_with < SIGINTS.seen and time.monotonic() < deadline:
                    signal.pthread_kill(main, signal.SIGUSR1)
                    time.sleep(WAKE_EVERY_S)

    threading.Thread(target=watch, name="nanovllm-sigint-waker", daemon=True).start()


class InterruptFlag:
    """While active, Ctrl-C (SIGINT) only sets ``raised``: the reply loop reads it between engine steps, so a step
    is never cut in the middle and the engine stays consistent for the next message."""

    def __init__(self):
        self.raised = False
        self._previous = None

    def _handle(self, signum, frame) -> None:
        self.raised = True
        SIGINTS.handled()

    def __enter__(self) -> InterruptFlag:
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._previous)


def stream_reply(llm, prompt, params, interrupt: InterruptFlag) -> str:
    """Print the reply as its tokens arrive, until it ends or ``interrupt`` is raised; return its text."""
    request_id = llm.add_request(prompt, params)
    shown, finished, output = "", False, None
    try:
        while not finished and not interrupt.raised:
            llm.step()
            output = llm.make_output(request_id)
            text = output.outputs[0].text
            if text.startswith(shown) and len(text) > len(shown):
                print(text[len(shown):], end="", flush=True)
                shown = text
            finished = output.finished
    finally:
        if finished:
            llm.pop_finished(request_id)
        else:  # interrupted: free the request's blocks
            llm.abort_request(request_id)
    final = output.outputs[0].text if finished else shown
    if final.startswith(shown):
        print(final[len(shown):], end="")
    print(flush=True)
    return final


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanovllm", description="A fast, readable LLM inference engine.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete prompts offline and print the results",
                         formatter_class=DefaultsHelpFormatter)
    gen.add_argument("prompts", nargs="*", help="prompts (default: one per line on stdin)")
    gen.add_argument("--file", help="read prompts from this file, one per line")
    gen.add_argument("--raw", action="store_true",
                     help="send prompts as plain text (default: wrap each as a user message in the model's "
                          "chat template when it has one)")
    gen.add_argument("--quiet", action="store_true", help="no loading lines, no progress bar: only the results")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="an interactive chat that streams the reply",
                          formatter_class=DefaultsHelpFormatter)
    chat.add_argument("--system", help="a system message that opens the conversation")
    chat.add_argument("--quiet", action="store_true", help="no loading lines")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    try:
        from nanovllm.server.serve import add_serve_parser
    except ImportError:  # the server's own packages are not installed
        add_serve_parser = None
    if add_serve_parser is not None:
        add_serve_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while loading or generating: stop, without a traceback
        print("\ninterrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader of stdout left (`nanovllm generate ... | head`): no flush at exit either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
