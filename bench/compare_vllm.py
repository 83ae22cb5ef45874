"""spyre_serve side by side with plain `vllm serve`: same model, same machine, same load.

    .venv/bin/python bench/compare_vllm.py                  # both models, full load
    .venv/bin/python bench/compare_vllm.py --model tiny --quick

One run starts each server in turn on 127.0.0.1 (spyre_serve the way a user does,
`spyre-serve run <config>`; then `vllm serve`), drives both with the same requests
(closed-loop concurrency sweep, then a fixed-rate Poisson stream, fixed seed), stops it,
and writes a JSON file, a PNG plot beside it, and a printed table.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

import loadgen  # noqa: E402
import pyspy_summary  # noqa: E402
import report  # noqa: E402
import startup  # noqa: E402
from metrics import SchedulerWatch  # noqa: E402
from servers import (MemorySampler, PlainVllm, SpyreServe, cpu_seconds_by_pid,  # noqa: E402
                     free_port, memory_snapshot)

REPO = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 64
MODEL_NAME = "bench-model"

# Poisson rates sit below what both servers sustain on 2 cores, so the open-loop phase
# measures latency at a steady load rather than an ever-growing queue.
MODELS = {
    "tiny": {"builder": "tiny_llama", "rate": 4.0},
    "smollm2": {"builder": "smollm2", "rate": 0.3},
}


# Plain vLLM with one difference from its defaults each, to split a gap into its causes.
VLLM_VARIANTS = {
    # spyre_serve's Ray executor cannot schedule the next step while one runs; vLLM can.
    "sync": {"async_scheduling": False},
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["tiny", "smollm2", "both"], default="both")
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
                   help="run the phase sequence this often per server, report medians "
                        "(default 3, --quick 1)")
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
    p.add_argument("--vllm-variants", nargs="+", default=[], choices=list(VLLM_VARIANTS),
                   help="also measure plain vLLM with these changes, as references that "
                        "split the gap (not part of the ratios)")
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
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    return args


def requests_per_phase(concurrency: int, quick: bool) -> int:
    """Whole rounds of `concurrency` requests: every user is busy until the phase ends."""
    return max(4 if quick else 8, concurrency * (2 if quick else 4))


def extra_app_args(pairs: list[str]) -> dict:
    import yaml
    extra = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--spyre-arg {pair!r}: expected KEY=VALUE")
        extra[key] = yaml.safe_load(value)
    return extra


def model_path(builder: str) -> str:
    import spyre_serve.models as models
    return str(getattr(models, builder)())


def vocab_size(path: str) -> int:
    return json.loads((Path(path) / "config.json").read_text())["vocab_size"]


def build_phases(args, rate: float, vocab: int) -> list[dict]:
    """The same requests, in the same order, for both servers."""
    phases = []
    for i, c in enumerate(args.concurrency):
        n = requests_per_phase(c, args.quick)
        phases.append({"name": f"concurrency_{c}", "concurrency": c,
                       "prompts": loadgen.make_prompts(n, args.prompt_len, vocab, args.seed + 1 + i)})
    n = 16 if args.quick else 48
    phases.append({"name": f"poisson_{rate:g}rps", "rate": rate,
                   "prompts": loadgen.make_prompts(n, args.prompt_len, vocab, args.seed + 100)})
    return phases


async def run_phase(server, phase: dict, args, profile: bool = False) -> dict:
    url = f"{server.base_url}/v1/completions"
    bodies = [loadgen.request_body(MODEL_NAME, p, args.output_len) for p in phase["prompts"]]
    own = server.processes()
    exclude = {p.pid for p in own} | {os.getpid()}
    cpu_before, t0 = cpu_seconds_by_pid(exclude), time.time()
    own_before = cpu_seconds_by_role(own)
    client_before = sum(psutil.Process().cpu_times()[:2])
    profiler = None
    if profile:
        profiler = start_py_spy(server)
    async with SchedulerWatch(server.base_url) as watch:
        if "rate" in phase:
            results, wall = await loadgen.open_loop(url, bodies, phase["rate"], args.seed)
        else:
            results, wall = await loadgen.closed_loop(url, bodies, phase["concurrency"])
    profile_summary = None
    if profiler:
        stop_py_spy(profiler)
        profile_summary = {Path(out).name: pyspy_summary.summarize(Path(out))
                           for _, out in profiler if Path(out).exists()}
    cpu_after = cpu_seconds_by_pid(exclude)
    own_after = cpu_seconds_by_role(own)
    client = sum(psutil.Process().cpu_times()[:2]) - client_before
    elapsed = time.time() - t0
    used = {pid: v - cpu_before.get(pid, 0.0) for pid, v in cpu_after.items()}
    background = sum(used.values())
    return {
        "concurrency": phase.get("concurrency"), "rate": phase.get("rate"),
        "load": loadgen.summarize(results, wall, args.output_len),
        "scheduler": watch.summary(),
        # Where the server's CPU went: cores each of its processes kept busy.
        "server_cores_busy": {role: round((own_after[role] - own_before.get(role, 0.0)) / elapsed, 2)
                              for role in sorted(own_after, key=lambda r: -own_after[r])
                              if own_after[role] - own_before.get(role, 0.0) > 0.01 * elapsed},
        # Other work on this machine (the engine tests of another session, for one).
        # The load generator shares the machine: near 1 core, it measures itself.
        "client_cores_busy": round(client / elapsed, 2),
        "background_cores_busy": round(background / elapsed, 2),
        "background_top": describe_busiest(used, elapsed),
        "loadavg_1m_after": round(os.getloadavg()[0], 2),
        **({"py_spy": profile_summary} if profile_summary else {}),
    }


def pin_card_actor(server) -> dict:
    """Every thread of the card actors on CPU 0, every thread of the rest on the others."""
    cpus = sorted(os.sched_getaffinity(0))
    card, rest = {cpus[0]}, set(cpus[1:]) or {cpus[0]}
    pinned = {}
    for p in server.processes():
        try:
            target = card if "SpyreRayWorker" in p.name() else rest
            for thread in p.threads():
                os.sched_setaffinity(thread.id, target)
            pinned[f"{p.name()}[{p.pid}]"] = sorted(target)
        except (psutil.Error, OSError):
            continue
    return pinned


def describe_busiest(used: dict[int, float], elapsed: float, top: int = 3) -> list[str]:
    out = []
    for pid, seconds in sorted(used.items(), key=lambda kv: -kv[1])[:top]:
        if seconds < 0.05 * elapsed:
            break
        try:
            what = " ".join(psutil.Process(pid).cmdline())[:80]
        except psutil.Error:
            what = "(exited)"
        out.append(f"{seconds / elapsed:.2f} cores: pid {pid} {what}")
    return out


def combine_repeats(measured: list[dict]) -> dict:
    """Medians of the load figures, the scheduler's extremes, every repeat kept."""
    def median(values):
        values = sorted(v for v in values if v is not None)
        return values[len(values) // 2] if values else None

    loads = [m["load"] for m in measured]
    combined = {key: median([load[key] for load in loads])
                if isinstance(loads[0][key], (int, float)) else loads[0][key]
                for key in loads[0]}
    combined["errors"] = sum(load["errors"] for load in loads)
    combined["first_errors"] = [e for load in loads for e in load["first_errors"]][:3]
    scheduler = {"peak_running": max_of(m["scheduler"]["peak_running"] for m in measured),
                 "peak_waiting": max_of(m["scheduler"]["peak_waiting"] for m in measured),
                 "peak_kv_usage_perc": max_of(m["scheduler"]["peak_kv_usage_perc"] for m in measured),
                 "preemptions": sum(m["scheduler"]["preemptions"] or 0 for m in measured),
                 "server_ttft_ms_mean": median([m["scheduler"]["server_ttft_ms_mean"] for m in measured]),
                 "server_itl_ms_mean": median([m["scheduler"]["server_itl_ms_mean"] for m in measured])}
    spread = {key: [min_of(load[key] for load in loads), max_of(load[key] for load in loads)]
              for key in ("output_tokens_per_s", "ttft_ms_p50", "tpot_ms_p50")}
    return {
        "concurrency": measured[0]["concurrency"], "rate": measured[0]["rate"],
        "load": combined, "load_range_over_repeats": spread, "scheduler": scheduler,
        "client_cores_busy": median([m["client_cores_busy"] for m in measured]),
        "background_cores_busy": median([m["background_cores_busy"] for m in measured]),
        "loadavg_1m_after": [m["loadavg_1m_after"] for m in measured],
        "repeats": measured,
    }


def min_of(values):
    values = [v for v in values if v is not None]
    return min(values) if values else None


def max_of(values):
    values = [v for v in values if v is not None]
    return max(values) if values else None


def cpu_seconds_by_role(processes) -> dict[str, float]:
    """CPU seconds so far per process name (Ray names its workers after the actor)."""
    seconds: dict[str, float] = {}
    for p in processes:
        try:
            role = f"{p.name()}[{p.pid}]"
            t = p.cpu_times()
            seconds[role] = t.user + t.system
        except psutil.Error:
            continue
    return seconds


def start_py_spy(server) -> list[tuple[subprocess.Popen, str]]:
    """py-spy on the replica, its EngineCore and the card actor: where our CPU goes."""
    wanted = ("ServeReplica", "EngineCore", "SpyreRayWorker", "ProxyActor")
    profilers = []
    for p in server.processes():
        try:
            name = p.name()
        except psutil.Error:
            continue
        role = next((w for w in wanted if w in name), None)
        if role:
            out = server.log_path.parent / f"py-spy-{role}-{p.pid}.txt"
            cmd = [shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"),
                   "record", "--pid", str(p.pid), "--format", "raw", "--rate", "50",
                   "--nonblocking", "--output", str(out)]
            profilers.append((subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                               stderr=subprocess.DEVNULL), str(out)))
    return profilers


def stop_py_spy(profilers) -> None:
    for proc, _ in profilers:
        proc.send_signal(2)  # SIGINT: py-spy writes its output and exits
    for proc, _ in profilers:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def engine_facts(lines) -> dict:
    """Settings each server's engine really ran with, as its log states them."""
    import re
    text = "\n".join(t for _, t in lines)
    facts = {}
    for key, pattern in (("max_num_batched_tokens", r"max_num_batched_tokens=(\d+)"),
                         ("async_scheduling", r"async_scheduling=(\w+)"),
                         ("kv_cache_tokens", r"KV cache size: ([\d,]+) tokens")):
        m = re.search(pattern, text)
        facts[key] = m.group(1) if m else None
    facts["async_scheduling_disabled_by_executor"] = "Async scheduling will be disabled" in text
    return facts


def start_until_ready(server, args) -> tuple[float, list[str]]:
    """Start the server; once more if it dies before it is ready. On a loaded machine
    `ray start` can time out waiting for its own raylet; the failure is kept."""
    failures = []
    for attempt in range(1 + args.start_retries):
        print(f"--- starting {server.kind}: {' '.join(server.command())}", flush=True)
        server.start()
        try:
            return server.wait_ready(args.start_timeout), failures
        except (RuntimeError, TimeoutError) as e:
            failures.append(f"attempt {attempt + 1}: {e}; last output: "
                            f"{server.lines[-1][1][:300] if server.lines else ''}")
            print(f"    {failures[-1]}", flush=True)
            server.stop()
            if attempt == args.start_retries:
                raise
            server.lines.clear()
    raise AssertionError("unreachable")


def serve_one(server, args, phases, warm_prompts, first_prompt) -> dict:
    result: dict = {"command": server.command()}
    try:
        with MemorySampler(server) as sampler:
            ready, result["failed_starts"] = start_until_ready(server, args)
            answered = server.first_answer(first_prompt)
            t0 = server.started_at
            result["cold_start"] = {"process_to_ready_s": round(ready - t0, 2),
                                    "process_to_first_answer_s": round(answered - t0, 2)}
            print(f"    {server.kind} ready after {ready - t0:.1f} s, first answer after "
                  f"{answered - t0:.1f} s", flush=True)
            foreign = server.foreign_listeners()
            if foreign:
                raise RuntimeError(f"processes {foreign} outside this run also listen on port "
                                   f"{server.http_port}; results would mix two servers")
            if server.kind == "spyre_serve":
                status = server.status()
                result["status"] = {k: status.get(k) for k in
                                    ("num_blocks", "usable_blocks", "limiting_rank", "override",
                                     "max_model_len", "ready_seconds", "first_request_seconds",
                                     "reports")}
                result["status"]["warmup"] = [r.get("warmup") for r in status.get("ranks", [])]
            if args.pin_card_actor and server.kind == "spyre_serve":
                result["pinned"] = pin_card_actor(server)
            time.sleep(2)  # let the start's last allocations settle before the idle snapshot
            idle = memory_snapshot(server)
            asyncio.run(loadgen.closed_loop(
                f"{server.base_url}/v1/completions",
                [loadgen.request_body(MODEL_NAME, p, args.output_len) for p in warm_prompts],
                max(args.concurrency)))
            # The whole sequence of phases, `repeats` times: a burst of other work on the
            # machine then spoils one repeat of a phase, and the median leaves it out.
            runs: dict[str, list[dict]] = {phase["name"]: [] for phase in phases}
            for repeat in range(args.repeats):
                for phase in phases:
                    profile = (args.py_spy and repeat == 0 and server.kind == "spyre_serve"
                               and phase.get("concurrency") == max(args.concurrency))
                    measured = asyncio.run(run_phase(server, phase, args, profile))
                    runs[phase["name"]].append(measured)
                    load = measured["load"]
                    print(f"    [{repeat + 1}/{args.repeats}] {phase['name']}: "
                          f"{load['output_tokens_per_s']} tok/s, TTFT p50 {load['ttft_ms_p50']} ms, "
                          f"TPOT p50 {load['tpot_ms_p50']} ms, errors {load['errors']}", flush=True)
            result["phases"] = {name: combine_repeats(measured) for name, measured in runs.items()}
            after = memory_snapshot(server)
        result["memory"] = {"idle": idle, "after_load": after,
                            "peak_rss_mib": round(sampler.peak_rss / 2**20, 1)}
    finally:
        result["teardown"] = server.stop()
    milestones = startup.find_milestones(
        server.lines, startup.SPYRE_MILESTONES if server.kind == "spyre_serve" else startup.VLLM_MILESTONES)
    milestones.update({"process_start": server.started_at, "http_ready": ready,
                       "first_answer": answered})
    if server.kind == "spyre_serve":
        milestones.update(startup.spyre_status_milestones(status))
        result["start_breakdown"] = startup.breakdown(milestones, startup.SPYRE_STEPS)
        result["handshake_s"] = startup.handshake_seconds(milestones)
    else:
        result["start_breakdown"] = startup.breakdown(milestones, startup.VLLM_STEPS)
    result["milestones"] = {k: round(v - server.started_at, 3) for k, v in milestones.items()}
    result["engine"] = engine_facts(server.lines)
    result["log"] = str(server.log_path)
    return result


def kv_usefulness(config: dict, block_budget: int, ours: dict, theirs: dict) -> dict:
    """vllm-spyre reserves max_model_len/64 blocks per sequence up front; vLLM's scheduler
    (ours, on the handshake's count) takes blocks as the sequence grows."""
    per_seq_static = math.ceil(config["max_model_len"] / BLOCK_SIZE)
    per_seq_dynamic = math.ceil((config["prompt_len"] + config["output_len"]) / BLOCK_SIZE)
    usable = block_budget - 1  # vLLM's null block

    def over_phases(server, key, combine):
        values = [p["scheduler"][key] for p in server["phases"].values()
                  if p["scheduler"][key] is not None]
        return combine(values) if values else None

    return {
        "block_budget": block_budget,
        "static_blocks_per_seq": per_seq_static,
        "static_blocks_needed_for_max_num_seqs": config["max_num_seqs"] * per_seq_static + 1,
        "static_max_concurrent_seqs": usable // per_seq_static,
        "dynamic_blocks_per_seq": per_seq_dynamic,
        "dynamic_max_concurrent_seqs": min(config["max_num_seqs"], usable // per_seq_dynamic),
        "peak_running": {"spyre_serve": over_phases(ours, "peak_running", max),
                         "vllm": over_phases(theirs, "peak_running", max)},
        "preemptions": {"spyre_serve": over_phases(ours, "preemptions", sum),
                        "vllm": over_phases(theirs, "preemptions", sum)},
        "peak_kv_usage_perc": {"spyre_serve": over_phases(ours, "peak_kv_usage_perc", max),
                               "vllm": over_phases(theirs, "peak_kv_usage_perc", max)},
    }


def bench_model(model: str, args, out_dir: Path) -> dict:
    spec = MODELS[model]
    path = model_path(spec["builder"])  # built once and cached, outside the timed start
    rate = args.rate or spec["rate"]
    config = {"model": model, "model_path": path, "max_model_len": args.max_model_len,
              "max_num_seqs": args.max_num_seqs, "block_size": BLOCK_SIZE,
              "prompt_len": args.prompt_len, "output_len": args.output_len,
              "concurrency": args.concurrency, "poisson_rate": rate, "seed": args.seed,
              "quick": args.quick, "kv_blocks_requested": args.kv_blocks,
              "vllm_variants": args.vllm_variants,
              "spyre_serve_extra_args": extra_app_args(args.spyre_arg),
              "spyre_serve_extra_env": args.spyre_env,
              "spyre_serve_card_actor_pinned": args.pin_card_actor}
    config["summary"] = (f"prompt {args.prompt_len} + output {args.output_len} tokens, "
                         f"max_model_len {args.max_model_len}, max_num_seqs {args.max_num_seqs}")
    vocab = vocab_size(path)
    phases = build_phases(args, rate, vocab)
    warm = loadgen.make_prompts(max(args.concurrency), args.prompt_len, vocab, args.seed + 50)
    first = loadgen.make_prompts(1, 16, vocab, args.seed + 99)[0]
    run_id = uuid.uuid4().hex[:12]
    # Short: Ray puts unix sockets under its temp dir, and their paths have a length limit.
    scratch = Path(tempfile.mkdtemp(prefix="sb-"))
    logs = out_dir / f"{model}-logs"
    logs.mkdir(parents=True, exist_ok=True)
    servers = {}
    try:
        engine_kwargs = {"num_gpu_blocks_override": args.kv_blocks} if args.kv_blocks else {}
        spyre_dir = scratch / "s"
        spyre_dir.mkdir()
        ours = SpyreServe(spyre_dir, run_id + "s", MODEL_NAME, free_port(), app_args={
            "model": path, "served_model_name": MODEL_NAME, "max_model_len": args.max_model_len,
            "max_num_seqs": args.max_num_seqs, "engine_kwargs": engine_kwargs,
            **extra_app_args(args.spyre_arg)},
            extra_env=dict(pair.split("=", 1) for pair in args.spyre_env))
        ours.log_path = logs / "spyre_serve.log"
        servers["spyre_serve"] = serve_one(ours, args, phases, warm, first)
        block_budget = servers["spyre_serve"]["status"]["num_blocks"]
        bytes_per_block = servers["spyre_serve"]["status"]["reports"][0]["bytes_per_block"]
        vllm_args = {"max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
                     "block_size": BLOCK_SIZE, "dtype": "float32", "enforce_eager": True,
                     "num_gpu_blocks_override": block_budget,
                     # Without it the CPU worker wants 92% of host memory free
                     # (gpu_memory_utilization) and refuses to start.
                     "kv_cache_memory_bytes": block_budget * bytes_per_block}
        for variant in ([] if args.spyre_only else [None]) + args.vllm_variants:
            name = "vllm" if variant is None else f"vllm_{variant}"
            vllm_dir = scratch / name
            vllm_dir.mkdir()
            theirs = PlainVllm(vllm_dir, run_id + name, MODEL_NAME, free_port(), model_path=path,
                               engine_args={**vllm_args, **VLLM_VARIANTS.get(variant, {})})
            theirs.log_path = logs / f"{name}.log"
            servers[name] = serve_one(theirs, args, phases, warm, first)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if "vllm" not in servers:  # --spyre-only: a tuning run, absolutes only
        return {"config": config, "servers": servers}
    ratios = report.phase_ratios(servers["spyre_serve"]["phases"], servers["vllm"]["phases"])
    return {
        "config": config,
        "servers": servers,
        "ratios": ratios,
        "kv_usefulness": kv_usefulness(config, block_budget, servers["spyre_serve"], servers["vllm"]),
        "targets": report.targets(ratios, servers["spyre_serve"]["handshake_s"]),
    }


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
            "niceness": os.getpriority(os.PRIO_PROCESS, 0)}


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
                         "order": "spyre_serve first, then vllm, one at a time"},
                "models": {}}
    for model in models:
        document["models"][model] = bench_model(model, args, out.parent / out.stem)
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
