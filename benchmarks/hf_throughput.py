"""The peer: Hugging Face transformers' continuous batching (``generate_batch``) on a W2-like workload.

    python benchmarks/hf_throughput.py --model benchmarks/model_configs/qwen3-30b-a3b --num-requests 32 \
        --max-tokens 128 --out results/hf_throughput.json

Random weights from the config (bf16, on the GPU), random prompt ids of --prompt-len, exactly --max-tokens new
tokens each (EOS is ignored by giving none), temperature 0.6. Throughput = generated tokens / wall time of the
generate_batch call, after a short warm-up call. Run it in its own process: the engine's KV pool leaves no room
for a second copy of a large model's weights.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=os.path.join(os.path.dirname(__file__), "model_configs", "qwen3-30b-a3b"))
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", default="results/hf_throughput.json")
    args = parser.parse_args()
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(args.model)
    config.eos_token_id = None
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    generation = GenerationConfig(max_new_tokens=args.max_tokens, do_sample=True, temperature=0.6, eos_token_id=None,
                                  pad_token_id=0)
    model.generate_batch(prompts[:4], GenerationConfig(max_new_tokens=8, do_sample=True, temperature=0.6,
                                                        eos_token_id=None, pad_token_id=0))
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = model.generate_batch(prompts, generation)
    seconds = time.perf_counter() - start
    generated = sum(len(o.generated_tokens) for o in outputs.values())
    row = dict(peer=f"transformers {transformers.__version__} generate_batch", model=os.path.basename(
        os.path.normpath(args.model)), requests=args.num_requests, prompt_len=args.prompt_len,
        max_tokens=args.max_tokens, output_tokens=generated, seconds=round(seconds, 2),
        output_tok_s=round(generated / seconds, 1),
        experts_implementation=getattr(config, "_experts_implementation", None))
    print(json.dumps(row))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(row, f, indent=2)


if __name__ == "__main__":
    main()
