"""Warmup on a 4-block KV cache, driven by vLLM's own scheduler inside the rank.

Every rank runs the same requests in lockstep, so tensor-parallel collectives line up
without the engine: two warmup prompts decoded together, then one "deploy" prefill so
that the first real request finds every shape already compiled.
"""
from __future__ import annotations

import copy
import ctypes
import gc
import time

from vllm.pooling_params import PoolingParams
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import AsyncModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

WARMUP_BLOCKS = 4


def _prompt(length: int, vocab_size: int, salt: int) -> list[int]:
    return [(salt * 7919 + i * 31) % (vocab_size - 1) + 1 for i in range(length)]


def warmup_requests(max_model_len: int, vocab_size: int) -> list[list[tuple[list[int], int]]]:
    """Rounds of (prompt, max_tokens): the 2 warmup prompts, then the deploy prefill.

    Sized to fit the 3 usable blocks of the warmup cache (vLLM keeps one as null block).
    """
    long_len = max(2, min(96, max_model_len - 8))
    short_len = max(2, min(32, max_model_len - 8))
    return [
        [(_prompt(long_len, vocab_size, 1), 4), (_prompt(short_len, vocab_size, 2), 4)],
        [(_prompt(max(2, min(64, max_model_len - 4)), vocab_size, 3), 2)],
    ]


def warmup_params(model_runner, model_config, max_tokens: int):
    """(sampling, pooling) params of a warmup request: a pooling model (embeddings) runs
    its prefill and pooler, a generating one prefills and decodes `max_tokens`."""
    if model_config.runner_type == "pooling":
        pooling = PoolingParams(task=model_runner.get_supported_pooling_tasks()[0])
        pooling.verify(model_config)
        return None, pooling
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), None


def status_bytes(field: str) -> int:
    """A memory figure of this process from /proc/self/status (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def release_freed_memory() -> None:
    """Hand the heap memory Python and glibc keep after frees back to the system.

    Loading weights and compiling free hundreds of MiB that glibc keeps mapped (900+ MiB
    resident after loading SmolLM2 against ~740 MiB held), and how much it keeps varies
    from start to start. Measured without this, a card's report of what the weights take
    moved by up to 70 blocks between two starts of one model, and a serving card kept
    memory it never used again. glibc's malloc_trim is the only way to ask for it back."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim this way
        pass


def settled_rss() -> int:
    """Resident bytes of this process once freed memory is handed back (see above)."""
    release_freed_memory()
    return status_bytes("VmRSS")


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def run_warmup(model_runner, vllm_config, kv_cache_config) -> dict:
    """Serve the warmup rounds through the model runner.

    Returns step counts, time, and the activation peak: the resident-memory high-water mark
    over the deploy round, which runs after every program is compiled, so compiler memory
    does not count as activations.
    """
    config = copy.copy(vllm_config)
    # A private scheduler: no prefix caching (warmup requests carry no block hashes).
    config.cache_config = copy.copy(vllm_config.cache_config)
    config.cache_config.enable_prefix_caching = False
    config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    scheduler = Scheduler(
        vllm_config=config, kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=vllm_config.cache_config.block_size)
    vocab_size = vllm_config.model_config.get_vocab_size()
    steps, start = 0, time.perf_counter()
    rounds = warmup_requests(vllm_config.model_config.max_model_len, vocab_size)
    activation_peak = 0
    for round_no, round_ in enumerate(rounds):
        deploy_round = round_no == len(rounds) - 1
        if deploy_round:
            rss_before = settled_rss()
            tracked = _reset_peak_rss()
        for i, (prompt, max_tokens) in enumerate(round_):
            sampling, pooling = warmup_params(model_runner, vllm_config.model_config, max_tokens)
            scheduler.add_request(Request(f"spyre-warmup-{round_no}-{i}", prompt, sampling,
                                          pooling))
        while scheduler.has_unfinished_requests():
            scheduler_output = scheduler.schedule()
            output = model_runner.execute_model(scheduler_output)
            if output is None:
                output = model_runner.sample_tokens(None)
            if isinstance(output, AsyncModelRunnerOutput):  # the runner under async scheduling
                output = output.get_output()
            scheduler.update_from_output(scheduler_output, output)
            steps += 1
        if deploy_round and tracked:
            activation_peak = max(0, status_bytes("VmHWM") - rss_before)
    # One empty step hands the runner the last finished ids, so its batch is empty again.
    model_runner.execute_model(scheduler.schedule())
    return {"steps": steps, "seconds": time.perf_counter() - start,
            "activation_peak_bytes": activation_peak}
