"""Run under torchrun: every rank builds the same LLM; rank 0 drives and prints the tokens as JSON."""

import json
import os
import sys

from nanovllm import LLM, SamplingParams

model, prompts_json = sys.argv[1], sys.argv[2]
llm = LLM(model, tensor_parallel_size=int(os.environ["WORLD_SIZE"]), kvcache_block_size=16, num_kvcache_blocks=64)
# only rank 0 gets here: the other ranks serve steps inside LLM(...) and exit when it closes
outputs = llm.generate(json.loads(prompts_json), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)
print("TOKENS=" + json.dumps([o.token_ids for o in outputs]), flush=True)
llm.close()
