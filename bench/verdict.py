"""PASS / FAIL of one comparison, and when neither may be said.

Pure functions over the results JSON, no server needed:

* INVALID: a request failed or came back short on either server, a server held its
  streams back (the engine produced tokens at a steady pace but they reached the client
  in one burst), or the two servers did not run with the same number of KV blocks. Failed
  requests drop out of the token count and the TTFT percentiles, so a server that errors
  could look fast; a held-back stream makes its server look slow. No ratio is judged.
* INCONCLUSIVE: the ratio moves more across repeats than its distance to the threshold
  (spread >= margin), or there is a single repeat (no spread to compare with). The
  machine is shared; a verdict the noise could flip is not given.
* PASS / FAIL: otherwise, on the median of the per-repeat ratios (repeat i of spyre_serve
  over repeat i of vLLM, run next to each other in the ABBA order).
"""
from __future__ import annotations

import statistics
from typing import Iterable, Sequence

PASS, FAIL, INVALID, INCONCLUSIVE, NOT_MEASURED = "PASS", "FAIL", "INVALID", "INCONCLUSIVE", "n/a"

# A stream is held back when tokens reach the client this much closer together than the
# engine produced them (seen once: plain vLLM's API server delivered every token of 32
# requests at ~2.0 s, client ITL p50 0.00 ms against 1.79 ms in its engine).
HELD_BACK_ITL_SHARE = 0.25

# Targets from the issue, for spyre_serve / vLLM.
THROUGHPUT_FLOOR = 0.95
TTFT_P50_CEILING = 1.10
ITL_P99_CEILING = 1.50      # no multi-hundred-millisecond stalls in a stream
TPOT_P50_CEILING = 1.10
COLD_START_CEILING = 1.30   # process start to the first answer
IDLE_PSS_CEILING = 1.15     # PSS summed over every process of the server, idle after start
HANDSHAKE_CEILING_S = 1.0


def abba_order(names: Sequence[str], repeats: int) -> list[tuple[int, str]]:
    """(repeat, server) in run order: A B, B A, A B, ... (ABBA). A drift of the machine
    over the run (another job starting, the page cache warming) then weighs on both
    servers alike instead of always on the one that runs second."""
    order: list[tuple[int, str]] = []
    for repeat in range(repeats):
        turn = list(names) if repeat % 2 == 0 else list(reversed(names))
        order += [(repeat, name) for name in turn]
    return order


def validity_problems(loads: dict[str, dict[str, list[dict]]],
                      kv_blocks: dict[str, list[int | None]]) -> list[str]:
    """Why no ratio of this run may be judged; empty when every check holds.

    loads: server -> phase -> the load summary of each repeat (loadgen.summarize), with
    the engine's own mean ITL of that repeat as server_itl_ms_mean where it was read.
    kv_blocks: server -> the KV block count each of its sessions really ran with."""
    problems = []
    for server, phases in loads.items():
        for phase, repeats in phases.items():
            for i, load in enumerate(repeats, 1):
                errors, short = load.get("errors") or 0, load.get("short_outputs") or 0
                if errors:
                    first = "; ".join(load.get("first_errors") or [])
                    problems.append(f"{server} {phase} repeat {i}: {errors} of {load.get('requests')} "
                                    f"requests failed" + (f" ({first[:200]})" if first else ""))
                if short:
                    problems.append(f"{server} {phase} repeat {i}: {short} outputs shorter or longer "
                                    f"than asked")
                client_itl, engine_itl = load.get("itl_ms_p50"), load.get("server_itl_ms_mean")
                if client_itl is not None and engine_itl and (
                        client_itl < HELD_BACK_ITL_SHARE * engine_itl):
                    problems.append(f"{server} {phase} repeat {i}: streams held back (client ITL "
                                    f"p50 {client_itl} ms against {engine_itl} ms between tokens "
                                    f"in the engine): tokens came in a burst, not as generated")
    seen = {}
    for server, counts in kv_blocks.items():
        if not counts:
            problems.append(f"{server}: KV block count not recorded")
        for i, count in enumerate(counts, 1):
            if count is None:
                problems.append(f"{server} session {i}: KV block count could not be read")
            else:
                seen[f"{server} session {i}"] = count
    if len(set(seen.values())) > 1:
        problems.append("KV blocks differ: " + ", ".join(f"{k} {v}" for k, v in seen.items()))
    return problems


def judge(per_repeat: Sequence[float | None], threshold: float, higher_is_better: bool) -> dict:
    """One target over the repeats: its median against the threshold, if the spread allows."""
    values = [v for v in per_repeat if v is not None]
    out = {"per_repeat": list(per_repeat), "threshold": threshold,
           "direction": ">=" if higher_is_better else "<=",
           "median": None, "spread": None, "margin": None}
    if not values or len(values) < len(per_repeat):
        return {**out, "verdict": NOT_MEASURED, "reason": "not measured in every repeat"}
    median = statistics.median(values)
    spread = max(values) - min(values)
    margin = abs(median - threshold)
    out.update(median=round(median, 4), spread=round(spread, 4), margin=round(margin, 4))
    if len(values) < 2:
        return {**out, "verdict": INCONCLUSIVE,
                "reason": f"1 repeat: no spread to set against the margin {margin:.3f}"}
    if spread >= margin:
        return {**out, "verdict": INCONCLUSIVE,
                "reason": f"spread {spread:.3f} over {len(values)} repeats >= margin {margin:.3f} "
                          f"to {threshold:g}"}
    ok = median >= threshold if higher_is_better else median <= threshold
    return {**out, "verdict": PASS if ok else FAIL,
            "reason": f"median {median:.3f} {'meets' if ok else 'misses'} {out['direction']} "
                      f"{threshold:g}; spread {spread:.3f} < margin {margin:.3f}"}


def ratio(ours, theirs):
    if ours is None or theirs in (None, 0):
        return None
    return round(ours / theirs, 4)


def per_repeat_ratios(ours: Sequence[dict], theirs: Sequence[dict], metric: str) -> list[float | None]:
    """spyre_serve / vLLM of one load metric, repeat by repeat (paired in ABBA order)."""
    if len(ours) != len(theirs):
        return [None] * max(len(ours), len(theirs))
    return [ratio(o.get(metric), t.get(metric)) for o, t in zip(ours, theirs)]


def session_figure(session: dict | None, *path: str):
    """One figure of a session, by its keys (e.g. "memory", "idle_pss_mib"); None if absent."""
    for key in path:
        session = (session or {}).get(key)
    return session


def per_session_ratios(ours: Sequence[dict], theirs: Sequence[dict], *path: str) -> list[float | None]:
    """spyre_serve / vLLM of one per-session figure (a start, the idle memory), paired by
    repeat as the load metrics are."""
    if len(ours) != len(theirs) or not ours:
        return [None] * max(len(ours), len(theirs), 1)
    return [ratio(session_figure(o, *path), session_figure(t, *path)) for o, t in zip(ours, theirs)]


def target_series(ours: dict, theirs: dict) -> dict[str, tuple[list, float, bool]]:
    """name -> (per-repeat values, threshold, higher is better), for every target.

    ours, theirs: a combined server result, its "phases" (each with "repeats" holding a
    "load") and its "sessions" (each with "cold_start", "memory", and ours "handshake_s")."""
    series = {}
    for phase in ours["phases"]:
        if phase not in theirs["phases"]:
            continue
        o = [r["load"] for r in ours["phases"][phase]["repeats"]]
        t = [r["load"] for r in theirs["phases"][phase]["repeats"]]
        if phase.startswith("concurrency"):
            series[f"{phase}: tokens/s >= {THROUGHPUT_FLOOR}x"] = (
                per_repeat_ratios(o, t, "output_tokens_per_s"), THROUGHPUT_FLOOR, True)
        series[f"{phase}: TTFT p50 <= {TTFT_P50_CEILING}x"] = (
            per_repeat_ratios(o, t, "ttft_ms_p50"), TTFT_P50_CEILING, False)
        series[f"{phase}: ITL p99 <= {ITL_P99_CEILING}x"] = (
            per_repeat_ratios(o, t, "itl_ms_p99"), ITL_P99_CEILING, False)
        series[f"{phase}: TPOT p50 <= {TPOT_P50_CEILING}x"] = (
            per_repeat_ratios(o, t, "tpot_ms_p50"), TPOT_P50_CEILING, False)
    ours_sessions, theirs_sessions = ours.get("sessions", []), theirs.get("sessions", [])
    series[f"cold start to first answer <= {COLD_START_CEILING}x"] = (
        per_session_ratios(ours_sessions, theirs_sessions, "cold_start", "process_to_first_answer_s"),
        COLD_START_CEILING, False)
    series[f"idle PSS <= {IDLE_PSS_CEILING}x"] = (
        per_session_ratios(ours_sessions, theirs_sessions, "memory", "idle_pss_mib"),
        IDLE_PSS_CEILING, False)
    handshakes = [s.get("handshake_s") for s in ours_sessions]
    series[f"coordinator handshake < {HANDSHAKE_CEILING_S} s"] = (
        handshakes or [None], HANDSHAKE_CEILING_S, False)
    return series


def judge_all(series: dict[str, tuple[list, float, bool]], problems: list[str]) -> dict[str, dict]:
    """Every target judged; all INVALID when the run itself is not valid."""
    verdicts = {}
    for name, (values, threshold, higher) in series.items():
        judged = judge(values, threshold, higher)
        if problems:
            judged.update(verdict=INVALID, reason="; ".join(problems))
        verdicts[name] = judged
    return verdicts


def overall(verdicts: Iterable[dict], problems: list[str]) -> dict:
    """INVALID if the run is; else FAIL if any target clearly fails; else INCONCLUSIVE if
    any could not be judged; else PASS."""
    if problems:
        return {"verdict": INVALID, "reasons": list(problems)}
    verdicts = list(verdicts)
    for level in (FAIL, INCONCLUSIVE, NOT_MEASURED):
        hit = [v["reason"] for v in verdicts if v["verdict"] == level]
        if hit:
            return {"verdict": INCONCLUSIVE if level == NOT_MEASURED else level, "reasons": hit}
    return {"verdict": PASS, "reasons": []}


def judge_model(result: dict) -> dict:
    """Validity, per-target verdicts and the overall verdict of one model's comparison.

    result["servers"][name]: "phases" (each with "repeats") and "sessions" (each with
    "settings"["kv_blocks"], "cold_start", "memory" and, for spyre_serve, "handshake_s")."""
    servers = {name: result["servers"][name] for name in ("spyre_serve", "vllm")}
    loads = {name: {phase: [{**r["load"], "server_itl_ms_mean":
                             r.get("scheduler", {}).get("server_itl_ms_mean")}
                            for r in measured["repeats"]]
                    for phase, measured in server["phases"].items()}
             for name, server in servers.items()}
    blocks = {name: [s.get("settings", {}).get("kv_blocks") for s in server.get("sessions", [])]
              for name, server in servers.items()}
    problems = validity_problems(loads, blocks)
    verdicts = judge_all(target_series(servers["spyre_serve"], servers["vllm"]), problems)
    return {"validity": {"valid": not problems, "problems": problems},
            "targets": verdicts, "verdict": overall(verdicts.values(), problems)}
