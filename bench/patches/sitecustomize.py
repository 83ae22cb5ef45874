"""Proposed fixes, tried in the servers the bench starts before they land in spyre_serve.

Only active when SPYRE_BENCH_PATCH names them (compare_vllm.py --experiment ...), which
the results JSON records; a normal bench run measures spyre_serve exactly as it is.
Python imports `sitecustomize` at start-up from PYTHONPATH, and Ray's daemons, workers
and vLLM's EngineCore inherit that environment, so the patch reaches the card actors.

kv-flat: the card's KV program writes through 1-D positions into the flattened cache.
spyre_serve.attention.write_kv writes through views of views of the cache; inductor then
copies the whole cache in and out on every call (three cache-sized buffers in its
generated code), so each layer's KV write costs O(num_blocks) instead of O(tokens).
"""
import importlib.util
import os
import sys

PATCHES = set(filter(None, os.environ.get("SPYRE_BENCH_PATCH", "").split(",")))


def _write_kv_flat(flat_cache, key, value, slot_mapping, kv_heads: int, block_size: int,
                   head_size: int):
    """write_kv's layout: per block and head, keys transposed [head_size, block_size],
    then values [block_size, head_size]."""
    import torch
    block = slot_mapping // block_size
    offset = slot_mapping % block_size
    heads = torch.arange(kv_heads, device=key.device)
    dims = torch.arange(head_size, device=key.device)
    region = block_size * head_size
    base = ((block[:, None] * kv_heads + heads[None, :]) * (2 * region))[:, :, None]
    key_pos = base + dims[None, None, :] * block_size + offset[:, None, None]
    value_pos = base + region + offset[:, None, None] * head_size + dims[None, None, :]
    flat_cache.index_put_((key_pos.reshape(-1),), key.reshape(-1))
    flat_cache.index_put_((value_pos.reshape(-1),), value.reshape(-1))


def _patch_attention(attention) -> None:
    import torch

    def install_kv_program(compile_fn):
        inner = compile_fn(_write_kv_flat) if compile_fn else _write_kv_flat

        def program(kv_cache, key, value, slot_mapping):
            _, kv_heads, block_size, two_head = kv_cache.shape
            flat = kv_cache.view(-1)
            torch._dynamo.mark_dynamic(flat, 0)  # one graph for the 4-block and resized cache
            inner(flat, key, value, slot_mapping, kv_heads, block_size, two_head // 2)

        attention._program = program

    attention.install_kv_program = install_kv_program


class _AfterImport:
    """Runs a patch right after a module executes, before anyone imports names from it."""

    def __init__(self, name, patch):
        self.name, self.patch = name, patch

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            self.patch(module)

        spec.loader.exec_module = exec_module
        return spec


if "kv-flat" in PATCHES:
    sys.meta_path.insert(0, _AfterImport("spyre_serve.attention", _patch_attention))
