"""The card's KV-cache program: the compiled step that writes new keys and values into the cache.

It is the part of the forward pass that takes the KV cache as a graph input, so it is
compiled by the card's compiler with the num_blocks dimension marked dynamic: the graph
built during the 4-block warmup keeps serving after the coordinator resizes the cache.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch._dynamo.utils import counters
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
)

from spyre_serve import get_logger

logger = get_logger(__name__)

_program: Callable | None = None


def write_kv_flat(flat_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  slot_mapping: torch.Tensor, kv_heads: int, block_size: int,
                  head_size: int) -> None:
    """Scatter one step's keys/values into paged blocks, in the layout vLLM's CPU kernels read.

    Each block of the cache [num_blocks, kv_heads, block_size, 2 * head_size] holds, per
    head, the keys transposed ([head_size, block_size]) followed by the values
    ([block_size, head_size]). The cache comes in flat: writing 1-D positions lets inductor
    scatter in place, where writes through views of views made it copy the whole cache.
    """
    block = slot_mapping // block_size
    offset = slot_mapping % block_size
    heads = torch.arange(kv_heads, device=key.device)
    dims = torch.arange(head_size, device=key.device)
    region = block_size * head_size
    head_start = ((block[:, None] * kv_heads + heads[None, :]) * (2 * region))[:, :, None]
    key_pos = head_start + dims[None, None, :] * block_size + offset[:, None, None]
    value_pos = head_start + region + offset[:, None, None] * head_size + dims[None, None, :]
    flat_cache.index_put_((key_pos.reshape(-1),), key.reshape(-1))
    flat_cache.index_put_((value_pos.reshape(-1),), value.reshape(-1))


def make_kv_program(compile_fn: Callable[[Callable], Callable] | None) -> Callable:
    """The card's program: (kv_cache, key, value, slot_mapping), compiled by ``compile_fn``."""
    step = compile_fn(write_kv_flat) if compile_fn else write_kv_flat

    def program(kv_cache: torch.Tensor, key, value, slot_mapping) -> None:
        _, kv_heads, block_size, two_head = kv_cache.shape
        flat = kv_cache.view(-1)
        for t in (flat, key, value, slot_mapping):
            _mark_dynamic(t, 0)
        step(flat, key, value, slot_mapping, kv_heads, block_size, two_head // 2)

    return program


def install_kv_program(compile_fn: Callable[[Callable], Callable] | None) -> None:
    global _program
    _program = make_kv_program(compile_fn)


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process (a recompile adds one)."""
    return counters["stats"]["unique_graphs"]


def compile_cache_counts() -> dict[str, int]:
    """Inductor's cache hits and misses in this process: a warm start compiles nothing."""
    return {"hits": counters["inductor"]["fxgraph_cache_hit"],
            "misses": counters["inductor"]["fxgraph_cache_miss"]}


def _mark_dynamic(t: torch.Tensor, dim: int) -> None:
    # A size-1 dimension is specialised by dynamo whatever we say; warmup covers that shape.
    if t.shape[dim] > 1:
        torch._dynamo.mark_dynamic(t, dim)


class SpyreCardAttentionImpl(CPUAttentionBackendImpl):
    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        # write_kv knows the plain "vec" layout only; AMX and fp8 caches keep vLLM's kernel.
        if (_program is None or self.kv_cache_dtype != "auto" or key.dtype != kv_cache.dtype
                or getattr(layer, "isa", "vec") != "vec"):
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        num_tokens = slot_mapping.shape[0]
        key, value = key[:num_tokens], value[:num_tokens]
        if num_tokens and bool((slot_mapping < 0).any()):
            keep = slot_mapping >= 0  # padded tokens carry slot -1 and are not cached
            key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
        if slot_mapping.shape[0] == 0:
            return
        _program(kv_cache, key, value, slot_mapping)


class SpyreCardAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return SpyreCardAttentionImpl
