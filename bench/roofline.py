"""Where each server's decode step stands against this machine's memory bandwidth.

At batch 1 a decode step reads every weight it uses once, and on a CPU that read, not the
arithmetic, bounds the step: it cannot be shorter than weights bytes / memory bandwidth.
The bench measures the bandwidth once per run (a large tensor copy, with one torch thread,
as both servers decode, and with every core) and sets each server's decode step at batch 1
(the engine's own mean inter-token latency at concurrency 1) against that floor.
"""
from __future__ import annotations

import math
import os
import time
from pathlib import Path

# Both servers run the model in float32 (bench/runs.py: dtype float32 on both).
SERVED_BYTES_PER_PARAMETER = 4
BATCH_1_PHASE = "concurrency_1"


def memory_bandwidth(threads: int, mib: int = 256, repeats: int = 5) -> float:
    """Bytes per second a tensor copy moves (each byte read once and written once) with
    `threads` torch threads: the best of `repeats`, the first copy having touched the pages.

    Hand-written because no installed library measures it (STREAM is a C program to build);
    a copy of a buffer far larger than the caches is what STREAM's Copy kernel does.
    """
    import torch
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
        dst = torch.empty_like(src)
        dst.copy_(src)
        best = math.inf
        for _ in range(repeats):
            started = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - started)
        return 2 * src.numel() * src.element_size() / best
    finally:
        torch.set_num_threads(saved)


def machine_bandwidth() -> dict:
    """Measured once per bench run, before any server starts."""
    cores = len(os.sched_getaffinity(0))
    one, every = memory_bandwidth(1), memory_bandwidth(cores)
    return {"one_thread_gb_s": round(one / 1e9, 2), "all_cores_gb_s": round(every / 1e9, 2),
            "cores": cores, "method": "best of 5 copies of 256 MiB of float32 (read + write)"}


def decode_weights_bytes(model_path: str | Path) -> int:
    """Bytes a batch-1 decode step reads: every parameter, as served (float32).

    A separate input embedding is left out (a step reads one row of it); with tied
    embeddings the one matrix is also the LM head, read whole, so it counts.
    """
    from safetensors import safe_open
    shapes = {}
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            shapes.update({name: f.get_slice(name).get_shape() for name in f.keys()})
    if not shapes:
        raise FileNotFoundError(f"no *.safetensors weights in {model_path}")
    if "lm_head.weight" in shapes:
        shapes = {n: s for n, s in shapes.items() if not n.endswith("embed_tokens.weight")}
    return sum(math.prod(s) for s in shapes.values()) * SERVED_BYTES_PER_PARAMETER


def decode_vs_floor(servers: dict, weights_bytes: int, bandwidth: dict) -> dict:
    """Each server's decode step at batch 1 in ms, the floors, and step / floor."""
    floors = {"one_thread": weights_bytes / (bandwidth["one_thread_gb_s"] * 1e9) * 1e3,
              "all_cores": weights_bytes / (bandwidth["all_cores_gb_s"] * 1e9) * 1e3}
    out = {"weights_mib": round(weights_bytes / 2**20, 1), "bandwidth": bandwidth,
           "floor_ms": {k: round(v, 2) for k, v in floors.items()}, "servers": {}}
    for name, server in servers.items():
        phase = server.get("phases", {}).get(BATCH_1_PHASE)
        step = phase and phase.get("scheduler", {}).get("server_itl_ms_mean")
        out["servers"][name] = {
            "decode_step_ms": step,
            "x_floor": {k: round(step / v, 2) for k, v in floors.items()} if step else None}
    return out
