"""A KV-cache program that costs O(tokens), not O(num_blocks): proposed for
spyre_serve/attention.py.

spyre_serve.attention.write_kv scatters keys and values through views of views of the
cache (`kv_cache.view(...)[:, :, 0].view(...)[block, :, :, offset] = key`). Inductor
cannot do that in place: its generated code allocates three cache-sized buffers and
copies the whole cache on every call, for every layer, every step. Here the compiled
program gets the flattened cache itself as its graph input and writes 1-D positions into
it, which inductor turns into an in-place scatter. Same layout, same result; the flat
length is marked dynamic, so the graph compiled on the 4-block warmup cache still serves
the resized cache without a recompile.
"""
import torch


def write_kv_flat(flat_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  slot_mapping: torch.Tensor, kv_heads: int, block_size: int,
                  head_size: int) -> None:
    """write_kv's layout: per block and head, keys transposed [head_size, block_size],
    then values [block_size, head_size]."""
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


def flat_program(compile_fn=None):
    """A drop-in for spyre_serve.attention._program: (kv_cache, key, value, slot_mapping)."""
    inner = compile_fn(write_kv_flat) if compile_fn else write_kv_flat

    def program(kv_cache, key, value, slot_mapping):
        _, kv_heads, block_size, two_head = kv_cache.shape
        flat = kv_cache.view(-1)
        torch._dynamo.mark_dynamic(flat, 0)
        inner(flat, key, value, slot_mapping, kv_heads, block_size, two_head // 2)

    return program
