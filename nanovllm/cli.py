"""The `nanovllm` command: generate, chat and serve, with vLLM-style flags."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from nanovllm.engine_args import add_engine_args, engine_kwargs


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
        prompts = [line.rstrip("\n") for line in sys.stdin if line.strip()]
    return prompts


def cmd_generate(args: argparse.Namespace) -> int:
    from nanovllm import LLM

    prompts = read_prompts(args)
    if not prompts:
        print("error: no prompts (give them as arguments, with --file, or on stdin)", file=sys.stderr)
        return 2
    llm = LLM(**engine_kwargs(args))
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
    from nanovllm import LLM

    llm = LLM(**engine_kwargs(args))
    params = sampling_params_from(args)
    conversation: list[dict] = []
    if args.system:
        conversation.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    if interactive:
        print("nanovllm chat: type a message; /reset clears the conversation, /exit or Ctrl-D quits.")
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            break
        message = line.strip()
        if not message:
            continue
        if message in ("/exit", "/quit"):
            break
        if message == "/reset":
            conversation = conversation[:1] if args.system else []
            print("(conversation cleared)")
            continue
        conversation.append({"role": "user", "content": message})
        prompt = {"prompt_token_ids": llm.apply_chat_template(conversation)}
        reply = stream_reply(llm, prompt, params)
        conversation.append({"role": "assistant", "content": reply})
    return 0


def stream_reply(llm, prompt, params) -> str:
    """Print the reply as its tokens arrive; return its full text."""
    request_id = llm.add_request(prompt, params)
    shown, finished = "", False
    try:
        while not finished:
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
        else:  # interrupted (Ctrl-C): free the request's blocks
            llm.abort_request(request_id)
    final = output.outputs[0].text
    if final.startswith(shown):
        print(final[len(shown):], end="")
    print(flush=True)
    return final


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanovllm", description="A fast, readable LLM inference engine.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete prompts offline and print the results")
    gen.add_argument("prompts", nargs="*", help="prompts (default: one per line on stdin)")
    gen.add_argument("--file", help="read prompts from this file, one per line")
    gen.add_argument("--raw", action="store_true",
                     help="send prompts as plain text (default: wrap each as a user message in the model's "
                          "chat template when it has one)")
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="an interactive chat that streams the reply")
    chat.add_argument("--system", help="a system message that opens the conversation")
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


if __name__ == "__main__":
    sys.exit(main())
