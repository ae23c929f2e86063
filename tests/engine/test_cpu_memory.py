"""Memory on the CPU: the KV pool has the size in bytes it was given (by default what the limits can use, within
2 GiB) and never grows, and becomes resident as its blocks are written; resident memory is flat across repeated
batches; `nanovllm generate` on the embedded model stays under 1.5 GiB plus its pool; a prompt burst holds little beyond
the KV pages it writes."""

import gc
import json
import os
import subprocess
import sys

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.config import DEFAULT_CPU_KV_CACHE_BYTES, DEFAULT_CPU_KV_CACHE_TOKENS, EngineConfig

MiB = 1 << 20


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_default_pool_on_the_cpu_is_2_gib():
    assert DEFAULT_CPU_KV_CACHE_BYTES == 2 << 30
    assert EngineConfig(device="cpu").kv_cache_memory_bytes is None  # None: the runner takes the default
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        EngineConfig(device="cpu", kv_cache_memory_bytes=0)


def test_pool_has_its_size_in_bytes_and_never_grows(tiny_qwen3):
    budget = 256 * 1024
    llm = LLM(tiny_qwen3, device="cpu", kv_cache_memory_bytes=budget, kvcache_block_size=16, max_model_len=256)
    runner = llm.runner
    pool = runner.kv_cache
    assert budget - runner.kv_bytes_per_block < pool.nbytes <= budget
    assert llm.num_kvcache_blocks == budget // runner.kv_bytes_per_block
    address, size = pool.data_ptr(), pool.nbytes
    # eight requests of ~100 tokens need more blocks than the pool has: they take turns (preemption), no growth
    prompts = [[3 + (i * 7 + j) % 300 for j in range(60)] for i in range(8)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert all(len(o.token_ids) == 40 for o in outs)
    assert runner.kv_cache is pool and pool.data_ptr() == address and pool.nbytes == size
    assert llm.scheduler.block_manager.num_free_blocks == llm.num_kvcache_blocks


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_resident_memory_is_flat_across_batches(tiny_qwen3):
    llm = LLM(tiny_qwen3, device="cpu", kv_cache_memory_bytes=8 * MiB, kvcache_block_size=16)
    prompts = [[3 + (i * 11 + j) % 300 for j in range(50 + i)] for i in range(16)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    for _ in range(2):  # warm-up: the allocator's pools, first-call caches
        llm.generate(prompts, params, use_tqdm=False)
    sizes = []
    for _ in range(5):
        llm.generate(prompts, params, use_tqdm=False)
        gc.collect()
        sizes.append(resident_bytes())
    assert max(sizes) - sizes[0] < 16 * MiB, f"resident memory grew across batches: {[s // MiB for s in sizes]} MiB"


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss in KiB is Linux's")
def test_generate_on_the_embedded_model_peaks_under_1_5_gib_plus_the_pool():
    from nanovllm.loader.default_model import embedded_model_path
    try:
        embedded_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    pool = 256 * MiB
    args = ["generate", "--quiet", "--max-tokens", "16", "--ignore-eos", "--kv-cache-memory-bytes", str(pool),
            "What is the capital of France?", "Name three primary colors."]
    # the CLI in a fresh process, which reports its own peak resident set (ru_maxrss: KiB on Linux)
    script = ("import resource, sys; from nanovllm.cli import main; code = main(sys.argv[1:]); "
              "print('PEAK', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(code)")
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    peak = int(done.stdout.rsplit("PEAK", 1)[1]) * 1024
    assert peak < 1.5 * 1024 * MiB + pool, f"peak resident memory {peak / MiB:.0f} MiB"


def test_default_pool_holds_what_the_limits_can_use(tiny_qwen3):
    # 3 requests of at most 100 tokens: 3 x ceil(100 / 16) blocks, not the 2 GiB budget
    llm = LLM(tiny_qwen3, device="cpu", max_num_seqs=3, max_model_len=100, kvcache_block_size=16)
    assert llm.num_kvcache_blocks == 3 * 7
    from nanovllm.engine.summary import kv_cache_line
    line = kv_cache_line(llm)
    assert f"{21 * 16:,} tokens (21 blocks of 16)" in line and "max_num_seqs 3" in line, line
    llm.close()
    # limits beyond the budget: it holds DEFAULT_CPU_KV_CACHE_TOKENS, or one request of max_model_len if longer
    many = LLM(tiny_qwen3, device="cpu", max_num_seqs=256, max_model_len=256, kvcache_block_size=16)
    assert many.num_kvcache_blocks == DEFAULT_CPU_KV_CACHE_TOKENS // 16
    many.close()


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_pool_memory_is_taken_as_blocks_are_written(tiny_qwen3):
    gc.collect()
    before = resident_bytes()
    llm = LLM(tiny_qwen3, device="cpu", kv_cache_memory_bytes=512 * MiB, kvcache_block_size=16, max_model_len=256)
    assert llm.runner.kv_cache.nbytes > 500 * MiB
    assert resident_bytes() - before < 128 * MiB, "the whole pool became resident at start"
    out = llm.generate([[3, 4, 5] * 20], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert len(out[0].token_ids) == 8
    assert resident_bytes() - before < 128 * MiB
    llm.close()


# The engine as the server's core runs it (defaults, one thread, the heap trimmed after loading), then a burst of
# sixteen distinct ~570-token prompts at once: what the burst's steps hold beyond the KV pages they wrote.
BURST_SCRIPT = r"""
import json, sys, torch
torch.set_num_threads(1)
from nanovllm import LLM, SamplingParams
from nanovllm.engine.host_memory import HeapTrimmer

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

def pool_resident(pool):
    start = pool.data_ptr()
    rss, inside = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= start < high
        elif inside and head == "Rss:":
            rss += int(line.split()[1]) * 1024
    return rss

llm = LLM()
HeapTrimmer().trim(busy=False)
pool = llm.runner.kv_cache
start, start_anon, pool_start = status("VmRSS"), status("RssAnon"), pool_resident(pool)
open("/proc/self/clear_refs", "w").write("5")  # VmHWM from here
words = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()
prompts = [f"{i}: " + " ".join(words[(i * 7 + j * 3) % len(words)] + str((i * j) % 97) for j in range(200))
           for i in range(16)]
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
print(json.dumps(dict(start=start, start_anon=start_anon, peak=status("VmHWM"), pool_written=pool_resident(pool) - pool_start,
                      pool=pool.nbytes, prompt_tokens=sum(len(o.prompt_token_ids) for o in outs),
                      triton="triton" in sys.modules)))
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc (clear_refs, smaps)")
def test_a_prompt_burst_on_the_embedded_model_holds_little_beyond_its_kv_pages():
    """The server's target (#29): under 1 GB resident with defaults, a burst of prefills included. What a burst
    adds is the pool's written pages and each step's working memory; the latter grows with the step's token
    budget (8,192 tokens held ~340 MB on this model, the CPU default of 1,024 ~60-90 MB with what the heap keeps
    between trims) and would put the core past the target with a full pool. The bounds sit between today's
    figures and a regressed step budget's, or a CPU engine importing Triton again."""
    from nanovllm.loader.default_model import embedded_model_path
    try:
        embedded_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    # the defaults as a server has them: without the float32 the test session chooses for its HF comparisons
    env = {k: v for k, v in os.environ.items() if not k.startswith("NANOVLLM_CPU_")}
    done = subprocess.run([sys.executable, "-c", BURST_SCRIPT], capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    m = json.loads(done.stdout.strip().splitlines()[-1])
    assert m["prompt_tokens"] > 16 * 500, m
    assert not m["triton"], "a CPU engine imported Triton (its library alone is ~66 MB resident)"
    working = m["peak"] - m["start"] - m["pool_written"]
    assert working < 150 * MiB, f"the burst's steps held {working / MiB:.0f} MiB beyond the KV pages they wrote"
    # the core's own memory with its whole pool written (as a burst of 32 such prompts leaves it) and this working
    # memory. Anonymous pages only: how much of the shared libraries' file pages a process maps depends on what the
    # page cache holds (libtorch_cpu.so: 58 MB resident in one venv, 117 in a freshly installed one), not on us.
    projected = m["start_anon"] + m["pool"] + working
    assert projected < 850 * MiB, (f"core at {m['start_anon'] / MiB:.0f} MiB of its own after loading + a "
                                   f"{m['pool'] / MiB:.0f} MiB pool + {working / MiB:.0f} MiB of step memory")
