"""What Ray and Ray Serve cost on this machine with no model: the floor under spyre_serve.

    .venv/bin/python bench/serve_floor.py [--against bench/results/compare-X.json]

Starts `spyre-serve run` exactly as compare_vllm.py does (its own Ray head, the Serve
settings spyre-serve gives its nodes), but with `serve_floor_app.py`, a Serve app that
streams ready-made chunks instead of running a model. Measured, once per repeat:
- cold start: process start to `/v1/models`, and to a first streamed answer;
- idle memory: PSS summed over every process (Ray's daemons, Serve's controller and proxy,
  the app's replica, the CLI), and per process;
- the streaming ceiling: tokens/s (one token per chunk) a client gets through Serve's HTTP
  proxy and the replica at each closed-loop concurrency, and the CPU time per token of the
  proxy and the replica.
Nothing of spyre_serve's engine runs, so each figure is a floor for spyre_serve on this
machine while it is served by Ray Serve. `--against` reads a compare_vllm.py result and
sets each floor beside plain vLLM's whole server (its medians) for each model there.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import loadgen  # noqa: E402
import report  # noqa: E402
import runs  # noqa: E402
from servers import (MemorySampler, SpyreServe, free_port, memory_snapshot,  # noqa: E402
                     short_scratch_dir)

BENCH = Path(__file__).resolve().parent
MODEL_NAME = runs.MODEL_NAME


class ServeWithoutModel(SpyreServe):
    """`spyre-serve run` of the no-model app: the same Ray head, settings and proxy."""

    kind = "serve_floor"
    import_path = "serve_floor_app:build"

    def environment(self) -> dict[str, str]:
        # Ray's workers inherit the node's environment: the app module is found in bench/.
        return {**super().environment(), "PYTHONPATH": str(BENCH)}


def cpu_ms_per_token(phase: dict) -> dict[str, float]:
    """CPU milliseconds per streamed token of each of the server's busy processes."""
    tokens_per_s = phase["load"]["output_tokens_per_s"] or 0
    if not tokens_per_s:
        return {}
    by_name: dict[str, float] = {}
    for role, cores in phase["server_cores_busy"].items():
        name = role.split("[")[0]
        by_name[name] = by_name.get(name, 0.0) + cores
    return {name: round(1000 * cores / tokens_per_s, 3) for name, cores in by_name.items()}


def session(args, scratch: Path, logs: Path, repeat: int) -> dict:
    server = ServeWithoutModel(scratch / f"r{repeat + 1}", uuid.uuid4().hex, MODEL_NAME,
                               free_port(), app_args={"model": MODEL_NAME})
    server.run_dir.mkdir(parents=True)
    result: dict = {"repeat": repeat, "log": str(logs / f"r{repeat + 1}.log")}
    try:
        with MemorySampler(server) as sampler:
            ready, result["failed_starts"] = runs.start_until_ready(server, args)
            answered = server.first_answer([1] * args.prompt_len)
            result["cold_start"] = {"process_to_ready_s": round(ready - server.started_at, 2),
                                    "process_to_first_answer_s": round(answered - server.started_at, 2)}
            time.sleep(2)  # as compare_vllm.py: the start's last allocations settle first
            result["idle_memory"] = memory_snapshot(server)
            result["phases"] = {}
            for c in args.concurrency:
                prompts = loadgen.make_prompts(runs.requests_per_phase(c, False) * args.scale,
                                               args.prompt_len, 1000, args.seed + c)
                phase = asyncio.run(runs.run_phase(server, {"concurrency": c, "prompts": prompts},
                                                   args))
                phase["cpu_ms_per_token"] = cpu_ms_per_token(phase)
                result["phases"][f"concurrency_{c}"] = phase
                load = phase["load"]
                print(f"    [{repeat + 1}/{args.repeats}] concurrency {c}: "
                      f"{load['output_tokens_per_s']} tok/s, TTFT p50 {load['ttft_ms_p50']} ms, "
                      f"ITL p50 {load['itl_ms_p50']} ms, "
                      f"p99 {load['itl_ms_p99']} ms, errors {load['errors']}, CPU ms/token "
                      f"{phase['cpu_ms_per_token']}", flush=True)
        result["peak_rss_mib"] = round(sampler.peak_rss / 2**20, 1)
    finally:
        result["teardown"] = server.stop()
        if server.log_path.exists():
            shutil.copy(server.log_path, result["log"])
    print(f"    cold start {result['cold_start']}, idle PSS "
          f"{result['idle_memory']['pss_mib']} MiB in {result['idle_memory']['processes']} "
          f"processes", flush=True)
    return result


def median(values):
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 2) if values else None


def summarize(sessions: list[dict]) -> dict:
    phases = sessions[0]["phases"].keys()
    return {
        "process_to_first_answer_s": median(s["cold_start"]["process_to_first_answer_s"]
                                            for s in sessions),
        "idle_pss_mib": median(s["idle_memory"]["pss_mib"] for s in sessions),
        "tokens_per_s": {p: median(s["phases"][p]["load"]["output_tokens_per_s"]
                                   for s in sessions) for p in phases},
        # The first chunk is ready-made: what remains is the request's way through Serve.
        "ttft_ms_p50": {p: median(s["phases"][p]["load"]["ttft_ms_p50"] for s in sessions)
                        for p in phases},
        "errors": sum(s["phases"][p]["load"]["errors"] for s in sessions for p in phases),
    }


def against(summary: dict, compare: dict) -> dict:
    """Each floor beside plain vLLM's whole server in a compare_vllm.py result (its medians
    over sessions, as the comparison's own table shows them)."""
    out = {}
    for model, result in compare["models"].items():
        vllm = result["servers"]["vllm"]
        idle = report.session_median(vllm, "memory", "idle_pss_mib")
        start = report.session_median(vllm, "cold_start", "process_to_first_answer_s")
        rows = {"idle_pss": {"serve_floor_mib": summary["idle_pss_mib"], "vllm_mib": idle,
                             "floor_over_vllm": round(summary["idle_pss_mib"] / idle, 3)},
                "cold_start": {"serve_floor_s": summary["process_to_first_answer_s"],
                               "vllm_s": start,
                               "floor_over_vllm": round(summary["process_to_first_answer_s"] / start, 3)}}
        for phase, floor in summary["tokens_per_s"].items():
            load = vllm["phases"].get(phase, {}).get("load", {})
            theirs = load.get("output_tokens_per_s")
            if theirs:
                rows[phase] = {"serve_floor_tokens_per_s": floor, "vllm_tokens_per_s": theirs,
                               "floor_over_vllm": round(floor / theirs, 3)}
            hop, their_ttft = summary["ttft_ms_p50"].get(phase), load.get("ttft_ms_p50")
            if theirs and hop is not None and their_ttft:
                # spyre_serve runs vLLM's own OpenAI layer and engine behind Serve, so its
                # TTFT is at least vLLM's plus Serve's way in: the lowest TTFT ratio it can
                # reach. Meaningful at concurrency 1 (higher ones queue behind bursts).
                rows[phase].update({"serve_floor_ttft_ms_p50": hop,
                                    "vllm_ttft_ms_p50": their_ttft,
                                    "lowest_ttft_ratio": round(1 + hop / their_ttft, 3)})
        out[model] = rows
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--scale", type=int, default=4,
                   help="requests per phase, in multiples of compare_vllm.py's full phase")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--against", type=Path, default=None,
                   help="a compare_vllm.py result JSON: set each floor beside plain vLLM's")
    p.add_argument("--out", type=Path, default=None,
                   help="results JSON (default bench/results/serve-floor-<time>.json)")
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--start-retries", type=int, default=1)
    return p.parse_args(argv)


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # through the `finally` that stops the server


def main(argv=None) -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    args = parse_args(argv)
    out = args.out or BENCH / "results" / f"serve-floor-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    logs = out.parent / out.stem
    logs.mkdir(exist_ok=True)
    scratch = short_scratch_dir("sf-")
    try:
        sessions = [session(args, scratch, logs, r) for r in range(args.repeats)]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    document = {"args": {k: str(v) for k, v in vars(args).items()}, "sessions": sessions,
                "summary": summarize(sessions)}
    if args.against:
        document["against_vllm"] = against(document["summary"],
                                           json.loads(args.against.read_text()))
    out.write_text(json.dumps(document, indent=1))
    print(json.dumps({k: document[k] for k in ("summary", "against_vllm") if k in document},
                     indent=1))
    print(f"wrote {out}")
    return 1 if document["summary"]["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
