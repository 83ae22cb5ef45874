"""The card's KV-cache program against vLLM's own CPU kernel, and its compiled graph's reuse."""
import functools
import os
import platform
import subprocess
import sys

import pytest
import torch
from vllm import _custom_ops as ops

from spyre_serve.handshake.card import SimulatedCard
from spyre_serve.vllm_plugin.attention import (
    compile_with_dynamo,
    compiled_graphs,
    make_kv_program,
)
from spyre_serve.vllm_plugin.settings import SpyreSettings

HEADS, BLOCK, HEAD = 2, 64, 32
COMPILERS = ["ahead", "dynamo"]


@functools.cache
def card_compiler(name: str):
    """The simulated card's compiler (ahead of time), or a dynamo backend's (inductor
    standing in for sendnn)."""
    if name == "ahead":
        return SimulatedCard(0, 0, SpyreSettings()).compiler()
    return compile_with_dynamo("inductor")


def vllm_write(kv, key, value, slots):
    num_blocks = kv.shape[0]
    key_cache, value_cache = kv.view(num_blocks, HEADS, BLOCK * 2, HEAD).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, "vec",
                                   k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")


def step(num_blocks, num_tokens, seed):
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(num_tokens, HEADS, HEAD, generator=g)
    value = torch.randn(num_tokens, HEADS, HEAD, generator=g)
    slots = torch.randperm(num_blocks * BLOCK, generator=g)[:num_tokens]
    return key, value, slots


def fused_qkv_views(key, value):
    """Keys and values as a layer hands them over: views into one fused qkv output, not
    contiguous (an ahead-of-time program has no guard on strides)."""
    tokens = key.shape[0]
    qkv = torch.cat([torch.zeros(tokens, 3 * HEADS * HEAD), key.reshape(tokens, -1),
                     value.reshape(tokens, -1)], dim=1)
    k, v = qkv[:, 3 * HEADS * HEAD:].split(HEADS * HEAD, dim=1)
    return k.view(tokens, HEADS, HEAD), v.view(tokens, HEADS, HEAD)


@pytest.mark.parametrize("compiler", [None, *COMPILERS])
@pytest.mark.parametrize("num_blocks,num_tokens", [(4, 1), (4, 100), (37, 3)])
def test_layout_matches_vllm_cpu_kernel(num_blocks, num_tokens, compiler):
    ours = torch.zeros(num_blocks, HEADS, BLOCK, 2 * HEAD)
    theirs = ours.clone()
    key, value, slots = step(num_blocks, num_tokens, seed=num_tokens)
    k, v = fused_qkv_views(key, value)
    assert num_tokens == 1 or not k.is_contiguous()  # one row is contiguous anyway
    with torch.inference_mode():  # as in the forward pass
        make_kv_program(compiler and card_compiler(compiler))(ours, k, v, slots)
    vllm_write(theirs, key, value, slots)
    assert torch.equal(ours, theirs)
    assert ours.abs().sum() > 0


@pytest.mark.parametrize("compiler", COMPILERS)
def test_resizing_the_cache_reuses_the_program_compiled_on_4_blocks(compiler):
    program = make_kv_program(card_compiler(compiler))
    # Warmup (4 blocks: a prompt, a decode step), then the resized cache.
    shapes = [(4, 10), (4, 1), (613, 5), (40, 64), (613, 1), (4, 7)]
    before = compiled_graphs()
    for i, (num_blocks, num_tokens) in enumerate(shapes):
        kv = torch.zeros(num_blocks, HEADS, BLOCK, 2 * HEAD)
        reference = kv.clone()
        key, value, slots = step(num_blocks, num_tokens, seed=i)
        program(kv, key, value, slots)
        vllm_write(reference, key, value, slots)
        assert torch.equal(kv, reference)
        if i == 1:
            after_warmup = compiled_graphs()
    # Dynamo fixes a dimension of size 1 whatever is marked, so one token is a second graph;
    # the ahead-of-time program was traced on 5 tokens and serves one token too.
    assert after_warmup == before + {"ahead": 1, "dynamo": 2}[compiler]
    assert compiled_graphs() == after_warmup


PICK = """
import sys
if sys.argv[1] == "ours":  # as the card does: the test in a thread, applied in this one
    from spyre_serve.handshake.card import CompilerSetup
    CompilerSetup.start().apply()
from torch._inductor.cpu_vec_isa import pick_vec_isa
print(pick_vec_isa())
"""


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                    reason="inductor tests vector ISAs by building on x86 only")
def test_the_simulated_compiler_tests_one_vector_isa_and_picks_inductors(tmp_path):
    """Inductor alone builds its vector-code test library for each ISA the CPU lists; the
    simulated compiler builds the chosen ISA's only, and inductor then picks the same ISA."""
    picked, libraries = {}, {}
    for way in ("inductor", "ours"):
        cache = tmp_path / way
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
        env.pop("TORCHINDUCTOR_VEC_ISA_OK", None)
        run = subprocess.run([sys.executable, "-c", PICK, way], env=env, capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        picked[way] = run.stdout.strip().splitlines()[-1]
        # The vector-code test (the costly one, ATen's vec headers); the small checks of
        # single instructions (bf16, VNNI, AMX) that inductor adds for some ISAs still run.
        libraries[way] = sum(1 for source in cache.rglob("*.cpp")
                             if "ATen/cpu/vec/vec.h" in source.read_text()
                             and source.with_suffix(".so").exists())
    assert picked["ours"] == picked["inductor"] != "INVALID_VEC_ISA", picked
    assert libraries["ours"] == 1 <= libraries["inductor"], libraries


WARM = """
import json, torch
from spyre_serve.handshake.card import SimulatedCard, start_compiler_ahead
from spyre_serve.vllm_plugin.attention import (compile_cache_counts, compiled_graphs,
                                               make_kv_program, write_kv_flat)
from spyre_serve.vllm_plugin.settings import SpyreSettings
start_compiler_ahead(SpyreSettings())   # as a card actor started ahead does
card = SimulatedCard(0, 0, SpyreSettings())
program = make_kv_program(card.compiler())  # joins the setup already running
card.compiler_ready()
since = compile_cache_counts()
kv = torch.zeros(4, 2, 64, 64)
reference = kv.clone()
key, value = torch.randn(3, 2, 32), torch.randn(3, 2, 32)
slots = torch.tensor([0, 65, 200])
program(kv, key, value, slots)
write_kv_flat(reference.view(-1), key, value, slots, kv_heads=2, block_size=64, head_size=32)
print(json.dumps({"equal": bool(torch.equal(kv, reference)), "graphs": compiled_graphs(),
                  "counted": compile_cache_counts(since), "all": compile_cache_counts()}))
"""


@pytest.mark.slow
def test_the_compilers_warm_up_compile_is_paid_ahead_and_not_counted(tmp_path):
    """A card actor started ahead compiles a throwaway program before warmup: it takes
    inductor's first-compile setup off warmup's path, and neither the program count (the
    no-recompile check) nor warmup's cache counts (a warm start compiles nothing) see it."""
    import json
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", WARM], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["equal"]
    assert out["graphs"] == 1
    assert out["counted"] == {"hits": 0, "misses": 1}
    assert out["all"]["misses"] == 2   # the warm-up compile did run, on a cold cache
