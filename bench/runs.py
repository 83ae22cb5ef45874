"""The runs of bench/compare_vllm.py: start a server, drive the load phases, stop it.

Each server runs in sessions (start, warm-up round, the phase sequence once, stop), one
session per repeat, in ABBA order (spyre_serve, vllm, vllm, spyre_serve, ...): a drift of
the shared machine over the run then weighs on both servers alike.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import psutil

from spyre_serve.vllm_plugin.card_actors import CARD_ACTOR_CLASSES, is_card_actor_process

sys.path.insert(0, str(Path(__file__).resolve().parent))

import loadgen  # noqa: E402
import metrics  # noqa: E402
import pyspy_summary  # noqa: E402
import report  # noqa: E402
import roofline  # noqa: E402
import startup  # noqa: E402
import verdict  # noqa: E402
from metrics import SchedulerWatch  # noqa: E402
from servers import (MemorySampler, PlainVllm, SpyreServe, cpu_seconds_by_pid,  # noqa: E402
                     free_port, memory_snapshot, short_scratch_dir)

BLOCK_SIZE = 64
MODEL_NAME = "bench-model"

# Poisson rates sit below what both servers sustain on 2 cores, so the open-loop phase
# measures latency at a steady load rather than an ever-growing queue.
MODELS = {
    "tiny": {"builder": "tiny_llama", "rate": 4.0},
    "smollm2": {"builder": "smollm2", "rate": 0.3},
}

# Plain vLLM again, as references beside the comparison (not part of the ratios).
VLLM_VARIANTS = {
    # The same settings as `vllm`: an A/A control, whose gap to `vllm` is what two
    # starts of one server differ by on this machine. (It used to be `sync`, vLLM with
    # --no-async-scheduling; vLLM's CPU platform turns async scheduling off on both
    # servers, so that was the baseline again.)
    "control": {},
}
VARIANT_ALIASES = {"sync": "control"}


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
    import spyre_serve.ops.models as models
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
            target = card if is_card_actor_process(p.name()) else rest
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


# Processes whose threads matter: where the model runs (spyre_serve's card actor, vLLM's
# EngineCore, which holds plain vLLM's CPU worker), and what feeds it.
THREAD_ROLES = (*CARD_ACTOR_CLASSES, "EngineCore", "ServeReplica", "ProxyActor", "APIServer")


def thread_settings(server, status: dict | None) -> dict:
    """Thread counts each server really runs with, as far as the bench can read them.

    Per process: its live thread count (/proc/<pid>/status Threads: torch's pool, plus
    Ray's or vLLM's own threads) and OMP_NUM_THREADS as the process was started
    (/proc/<pid>/environ). Ray sets OMP_NUM_THREADS=1 inside actors that reserve no CPU
    after they start (ray._private.utils.set_omp_num_threads_if_unset), which environ does
    not show; torch.get_num_threads() of a card actor is recorded when /spyre/status
    reports it (a "torch_num_threads" or "torch_threads" field of a rank)."""
    processes = []
    for p in server.processes():
        try:
            name = p.name()
            if not any(role in name for role in THREAD_ROLES) and p.pid != server.proc.pid:
                continue
            try:
                omp = p.environ().get("OMP_NUM_THREADS")
            except (psutil.Error, OSError):
                omp = "(unreadable)"
            processes.append({"pid": p.pid, "name": name, "threads": p.num_threads(),
                              "omp_num_threads_at_start": omp})
        except psutil.Error:
            continue
    torch_threads = [rank.get("torch_num_threads", rank.get("torch_threads"))
                     for rank in (status or {}).get("ranks", [])]
    return {"processes": sorted(processes, key=lambda d: d["name"]),
            "card_actor_torch_threads": torch_threads if any(t is not None for t in torch_threads)
            else None}


def read_settings(server, status: dict | None) -> dict:
    """KV blocks, dtype, async scheduling and threads the server runs with (while it is up)."""
    try:
        info = metrics.cache_config_info(httpx.get(f"{server.base_url}/metrics", timeout=30).text)
    except httpx.HTTPError:
        info = {}
    facts = metrics.engine_facts(server.lines)
    return {**metrics.kv_blocks_of(info, status, facts, BLOCK_SIZE),
            "block_size": metrics._int_or_none(info.get("block_size")),
            "dtype": facts["dtype"], "kv_cache_dtype": info.get("cache_dtype"),
            **async_scheduling_of(facts, status),
            "threads": thread_settings(server, status)}


def async_scheduling_of(facts: dict, status: dict | None = None) -> dict:
    """What spyre_serve's ranks say (/spyre/status: its platform keeps vLLM's choice,
    where the CPU platform turns it off); else what the log says; else what the installed
    vLLM's CPU platform, which plain vLLM runs on, forces (vLLM's config line does not
    print async_scheduling)."""
    ranks = [r.get("async_scheduling") for r in (status or {}).get("ranks", [])]
    if ranks and all(isinstance(r, bool) for r in ranks):
        return {"async_scheduling": all(ranks), "async_scheduling_source": "/spyre/status"}
    if facts.get("async_scheduling") in ("True", "False"):
        return {"async_scheduling": facts["async_scheduling"] == "True",
                "async_scheduling_source": "server log"}
    if cpu_platform_disables_async_scheduling():
        return {"async_scheduling": False,
                "async_scheduling_source": "vllm/platforms/cpu.py sets it False"}
    return {"async_scheduling": None, "async_scheduling_source": None}


def cpu_platform_disables_async_scheduling() -> bool | None:
    """Whether the installed vLLM's CPU platform (spyre_serve's platform subclasses it)
    sets scheduler_config.async_scheduling = False whatever was asked."""
    import inspect
    try:
        from vllm.platforms.cpu import CpuPlatform
        source = inspect.getsource(CpuPlatform.check_and_update_config)
    except (ImportError, OSError, TypeError):
        return None
    return "async_scheduling = False" in source


def start_py_spy(server) -> list[tuple[subprocess.Popen, str]]:
    """py-spy on the replica, its EngineCore and the card actor: where our CPU goes."""
    wanted = ("ServeReplica", "EngineCore", *CARD_ACTOR_CLASSES, "ProxyActor")
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


def serve_session(server, args, phases, warm_prompts, first_prompt, repeat: int) -> dict:
    """One session: start, first answer, warm-up round, every phase once, stop."""
    result: dict = {"command": server.command(), "repeat": repeat}
    status = None
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
            result["phases"] = {}
            for phase in phases:
                profile = (args.py_spy and repeat == 0 and server.kind == "spyre_serve"
                           and phase.get("concurrency") == max(args.concurrency))
                measured = asyncio.run(run_phase(server, phase, args, profile))
                result["phases"][phase["name"]] = measured
                load = measured["load"]
                print(f"    [{repeat + 1}/{args.repeats}] {server.kind} {phase['name']}: "
                      f"{load['output_tokens_per_s']} tok/s, TTFT p50 {load['ttft_ms_p50']} ms, "
                      f"TPOT p50 {load['tpot_ms_p50']} ms, errors {load['errors']}, "
                      f"short {load['short_outputs']}", flush=True)
            # After the load: the threads torch and vLLM started are there by now.
            result["settings"] = read_settings(server, status)
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
    result["engine"] = metrics.engine_facts(server.lines)
    result["log"] = str(server.log_path)
    return result


def bench_model(model: str, args, out_dir: Path, bandwidth: dict | None = None) -> dict:
    spec = MODELS[model]
    path = model_path(spec["builder"])  # built once and cached, outside the timed start
    rate = args.rate or spec["rate"]
    names = ["spyre_serve"] + ([] if args.spyre_only else ["vllm"])
    schedule = verdict.abba_order(names, args.repeats)
    schedule += [(r, f"vllm_{v}") for v in args.vllm_variants for r in range(args.repeats)]
    config = {"model": model, "model_path": path, "max_model_len": args.max_model_len,
              "max_num_seqs": args.max_num_seqs, "block_size": BLOCK_SIZE,
              "prompt_len": args.prompt_len, "output_len": args.output_len,
              "concurrency": args.concurrency, "poisson_rate": rate, "seed": args.seed,
              "quick": args.quick, "repeats": args.repeats, "kv_blocks_requested": args.kv_blocks,
              "vllm_variants": args.vllm_variants,
              "run_order": [f"{name}#{r + 1}" for r, name in schedule],
              "spyre_serve_extra_args": extra_app_args(args.spyre_arg),
              "spyre_serve_extra_env": args.spyre_env,
              "spyre_serve_card_actor_pinned": args.pin_card_actor}
    config["summary"] = (f"prompt {args.prompt_len} + output {args.output_len} tokens, "
                         f"max_model_len {args.max_model_len}, max_num_seqs {args.max_num_seqs}, "
                         f"{args.repeats} repeat(s) in ABBA order")
    vocab = vocab_size(path)
    phases = build_phases(args, rate, vocab)
    warm = loadgen.make_prompts(max(args.concurrency), args.prompt_len, vocab, args.seed + 50)
    first = loadgen.make_prompts(1, 16, vocab, args.seed + 99)[0]
    run_id = uuid.uuid4().hex[:12]
    scratch = short_scratch_dir("sb-")
    logs = out_dir / f"{model}-logs"
    logs.mkdir(parents=True, exist_ok=True)
    sessions: dict[str, list[dict]] = {name: [] for _, name in schedule}
    engine_kwargs = {"num_gpu_blocks_override": args.kv_blocks} if args.kv_blocks else {}
    vllm_args = None
    try:
        for position, (repeat, name) in enumerate(schedule):
            tag = f"{name}-r{repeat + 1}"
            run_dir = scratch / tag
            run_dir.mkdir()
            if name == "spyre_serve":
                server = SpyreServe(run_dir, f"{run_id}{tag}", MODEL_NAME, free_port(), app_args={
                    "model": path, "served_model_name": MODEL_NAME,
                    "max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
                    "engine_kwargs": engine_kwargs, **extra_app_args(args.spyre_arg)},
                    extra_env=dict(pair.split("=", 1) for pair in args.spyre_env))
            else:
                if vllm_args is None:  # the order starts with spyre_serve: its blocks are known
                    status = sessions["spyre_serve"][0]["status"]
                    vllm_args = plain_vllm_args(args, status["num_blocks"],
                                                status["reports"][0]["bytes_per_block"])
                variant = name.removeprefix("vllm").lstrip("_") or None
                server = PlainVllm(run_dir, f"{run_id}{tag}", MODEL_NAME, free_port(),
                                   model_path=path,
                                   engine_args={**vllm_args, **VLLM_VARIANTS.get(variant, {})})
            server.log_path = logs / f"{tag}.log"
            session = serve_session(server, args, phases, warm, first, repeat)
            session["run_position"] = position + 1
            sessions[name].append(session)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    servers = {name: metrics.combine_sessions(runs) for name, runs in sessions.items()}
    floor = bandwidth and roofline.decode_vs_floor(
        servers, roofline.decode_weights_bytes(path), bandwidth)
    if "vllm" not in servers:  # --spyre-only: a tuning run, absolutes only
        return {"config": config, "servers": servers, "decode_vs_bandwidth": floor}
    block_budget = servers["spyre_serve"]["status"]["num_blocks"]
    result = {
        "config": config,
        "servers": servers,
        # spyre_serve / vLLM of each phase's medians (the table); the verdict takes the
        # median of the per-repeat ratios instead (bench/verdict.py).
        "ratios": report.phase_ratios(servers["spyre_serve"]["phases"], servers["vllm"]["phases"]),
        "kv_usefulness": metrics.kv_usefulness(config, block_budget, servers["spyre_serve"],
                                               servers["vllm"]),
        "decode_vs_bandwidth": floor,
    }
    result.update(verdict.judge_model(result))  # validity, targets, verdict
    return result


def plain_vllm_args(args, block_budget: int, bytes_per_block: int) -> dict:
    return {"max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
            "block_size": BLOCK_SIZE, "dtype": "float32", "enforce_eager": True,
            "num_gpu_blocks_override": block_budget,
            # Without it the CPU worker wants 92% of host memory free
            # (gpu_memory_utilization) and refuses to start.
            "kv_cache_memory_bytes": block_budget * bytes_per_block}

