"""Ratios, the printed table (verdicts included) and the plot of one benchmark run.

What a run may conclude is decided in bench/verdict.py; this module only shows it.
"""
from __future__ import annotations

import statistics
from pathlib import Path

from verdict import session_figure

LOAD_METRICS = ["output_tokens_per_s", "requests_per_s", "ttft_ms_p50", "ttft_ms_p99",
                "itl_ms_p50", "itl_ms_p99", "tpot_ms_p50", "tokens_per_chunk"]


def ratio(ours, theirs):
    if ours is None or theirs in (None, 0):
        return None
    return round(ours / theirs, 3)


def phase_ratios(ours: dict, theirs: dict) -> dict:
    return {name: {m: ratio(ours[name]["load"].get(m), theirs[name]["load"].get(m))
                   for m in LOAD_METRICS}
            for name in ours if name in theirs}


def session_median(server: dict, *path: str):
    """The median over a server's sessions of one per-session figure (a start, a memory
    sum); the first session's alone when the result has no per-session list."""
    values = [session_figure(session, *path) for session in server.get("sessions") or [server]]
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _fmt(value, width=10):
    if value is None:
        return f"{'-':>{width}}"
    if isinstance(value, float):
        return f"{value:>{width}.2f}" if abs(value) < 1e5 else f"{value:>{width}.3g}"
    return f"{value!s:>{width}}"


def table(model: str, result: dict) -> str:
    ours, theirs = result["servers"]["spyre_serve"], result["servers"]["vllm"]
    out = [f"\n== {model}: spyre_serve vs plain vLLM ({result['config']['summary']}) =="]
    head = f"{'phase':<22}{'metric':<22}{'spyre_serve':>12}{'vllm':>12}{'ratio':>10}"
    out += [head, "-" * len(head)]
    for phase, r in result["ratios"].items():
        for m in LOAD_METRICS:
            out.append(f"{phase:<22}{m:<22}{_fmt(ours['phases'][phase]['load'][m], 12)}"
                       f"{_fmt(theirs['phases'][phase]['load'][m], 12)}{_fmt(r[m])}")
        for m in ("errors", "short_outputs"):  # summed over repeats; not 0: INVALID
            out.append(f"{phase:<22}{m:<22}{_fmt(ours['phases'][phase]['load'].get(m), 12)}"
                       f"{_fmt(theirs['phases'][phase]['load'].get(m), 12)}")
        spread_o = ours["phases"][phase].get("load_range_over_repeats", {}).get("output_tokens_per_s")
        spread_t = theirs["phases"][phase].get("load_range_over_repeats", {}).get("output_tokens_per_s")
        if spread_o and spread_t and len(ours["phases"][phase].get("repeats", [])) > 1:
            out.append(f"{phase:<22}{'tokens/s min..max':<22}{_span(spread_o):>12}{_span(spread_t):>12}")
        kv_o, kv_t = ours["phases"][phase]["scheduler"], theirs["phases"][phase]["scheduler"]
        out.append(f"{phase:<22}{'peak running / preempt':<22}"
                   f"{_fmt(_running_and_preempted(kv_o), 12)}{_fmt(_running_and_preempted(kv_t), 12)}")
        out.append(f"{phase:<22}{'server-side TTFT ms':<22}"
                   f"{_fmt(kv_o['server_ttft_ms_mean'], 12)}{_fmt(kv_t['server_ttft_ms_mean'], 12)}"
                   f"{_fmt(ratio(kv_o['server_ttft_ms_mean'], kv_t['server_ttft_ms_mean']))}")
        out.append(f"{phase:<22}{'server-side ITL ms':<22}"
                   f"{_fmt(kv_o['server_itl_ms_mean'], 12)}{_fmt(kv_t['server_itl_ms_mean'], 12)}"
                   f"{_fmt(ratio(kv_o['server_itl_ms_mean'], kv_t['server_itl_ms_mean']))}")
        out.append(f"{phase:<22}{'client cores busy':<22}"
                   f"{_fmt(ours['phases'][phase]['client_cores_busy'], 12)}"
                   f"{_fmt(theirs['phases'][phase]['client_cores_busy'], 12)}")
        out.append(f"{phase:<22}{'background cores busy':<22}"
                   f"{_fmt(ours['phases'][phase]['background_cores_busy'], 12)}"
                   f"{_fmt(theirs['phases'][phase]['background_cores_busy'], 12)}")
    out.append("-" * len(head))
    # Starts and memory: medians over the sessions, as the verdict's targets judge them.
    rows = [("cold start", "start -> /v1/models", ("cold_start", "process_to_ready_s")),
            ("cold start", "start -> first answer", ("cold_start", "process_to_first_answer_s")),
            ("memory", "PSS MiB idle", ("memory", "idle_pss_mib")),
            ("memory", "PSS MiB after load", ("memory", "after_load_pss_mib")),
            ("memory", "peak RSS sum MiB", ("memory", "peak_rss_mib"))]
    for group, label, path in rows:
        o, t = session_median(ours, *path), session_median(theirs, *path)
        out.append(f"{group:<22}{label:<22}{_fmt(o, 12)}{_fmt(t, 12)}{_fmt(ratio(o, t))}")
    o, t = ours["memory"]["idle"]["processes"], theirs["memory"]["idle"]["processes"]
    out.append(f"{'memory':<22}{'processes':<22}{_fmt(o, 12)}{_fmt(t, 12)}")
    out += _settings_lines(ours, theirs)
    out.append("\nspyre_serve start, step by step (s), first session:")
    for step in ours["start_breakdown"]:
        out.append(f"  {step['step']:<54}{_fmt(step['seconds'], 8)}{_note(step)}")
    out.append(f"  {'coordinator handshake (report -> resized)':<54}{_fmt(ours['handshake_s'], 8)}")
    out.append("plain vLLM start, step by step (s), first session:")
    for step in theirs["start_breakdown"]:
        out.append(f"  {step['step']:<54}{_fmt(step['seconds'], 8)}{_note(step)}")
    kv = result["kv_usefulness"]
    out.append(f"\nKV usefulness, {kv['block_budget']} blocks of 64 tokens on each server:")
    out.append(f"  vllm-spyre static sizing: {kv['static_blocks_per_seq']} blocks reserved per "
               f"sequence -> at most {kv['static_max_concurrent_seqs']} sequences "
               f"(it needs {kv['static_blocks_needed_for_max_num_seqs']} blocks for "
               f"max_num_seqs={result['config']['max_num_seqs']})")
    out.append(f"  dynamic (vLLM's paged scheduler): {kv['dynamic_blocks_per_seq']} blocks per "
               f"sequence of this load; peak running spyre_serve {_int(kv['peak_running']['spyre_serve'])}, "
               f"vllm {_int(kv['peak_running']['vllm'])}; preemptions spyre_serve "
               f"{_int(kv['preemptions']['spyre_serve'])}, vllm {_int(kv['preemptions']['vllm'])}")
    out += decode_floor_lines(result.get("decode_vs_bandwidth"))
    for name, variant in result["servers"].items():
        if name in ("spyre_serve", "vllm"):
            continue
        out.append(f"\nreference {name} (plain vLLM again, after the comparison; not judged): "
                   f"tokens/s, TTFT p50 ms, TPOT p50 ms; spyre_serve / {name} tokens/s")
        for phase, measured in variant["phases"].items():
            load = measured["load"]
            out.append(f"  {phase:<20}{_fmt(load['output_tokens_per_s'])}{_fmt(load['ttft_ms_p50'])}"
                       f"{_fmt(load['tpot_ms_p50'])}"
                       f"{_fmt(ratio(ours['phases'][phase]['load']['output_tokens_per_s'], load['output_tokens_per_s']))}")
    out += verdict_lines(result)
    return "\n".join(out)


def decode_floor_lines(floor: dict | None) -> list[str]:
    """Each server's decode step at batch 1 against weights bytes / memory bandwidth."""
    if not floor:
        return []
    bw, ms = floor["bandwidth"], floor["floor_ms"]
    out = [f"\ndecode step at batch 1 against the memory-bandwidth floor ({floor['weights_mib']} "
           f"MiB of weights read per step; bandwidth {bw['one_thread_gb_s']} GB/s on one thread, "
           f"{bw['all_cores_gb_s']} GB/s on {bw['cores']} cores -> floor {ms['one_thread']} / "
           f"{ms['all_cores']} ms):"]
    for name, s in floor["servers"].items():
        x = s["x_floor"] or {}
        out.append(f"  {name:<14}{_fmt(s['decode_step_ms'])} ms = {_fmt(x.get('one_thread'), 6)}x "
                   f"the one-thread floor, {_fmt(x.get('all_cores'), 6)}x the all-cores floor")
    return out


def verdict_lines(result: dict) -> list[str]:
    """Each target's verdict with the figures behind it, then the run's."""
    out = [f"\ntargets (median of per-repeat ratios; order {' '.join(result['config'].get('run_order', []))}):"]
    for name, v in result["targets"].items():
        figures = ""
        if v.get("median") is not None:
            figures = (f"median {v['median']:.3f}, per repeat "
                       f"{' '.join('-' if x is None else f'{x:.3f}' for x in v['per_repeat'])}, "
                       f"spread {v['spread']:.3f}, margin {v['margin']:.3f}")
        out.append(f"  {v['verdict']:<13}{name}: {figures}")
        if v["verdict"] not in ("PASS", "FAIL", "INVALID"):
            out.append(f"  {'':<13}{v['reason']}")
    overall = result["verdict"]
    out.append(f"verdict: {overall['verdict']}")
    out += [f"  {reason}" for reason in overall["reasons"][:10]]
    if len(overall["reasons"]) > 10:
        out.append(f"  ... {len(overall['reasons']) - 10} more in the JSON")
    return out


def _settings_lines(ours: dict, theirs: dict) -> list[str]:
    """What each server really ran with (first session; every session is in the JSON)."""
    def settings(server):
        return (server.get("sessions") or [{}])[0].get("settings") or {}

    so, st = settings(ours), settings(theirs)
    out = ["\nsettings each server ran with (first session):",
           f"  {'':<40}{'spyre_serve':>14}{'vllm':>14}"]
    for key in ("kv_blocks", "block_size", "dtype", "kv_cache_dtype", "async_scheduling"):
        out.append(f"  {key:<40}{_fmt(so.get(key), 14)}{_fmt(st.get(key), 14)}")
    for label, s in (("spyre_serve", so), ("vllm", st)):
        threads = s.get("threads") or {}
        described = ", ".join(f"{p['name'][:28]} {p['threads']} threads (OMP_NUM_THREADS at start "
                              f"{p['omp_num_threads_at_start'] or 'unset'})"
                              for p in threads.get("processes", []))
        out.append(f"  {label} threads: {described or '-'}")
        if threads.get("card_actor_torch_threads") is not None:
            out.append(f"  {label} card actor torch threads: {threads['card_actor_torch_threads']}")
    return out


def _note(step: dict) -> str:
    return f"  ({step['note']})" if step.get("note") else ""


def _span(values) -> str:
    return f"{values[0]:.0f}..{values[1]:.0f}"


def _running_and_preempted(scheduler: dict) -> str:
    return f"{_int(scheduler['peak_running'])}/{_int(scheduler['preemptions'])}"


def _int(v):
    return "-" if v is None else int(v)


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(results)
    fig, axes = plt.subplots(len(models), 2, figsize=(11, 4 * len(models)), squeeze=False)
    for row, model in enumerate(models):
        for col, (metric, label) in enumerate((("output_tokens_per_s", "output tokens/s"),
                                               ("ttft_ms_p50", "TTFT p50 (ms)"))):
            ax = axes[row][col]
            styles = iter(["o-", "s--", "^:", "d-."])
            for server, measured in results[model]["servers"].items():
                style = next(styles)
                phases = measured["phases"]
                points = sorted((p["concurrency"], p["load"][metric])
                                for p in phases.values() if p.get("concurrency"))
                ax.plot([c for c, _ in points], [v for _, v in points], style, label=server)
            ax.set_xscale("log", base=2)
            ax.set_xticks([c for c in results[model]["config"]["concurrency"]])
            ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.set_xlabel("concurrent requests (closed loop)")
            ax.set_ylabel(label)
            ax.set_title(f"{model}: {label}")
            ax.grid(True, alpha=0.3)
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
