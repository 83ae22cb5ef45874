"""The card's KV-cache program alone: what one layer's write costs as the cache grows.

    .venv/bin/python bench/kv_program.py [--blocks 4 64 512 4096] [--out bench/results/kv_program.json]

Times, per call, for decode steps (1 and 16 tokens) and a prefill chunk (512 tokens):
spyre_serve's KV program compiled ahead of time as the simulated card compiles it (every
dimension symbolic, inductor's standalone_compile, called directly), the same compiled
through dynamo as a dynamo-backend card compiles it (num_blocks marked dynamic; what the
simulated card ran until the ahead-of-time program), the same eager, the program before
a433602 (writes through views of the cache, which made inductor copy the whole cache every
call), and vLLM's own CPU kernel (what plain vLLM runs), on the geometries of the two bench
models. Every variant, vLLM's kernel included, must leave the same cache (checked).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

# (kv heads, head size, layers) of the bench models
GEOMETRIES = {"tiny": (2, 32, 2), "smollm2": (3, 64, 30)}
BLOCK_SIZE = 64
# Stop timing a variant once a call takes this long: the trend is clear by then.
SLOW_CALL_S = 2.0


def mark(t: torch.Tensor) -> torch.Tensor:
    if t.shape[0] > 1:
        torch._dynamo.mark_dynamic(t, 0)
    return t


def write_kv_through_views(kv_cache, key, value, slot_mapping):
    """spyre_serve's KV program before a433602, kept to show what the fix bought: the same
    layout written through views of views of the cache, which inductor can only do by
    copying the whole cache in and out on every call."""
    num_blocks, kv_heads, block_size, two_head = kv_cache.shape
    head_size = two_head // 2
    halves = kv_cache.view(num_blocks, kv_heads, 2, block_size * head_size)
    keys_t = halves[:, :, 0].view(num_blocks, kv_heads, head_size, block_size)
    values = halves[:, :, 1].view(num_blocks, kv_heads, block_size, head_size)
    block = slot_mapping // block_size
    offset = slot_mapping % block_size
    keys_t[block, :, :, offset] = key
    values[block, :, offset, :] = value


def vllm_kernel(kv_cache, key, value, slot_mapping):
    from vllm import _custom_ops as ops
    num_blocks, kv_heads, block_size, _ = kv_cache.shape
    key_cache, value_cache = kv_cache.view(num_blocks, kv_heads, block_size * 2, -1).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, "vec",
                                   k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")


def time_call(fn, args, repeat: int) -> float:
    fn(*args)  # compile / warm
    started = time.perf_counter()
    n = 0
    while n < repeat:
        fn(*args)
        n += 1
        if time.perf_counter() - started > SLOW_CALL_S * 3:
            break
    return (time.perf_counter() - started) / n


def main() -> None:
    from spyre_serve.vllm_plugin.attention import (
        compile_ahead,
        compile_with_dynamo,
        compiled_graphs,
        make_kv_program,
    )
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[4, 64, 512, 4096])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 512])
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--out", type=Path, default=Path("bench/results/kv_program.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)  # as vLLM's CPU worker serves: one torch thread
    variants = {
        "spyre_serve KV program, compiled ahead": make_kv_program(compile_ahead),
        "spyre_serve KV program, through dynamo": make_kv_program(compile_with_dynamo("inductor")),
        "spyre_serve KV program, eager": make_kv_program(None),
        "through views, compiled (before a433602)": torch.compile(
            write_kv_through_views, backend="inductor", dynamic=False),
        "vLLM CPU kernel": vllm_kernel,
    }
    rows, too_slow = [], set()
    for model, (kv_heads, head_size, layers) in GEOMETRIES.items():
        for num_blocks in args.blocks:
            for tokens in args.tokens:
                if tokens > num_blocks * BLOCK_SIZE:
                    continue  # more tokens than the cache has slots
                torch.manual_seed(0)
                key = torch.randn(tokens, kv_heads, head_size)
                value = torch.randn(tokens, kv_heads, head_size)
                slots = torch.randperm(num_blocks * BLOCK_SIZE)[:tokens]
                reference = None
                for name, fn in variants.items():
                    if (model, name) in too_slow:
                        rows.append({"model": model, "num_blocks": num_blocks, "tokens": tokens,
                                     "variant": name, "ms_per_layer": None})
                        continue
                    cache = mark(torch.zeros(num_blocks, kv_heads, BLOCK_SIZE, 2 * head_size))
                    seconds = time_call(fn, (cache, mark(key), mark(value), mark(slots)), args.repeat)
                    # Every variant, vLLM's kernel included: ours writes the layout its
                    # "vec" path reads, so all must leave the same cache.
                    reference = cache if reference is None else reference
                    assert torch.equal(cache, reference), f"{name} wrote another cache"
                    if seconds > SLOW_CALL_S:
                        too_slow.add((model, name))
                    rows.append({"model": model, "num_blocks": num_blocks, "tokens": tokens,
                                 "variant": name, "ms_per_layer": round(seconds * 1000, 4),
                                 "ms_per_step_all_layers": round(seconds * 1000 * layers, 3)})
                    print(f"{model:>8} {num_blocks:>6} blocks {tokens:>4} tokens  {name:<42}"
                          f"{seconds * 1000:>10.3f} ms/layer {seconds * 1000 * layers:>10.2f} ms/step",
                          flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"torch_threads": 1, "rows": rows,
                                    "graphs_compiled": compiled_graphs()}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
