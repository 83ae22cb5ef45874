"""spyre_serve side by side with plain `vllm serve`: same model, same machine, same load.

    .venv/bin/python bench/compare_vllm.py                  # both models, full load
    .venv/bin/python bench/compare_vllm.py --model tiny --quick

One run starts each server in turn on 127.0.0.1 (spyre_serve the way a user does,
`spyre-serve run <config>`; then `vllm serve`), drives both with the same requests
(closed-loop concurrency sweep, then a fixed-rate Poisson stream, fixed seed), stops it,
once per repeat in ABBA order, and writes a JSON file, a PNG plot beside it, and a printed
table with a verdict per target (PASS, FAIL, INCONCLUSIVE or INVALID: bench/verdict.py).

This file is the command line; the work is split by job: runs.py (servers, sessions,
phases), metrics.py (figures, settings, repeats combined), verdict.py (what may be
concluded), report.py (table and plot).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

import report  # noqa: E402
import roofline  # noqa: E402
import runs  # noqa: E402
from runs import MODELS, VARIANT_ALIASES, VLLM_VARIANTS  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=[*MODELS, "both"], default="both")
    p.add_argument("--quick", action="store_true", help="fewer requests per phase")
    p.add_argument("--out", type=Path, default=None,
                   help="results JSON (default bench/results/compare-<time>.json); PNG beside it")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--rate", type=float, default=None,
                   help="Poisson requests/s (default per model: tiny 4, smollm2 0.3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=None,
                   help="sessions per server (start, the phase sequence, stop), in ABBA order "
                        "(spyre_serve, vllm, vllm, spyre_serve, ...); the table shows medians, "
                        "and a target is judged only when its spread over the repeats is below "
                        "its margin, so 1 repeat gives INCONCLUSIVE (default 3, --quick 1)")
    p.add_argument("--kv-blocks", type=int, default=64,
                   help="KV blocks for both servers (num_gpu_blocks_override), small enough that "
                        "vllm-spyre's static sizing could not run max_num_seqs; 0: the block "
                        "count spyre_serve's handshake picks, handed to vLLM too")
    p.add_argument("--spyre-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra `args:` of spyre_serve's app (YAML value), e.g. "
                        "stream_batching_interval_ms=20; recorded in the results")
    p.add_argument("--spyre-env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment of the spyre-serve command (Ray's workers and the "
                        "EngineCore inherit it), e.g. OMP_NUM_THREADS=1; recorded in the results")
    p.add_argument("--vllm-variants", nargs="+", default=[],
                   choices=list(VLLM_VARIANTS) + list(VARIANT_ALIASES),
                   help="also measure plain vLLM again, after the comparison, as a reference "
                        "(not part of the ratios or the verdict): `control` has the same "
                        "settings, an A/A check of how much two starts of one server differ "
                        "(`sync`, the former --no-async-scheduling variant, is an alias: vLLM's "
                        "CPU platform turns async scheduling off on both servers anyway)")
    p.add_argument("--nice", type=int, default=-10,
                   help="niceness of this process and so of both servers it starts (they "
                        "inherit it): other work on the machine, often niced itself, then "
                        "disturbs the measurement less; 0 leaves it")
    p.add_argument("--pin-card-actor", action="store_true",
                   help="experiment: once spyre_serve is up, pin its card actor to CPU 0 and its "
                        "other processes to the other CPUs, the layout vLLM's multiprocessing "
                        "executor gives its worker (VLLM_CPU_OMP_THREADS_BIND=auto); recorded")
    p.add_argument("--spyre-only", action="store_true",
                   help="measure spyre_serve alone (tuning runs: absolutes, no ratios)")
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--start-retries", type=int, default=1)
    p.add_argument("--py-spy", action="store_true",
                   help="record spyre_serve's processes with py-spy during the top concurrency")
    args = p.parse_args(argv)
    for alias in set(args.vllm_variants) & set(VARIANT_ALIASES):
        print(f"--vllm-variants {alias}: measured as `{VARIANT_ALIASES[alias]}` (same settings "
              f"as vllm; vLLM's CPU platform disables async scheduling on both)", flush=True)
    args.vllm_variants = list(dict.fromkeys(VARIANT_ALIASES.get(v, v) for v in args.vllm_variants))
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    return args


def machine() -> dict:
    import ray
    import torch
    import vllm
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()
    return {"cpus": psutil.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "platform": platform.platform(), "python": platform.python_version(),
            "vllm": vllm.__version__, "ray": ray.__version__, "torch": torch.__version__,
            "git_commit": commit, "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
            "niceness": os.getpriority(os.PRIO_PROCESS, 0),
            "cpu_platform_disables_async_scheduling": runs.cpu_platform_disables_async_scheduling()}


def _exit_on_sigterm(signum, frame):
    # SIGTERM (a CI timeout, `kill`) would skip the `finally` that stops the servers.
    raise SystemExit(128 + signum)


def main(argv=None) -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    args = parse_args(argv)
    if args.nice:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, args.nice)
        except PermissionError:
            print(f"could not set niceness {args.nice} (needs root); running at "
                  f"{os.getpriority(os.PRIO_PROCESS, 0)}", flush=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out or REPO / "bench" / "results" / f"compare-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    models = ["tiny", "smollm2"] if args.model == "both" else [args.model]
    document = {"meta": {**machine(), "started": stamp, "args": {k: str(v) for k, v in vars(args).items()},
                         "order": "one server at a time; a session (start, phases, stop) per "
                                  "repeat, ABBA: spyre_serve, vllm, vllm, spyre_serve, ...; "
                                  "--vllm-variants after them"},
                "models": {}}
    # Once, before any server runs: the floor each server's decode step is set against.
    bandwidth = document["meta"]["memory_bandwidth"] = roofline.machine_bandwidth()
    print(f"memory bandwidth: {bandwidth}", flush=True)
    for model in models:
        document["models"][model] = runs.bench_model(model, args, out.parent / out.stem,
                                                     bandwidth)
        out.write_text(json.dumps(document, indent=1))  # after each model: a crash keeps the first
        if "ratios" in document["models"][model]:
            print(report.table(model, document["models"][model]), flush=True)
    document["meta"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    out.write_text(json.dumps(document, indent=1))
    png = out.with_suffix(".png")
    report.plot(document["models"], png)
    print(f"\nwrote {out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
