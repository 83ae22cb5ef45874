"""Where the start of each server went: milestones found in its output, split into steps.

A line's time is, best first: the epoch our vLLM logging config stamps on it
(`[bench-ts 1796218643.765]`), Ray's own millisecond timestamp, or the time the line
reached us (Ray forwards worker output through its log monitor, a little late).
"""
from __future__ import annotations

import re
from datetime import datetime

BENCH_TS = re.compile(r"\[bench-ts (\d+\.\d+)\]")
RAY_TS = re.compile(r"(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2},\d{3})")

# (milestone, pattern, which occurrence): "last" where every rank logs the same line.
SPYRE_MILESTONES = [
    ("cli_checked_ray", r"spyre-serve: starting a local Ray head", "first"),
    ("ray_started", r"Ray runtime started", "first"),
    ("replica_added", r"Adding 1 replica to Deployment", "first"),
    ("engine_init", r"Initializing a V1 LLM engine", "first"),
    # The card actors' INFO log never reaches the driver (their vLLM logger has no
    # handler); vLLM's weight-loading progress bar (stderr) does, timed on arrival. Its 0%
    # and 100% lines arrive together (one line, ended at 100%), so actor start and weight
    # loading cannot be told apart from here.
    ("weights_loaded", r"Loading safetensors checkpoint shards: 100%", "first"),
    ("reports_gathered", r"Spyre block reports:", "first"),
    ("decided", r"Spyre KV cache: \d+ blocks", "first"),
    ("resized", r"(CPU|GPU) KV cache size", "first"),
    ("engine_ready", r"init engine \(profile, create kv cache, warmup model\) took", "first"),
    ("replica_ready", r"replica \S+ ready in", "first"),
]

# (step, from milestone, to milestone)
SPYRE_STEPS = [
    ("spyre-serve CLI (imports, `ray status`)", "process_start", "cli_checked_ray"),
    ("Ray start (`ray start --head`)", "cli_checked_ray", "ray_started"),
    ("serve run: connect, controller, deploy", "ray_started", "replica_added"),
    ("replica actor + EngineCore process", "replica_added", "engine_init"),
    ("card actors + model load (placement, init, weights)", "engine_init", "weights_loaded"),
    ("after load, until warmup", "weights_loaded", "warmup_started"),
    ("warmup on 4 blocks", "warmup_started", "reports_written"),
    ("compiler report -> executor", "reports_written", "reports_gathered"),
    ("coordinator: min over ranks", "reports_gathered", "decided"),
    ("resize broadcast", "decided", "resized"),
    ("KV allocation + vLLM's own warmup", "resized", "engine_ready"),
    ("first request + OpenAI app", "engine_ready", "replica_ready"),
    ("Serve routes to the replica", "replica_ready", "http_ready"),
    ("first answer", "http_ready", "first_answer"),
]

VLLM_MILESTONES = [
    ("engine_init", r"Initializing a V1 LLM engine", "first"),
    ("weights_loaded", r"Loading weights took|Model loading took", "first"),
    ("resized", r"(CPU|GPU) KV cache size", "first"),
    ("engine_ready", r"init engine \(profile, create kv cache, warmup model\) took", "first"),
    ("api_up", r"Starting vLLM server on", "first"),
]

VLLM_STEPS = [
    ("vllm CLI, config", "process_start", "engine_init"),
    ("model load", "engine_init", "weights_loaded"),
    ("KV sizing", "weights_loaded", "resized"),
    ("KV allocation + warmup", "resized", "engine_ready"),
    ("API server up", "engine_ready", "api_up"),
    ("listening -> /v1/models", "api_up", "http_ready"),
    ("first answer", "http_ready", "first_answer"),
]


def line_time(arrived: float, text: str) -> float:
    m = BENCH_TS.search(text)
    if m:
        return float(m.group(1))
    m = RAY_TS.search(text)
    if m:
        return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return arrived


def find_milestones(lines: list[tuple[float, str]], patterns) -> dict[str, float]:
    found: dict[str, float] = {}
    for name, pattern, which in patterns:
        regex = re.compile(pattern)
        hits = [line_time(t, text) for t, text in lines if regex.search(text)]
        if hits:
            found[name] = hits[0] if which == "first" else hits[-1]
    return found


def spyre_status_milestones(status: dict) -> dict[str, float]:
    """Warmup and report times from the ranks' own account (GET /spyre/status).

    A rank's report is written at the end of its warmup, and warmup["seconds"] runs from
    the start of warmup to the report read back, a moment after it is written."""
    ranks = status.get("ranks", [])
    written = [r["created_at"] for r in status.get("reports", [])]
    starts = [w["created_at"] - rank["warmup"]["seconds"]
              for w, rank in zip(sorted(status.get("reports", []), key=lambda r: r["rank"]), ranks)
              if rank.get("warmup")]
    found = {}
    if written:
        found["reports_written"] = max(written)
    if starts:
        found["warmup_started"] = min(starts)
    return found


def breakdown(milestones: dict[str, float], steps) -> list[dict]:
    """Step durations, never negative: a step whose ends are missing, or run backwards, is
    None. Ends run backwards when their times come from different clocks (a line's arrival
    through Ray's log monitor is late; a stamp in the line, or /spyre/status, is not): the
    raw difference is kept beside a note, and the steps around it absorb the gap."""
    out = []
    for name, start, end in steps:
        a, b = milestones.get(start), milestones.get(end)
        step = {"step": name, "seconds": None, "from": start, "to": end}
        if a is not None and b is not None:
            if b >= a:
                step["seconds"] = round(b - a, 3)
            else:
                step["raw_seconds"] = round(b - a, 3)
                step["note"] = (f"'{end}' stamped {a - b:.3f} s before '{start}': "
                                f"the two times come from different clocks")
        out.append(step)
    return out


def handshake_seconds(milestones: dict[str, float]) -> float | None:
    """Last report written -> every rank holds the decided size (report, min, broadcast);
    None if either end is missing or they run backwards (see breakdown)."""
    a, b = milestones.get("reports_written"), milestones.get("resized")
    return None if a is None or b is None or b < a else round(b - a, 3)
