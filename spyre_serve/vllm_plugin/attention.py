"""The card's KV-cache program: the compiled step that writes new keys and values into the cache.

It is the part of the forward pass that takes the KV cache as a graph input, so it is
compiled by the card's compiler with the num_blocks dimension dynamic: the program built
during the 4-block warmup keeps serving after the coordinator resizes the cache.

Two ways to compile it, one per kind of card:
- ahead of time (`compile_ahead`, the simulated card): traced once with every dimension
  symbolic, compiled by inductor into an artifact that is called directly. No dynamo
  frame or guards run per call: the program runs 30 times a decode step (once a layer),
  between matmuls that leave the caches cold, where dynamo's call path cost 221 us a call
  and the artifact's 76 us (SmolLM2, after a 64 MiB sweep; vLLM's own kernel 41 us).
- through dynamo (`compile_with_dynamo`, a backend such as torch_sendnn that is a dynamo
  backend), with num_blocks and the token count marked dynamic.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
from torch._dynamo.utils import counters
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
)

from spyre_serve import get_logger

logger = get_logger(__name__)

# A compiler: (step, example arguments) -> the compiled step.
Compiler = Callable[[Callable, tuple], Callable]

_program: Callable | None = None
_programs_compiled_ahead = 0


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


def kv_step_examples(kv_heads: int, block_size: int, head_size: int,
                     dtype: torch.dtype) -> tuple:
    """Arguments a step is traced with: 4 blocks, as at warmup, and 5 tokens. Not 1 token:
    tracing fixes a size of 1, and the program would serve one token only. A token count
    equal to another size (kv heads, say) is harmless: compile_ahead traces with duck
    shaping off, so equal sizes stay separate symbols."""
    tokens = 5
    return (torch.zeros(4 * kv_heads * block_size * 2 * head_size, dtype=dtype),
            torch.zeros(tokens, kv_heads, head_size, dtype=dtype),
            torch.zeros(tokens, kv_heads, head_size, dtype=dtype),
            torch.arange(tokens, dtype=torch.int64))


def make_kv_program(compiler: Compiler | None) -> Callable:
    """The card's program: (kv_cache, key, value, slot_mapping), its step compiled by
    ``compiler`` once per cache geometry (a model has one)."""
    steps: dict[tuple, Callable] = {}

    def program(kv_cache: torch.Tensor, key, value, slot_mapping) -> None:
        _, kv_heads, block_size, two_head = kv_cache.shape
        geometry = (kv_heads, block_size, two_head // 2, kv_cache.dtype)
        step = steps.get(geometry)
        if step is None:
            step = functools.partial(write_kv_flat, kv_heads=kv_heads, block_size=block_size,
                                     head_size=two_head // 2)
            if compiler is not None:
                step = compiler(step, kv_step_examples(*geometry))
            steps[geometry] = step
        # Contiguous: an ahead-of-time program has no guard on its inputs' strides, and
        # keys and values often arrive as views of the layer's fused qkv output.
        step(kv_cache.view(-1), key.contiguous(), value.contiguous(), slot_mapping)

    return program


def compile_ahead(step: Callable, examples: tuple, inductor_config: dict | None = None) -> Callable:
    """Trace `step` with every dimension symbolic and compile it with inductor, ahead of
    time (`torch._inductor.standalone_compile`). The artifact goes through inductor's FX
    graph cache like any inductor compile, so the warm-start catalog carries it."""
    global _programs_compiled_ahead
    artifact = _standalone_compile(step, examples, inductor_config)
    _programs_compiled_ahead += 1
    return artifact


def warm_up_compiler(inductor_config: dict | None = None) -> None:
    """Compile a throwaway program through compile_ahead's path, not counted as a program.

    A process's first inductor compile pays ~4 s of Python setup (lazy imports, first-use
    caches) besides the C++ build; the second pays the build alone (SmolLM2's KV program:
    9.3 s first, 5.4 s after this, on 2 cores). A card actor started ahead by the replica
    runs this while the EngineCore imports vLLM and the card has nothing else to do, so
    warmup's compile of the real program starts with that setup done."""
    def bump(values: torch.Tensor, slots: torch.Tensor) -> None:
        values.index_put_((slots,), values[slots] + 1)

    _standalone_compile(bump, (torch.zeros(8, dtype=torch.bfloat16), torch.arange(3)),
                        inductor_config)


def _standalone_compile(step: Callable, examples: tuple, inductor_config: dict | None):
    from torch._inductor import config as inductor
    from torch.fx.experimental import _config as fx_config
    from torch.fx.experimental.proxy_tensor import make_fx

    from spyre_serve.vllm_compat import hook
    hook("torch.fx.experimental._config:use_duck_shape")  # registered and present
    # Traced outside inference mode, on normal tensors: tracing refuses to write into
    # inference tensors. The artifact itself runs in the forward's inference mode.
    with torch.inference_mode(False), fx_config.patch(use_duck_shape=False):
        examples = tuple(t.clone() for t in examples)
        # standalone_compile takes a graph with tensor outputs: the step's is what it wrote.
        graph = make_fx(lambda *args: (step(*args), args[0])[1:],
                        tracing_mode="symbolic")(*examples)
        with inductor.patch(inductor_config or {}):
            return hook("torch._inductor:standalone_compile")(
                graph, list(examples), dynamic_shapes="from_graph")


def compile_with_dynamo(backend: str, options: dict | None = None) -> Compiler:
    """A compiler through torch.compile and a dynamo backend, which reads the dynamic marks
    (num_blocks, tokens) each time it compiles."""
    def compiler(step: Callable, examples: tuple) -> Callable:
        compiled = torch.compile(step, backend=backend, dynamic=False, options=options)

        def marked(*tensors: torch.Tensor) -> None:
            for t in tensors:
                _mark_dynamic(t, 0)
            compiled(*tensors)

        return marked

    return compiler


def install_kv_program(compiler: Compiler | None) -> None:
    global _program
    _program = make_kv_program(compiler)


def compiled_graphs() -> int:
    """Programs compiled in this process, ahead of time or by dynamo (a recompile adds one)."""
    return _programs_compiled_ahead + counters["stats"]["unique_graphs"]


def compile_cache_counts(since: dict[str, int] | None = None) -> dict[str, int]:
    """Inductor's cache hits and misses in this process, or since an earlier count (the
    compiler's own warm-up compiles one throwaway program): a warm start compiles nothing."""
    now = {"hits": counters["inductor"]["fxgraph_cache_hit"],
           "misses": counters["inductor"]["fxgraph_cache_miss"]}
    return {k: v - (since or {}).get(k, 0) for k, v in now.items()}


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
