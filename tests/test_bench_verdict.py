"""bench/verdict.py: what a comparison run may conclude. Engine-free: synthetic results only."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import metrics  # noqa: E402
import startup  # noqa: E402
import verdict  # noqa: E402


def load(tokens_per_s=100.0, ttft=50.0, errors=0, short=0, itl_p99=80.0, tpot=10.0):
    return {"requests": 16, "errors": errors, "short_outputs": short,
            "first_errors": ["HTTP 500: b'boom'"] if errors else [],
            "output_tokens_per_s": tokens_per_s, "ttft_ms_p50": ttft, "tpot_ms_p50": tpot,
            "itl_ms_p99": itl_p99}


def server(loads_by_phase: dict, blocks, handshakes=None, starts=None, idle_pss=None):
    """A combined server result as runs.bench_model builds it: one session per repeat."""
    repeats = len(next(iter(loads_by_phase.values())))
    handshakes = handshakes or [0.2] * repeats
    starts = starts or [30.0] * repeats
    idle_pss = idle_pss or [1000.0] * repeats
    return {"phases": {phase: {"repeats": [{"load": ld} for ld in loads]}
                       for phase, loads in loads_by_phase.items()},
            "sessions": [{"settings": {"kv_blocks": blocks}, "handshake_s": h,
                          "cold_start": {"process_to_first_answer_s": s},
                          "memory": {"idle_pss_mib": m}}
                         for h, s, m in zip(handshakes, starts, idle_pss)]}


def model_result(ours: dict, theirs: dict) -> dict:
    return {"servers": {"spyre_serve": ours, "vllm": theirs}}


PHASE = "concurrency_4"


def clean_pair(ours_tps, theirs_tps, ttft_ours=(50, 50, 50), ttft_theirs=(50, 50, 50)):
    ours = server({PHASE: [load(t, f) for t, f in zip(ours_tps, ttft_ours)]}, blocks=64)
    theirs = server({PHASE: [load(t, f) for t, f in zip(theirs_tps, ttft_theirs)]}, blocks=64)
    return model_result(ours, theirs)


def test_abba_order_alternates_which_server_goes_first():
    assert verdict.abba_order(["spyre_serve", "vllm"], 4) == [
        (0, "spyre_serve"), (0, "vllm"), (1, "vllm"), (1, "spyre_serve"),
        (2, "spyre_serve"), (2, "vllm"), (3, "vllm"), (3, "spyre_serve")]
    assert verdict.abba_order(["spyre_serve"], 2) == [(0, "spyre_serve"), (1, "spyre_serve")]
    assert verdict.abba_order(["a", "b"], 0) == []


def test_clean_good_run_passes():
    judged = verdict.judge_model(clean_pair([100, 101, 99], [100, 100, 100]))
    assert judged["validity"] == {"valid": True, "problems": []}
    tps = judged["targets"][f"{PHASE}: tokens/s >= {verdict.THROUGHPUT_FLOOR}x"]
    assert tps["verdict"] == "PASS"
    assert tps["per_repeat"] == [1.0, 1.01, 0.99] and tps["median"] == 1.0
    assert tps["spread"] == pytest.approx(0.02) and tps["margin"] == pytest.approx(0.05)
    assert judged["verdict"]["verdict"] == "PASS"


def test_clean_bad_run_fails():
    judged = verdict.judge_model(clean_pair([70, 71, 69], [100, 100, 100]))
    tps = judged["targets"][f"{PHASE}: tokens/s >= {verdict.THROUGHPUT_FLOOR}x"]
    assert tps["verdict"] == "FAIL"
    assert judged["verdict"]["verdict"] == "FAIL"


def test_slow_ttft_fails_even_when_throughput_passes():
    judged = verdict.judge_model(clean_pair([100] * 3, [100] * 3, ttft_ours=(80, 81, 79)))
    assert judged["targets"][f"{PHASE}: TTFT p50 <= {verdict.TTFT_P50_CEILING}x"]["verdict"] == "FAIL"
    assert judged["verdict"]["verdict"] == "FAIL"


@pytest.mark.parametrize("who", ["spyre_serve", "vllm"])
def test_errors_on_either_server_make_the_run_invalid(who):
    # The erroring server looks fast: its failed requests left the token count.
    result = clean_pair([150, 150, 150], [100, 100, 100])
    result["servers"][who]["phases"][PHASE]["repeats"][1]["load"]["errors"] = 3
    result["servers"][who]["phases"][PHASE]["repeats"][1]["load"]["first_errors"] = ["HTTP 500"]
    judged = verdict.judge_model(result)
    assert not judged["validity"]["valid"]
    assert judged["verdict"]["verdict"] == "INVALID"
    assert all(v["verdict"] == "INVALID" for v in judged["targets"].values())
    (problem,) = judged["validity"]["problems"]
    assert who in problem and "repeat 2" in problem and "3 of 16" in problem and "HTTP 500" in problem


def test_short_outputs_make_the_run_invalid():
    result = clean_pair([100] * 3, [100] * 3)
    result["servers"]["vllm"]["phases"][PHASE]["repeats"][0]["load"]["short_outputs"] = 1
    judged = verdict.judge_model(result)
    assert judged["verdict"]["verdict"] == "INVALID"
    assert "short" in judged["verdict"]["reasons"][0]


def test_a_stream_held_back_makes_the_run_invalid():
    result = clean_pair([100] * 3, [100] * 3)
    repeats = result["servers"]["vllm"]["phases"][PHASE]["repeats"]
    for repeat, client_itl in zip(repeats, (2.0, 0.0, 1.9)):
        repeat["load"]["itl_ms_p50"] = client_itl
        repeat["scheduler"] = {"server_itl_ms_mean": 1.8}
    judged = verdict.judge_model(result)
    assert judged["verdict"]["verdict"] == "INVALID"
    (problem,) = judged["validity"]["problems"]  # repeats 1 and 3 streamed as generated
    assert "vllm" in problem and "repeat 2" in problem and "held back" in problem


def test_unequal_kv_blocks_make_the_run_invalid():
    result = clean_pair([100] * 3, [100] * 3)
    result["servers"]["vllm"]["sessions"][2]["settings"]["kv_blocks"] = 65
    judged = verdict.judge_model(result)
    assert judged["verdict"]["verdict"] == "INVALID"
    assert any("KV blocks differ" in p and "vllm session 3 65" in p
               for p in judged["validity"]["problems"])


def test_unknown_kv_blocks_make_the_run_invalid():
    result = clean_pair([100] * 3, [100] * 3)
    result["servers"]["spyre_serve"]["sessions"][0]["settings"]["kv_blocks"] = None
    judged = verdict.judge_model(result)
    assert judged["verdict"]["verdict"] == "INVALID"
    assert "could not be read" in judged["validity"]["problems"][0]


def test_spread_larger_than_margin_is_inconclusive():
    # median 0.97 clears 0.95 by 0.02, but the repeats range over 0.20
    judged = verdict.judge_model(clean_pair([97, 87, 107], [100, 100, 100]))
    tps = judged["targets"][f"{PHASE}: tokens/s >= {verdict.THROUGHPUT_FLOOR}x"]
    assert tps["verdict"] == "INCONCLUSIVE"
    assert tps["spread"] == pytest.approx(0.2) and tps["margin"] == pytest.approx(0.02)
    assert "spread 0.200" in tps["reason"] and "margin 0.020" in tps["reason"]
    assert judged["verdict"]["verdict"] == "INCONCLUSIVE"


def test_a_clear_fail_outweighs_an_inconclusive_target():
    judged = verdict.judge_model(clean_pair([97, 87, 107], [100] * 3, ttft_ours=(90, 91, 89)))
    assert judged["verdict"]["verdict"] == "FAIL"


def test_one_repeat_gives_no_verdict():
    judged = verdict.judge(per_repeat=[1.5], threshold=0.95, higher_is_better=True)
    assert judged["verdict"] == "INCONCLUSIVE" and "1 repeat" in judged["reason"]


def test_ratio_exactly_at_threshold_is_inconclusive():
    assert verdict.judge([0.95, 0.95], 0.95, True)["verdict"] == "INCONCLUSIVE"


def test_stalls_slow_tokens_slow_starts_and_memory_each_fail_their_own_target():
    ours = server({PHASE: [load(itl_p99=130.0, tpot=12.0) for _ in range(3)]}, blocks=64,
                  starts=[45.0, 44.0, 46.0], idle_pss=[1500.0, 1490.0, 1510.0])
    theirs = server({PHASE: [load() for _ in range(3)]}, blocks=64)
    targets = verdict.judge_model(model_result(ours, theirs))["targets"]
    itl = targets[f"{PHASE}: ITL p99 <= {verdict.ITL_P99_CEILING}x"]
    assert itl["verdict"] == "FAIL" and itl["median"] == pytest.approx(1.625)
    assert targets[f"{PHASE}: TPOT p50 <= {verdict.TPOT_P50_CEILING}x"]["verdict"] == "FAIL"
    start = targets[f"cold start to first answer <= {verdict.COLD_START_CEILING}x"]
    assert start["verdict"] == "FAIL" and start["per_repeat"] == [
        pytest.approx(1.5), pytest.approx(44 / 30, abs=1e-4), pytest.approx(46 / 30, abs=1e-4)]
    pss = targets[f"idle PSS <= {verdict.IDLE_PSS_CEILING}x"]
    assert pss["verdict"] == "FAIL" and pss["median"] == pytest.approx(1.5)
    # ... and the throughput target, met, still passes beside them
    assert targets[f"{PHASE}: tokens/s >= {verdict.THROUGHPUT_FLOOR}x"]["verdict"] == "PASS"


def test_a_session_without_a_start_or_memory_figure_leaves_those_targets_unmeasured():
    result = clean_pair([100] * 3, [100] * 3)
    del result["servers"]["vllm"]["sessions"][2]["memory"]
    result["servers"]["spyre_serve"]["sessions"][0]["cold_start"] = None
    targets = verdict.judge_model(result)["targets"]
    assert targets[f"idle PSS <= {verdict.IDLE_PSS_CEILING}x"]["verdict"] == "n/a"
    assert targets[f"cold start to first answer <= {verdict.COLD_START_CEILING}x"]["verdict"] == "n/a"
    assert targets[f"{PHASE}: tokens/s >= {verdict.THROUGHPUT_FLOOR}x"]["verdict"] == "PASS"


def test_missing_handshake_is_not_measured():
    result = clean_pair([100] * 3, [100] * 3)
    result["servers"]["spyre_serve"]["sessions"][1]["handshake_s"] = None
    judged = verdict.judge_model(result)
    assert judged["targets"][f"coordinator handshake < {verdict.HANDSHAKE_CEILING_S} s"]["verdict"] == "n/a"
    assert judged["verdict"]["verdict"] == "INCONCLUSIVE"


def test_repeats_combined_sum_errors_and_short_outputs():
    def measured(errors, short):
        return {"concurrency": 4, "rate": None, "client_cores_busy": 0.5,
                "background_cores_busy": 0.1, "loadavg_1m_after": 1.0,
                "load": load(errors=errors, short=short),
                "scheduler": {"peak_running": 4, "peak_waiting": 0, "peak_kv_usage_perc": 10,
                              "preemptions": 0, "server_ttft_ms_mean": 1.0,
                              "server_itl_ms_mean": 1.0}}
    combined = metrics.combine_repeats([measured(0, 0), measured(0, 2), measured(1, 0)])
    # a median would report 0 of each
    assert combined["load"]["errors"] == 1 and combined["load"]["short_outputs"] == 2
    assert len(combined["repeats"]) == 3


def test_kv_blocks_prefer_metrics_then_status_then_log():
    facts = {"kv_cache_tokens": "4,096"}
    assert metrics.kv_blocks_of({"num_gpu_blocks": "64"}, {"num_blocks": 63}, facts, 64)["kv_blocks"] == 64
    assert metrics.kv_blocks_of({}, {"num_blocks": 63}, facts, 64)["kv_blocks"] == 63
    assert metrics.kv_blocks_of({}, None, facts, 64)["kv_blocks"] == 64
    assert metrics.kv_blocks_of({}, None, {"kv_cache_tokens": None}, 64)["kv_blocks"] is None


def test_cache_config_info_and_engine_facts():
    text = ('# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n'
            'vllm:cache_config_info{block_size="64",cache_dtype="auto",engine="0",'
            'num_gpu_blocks="64"} 1.0\n')
    assert metrics.cache_config_info(text)["num_gpu_blocks"] == "64"
    assert metrics.cache_config_info("vllm:num_requests_running 0.0\n") == {}
    lines = [(0.0, "Initializing a V1 LLM engine with config: model='m', trust_remote_code=False, "
                   "dtype=torch.float32, max_seq_len=512, kv_cache_dtype=auto"),
             (0.0, "non-default args: {'async_scheduling': False}"),
             (0.0, "CPU KV cache size: 4,096 tokens")]
    facts = metrics.engine_facts(lines)
    assert facts["dtype"] == "torch.float32"
    assert facts["async_scheduling"] == "False"
    assert facts["kv_cache_tokens"] == "4,096"


def test_start_steps_never_negative():
    milestones = {"a": 10.0, "b": 12.5, "c": 12.0}
    steps = startup.breakdown(milestones, [("a->b", "a", "b"), ("b->c", "b", "c"), ("c->x", "c", "x")])
    assert [s["seconds"] for s in steps] == [2.5, None, None]
    assert steps[1]["raw_seconds"] == -0.5 and "different clocks" in steps[1]["note"]
    assert startup.handshake_seconds({"reports_written": 5.0, "resized": 4.0}) is None
    assert startup.handshake_seconds({"reports_written": 5.0, "resized": 5.25}) == 0.25


def fake_session(kind, repeat, tokens_per_s, blocks=64):
    phase = {"concurrency": 4, "rate": None, "client_cores_busy": 0.5,
             "background_cores_busy": 0.1, "loadavg_1m_after": 1.0,
             "load": {**load(tokens_per_s), "requests_per_s": 1.0, "ttft_ms_p99": 60.0,
                      "itl_ms_p50": 5.0, "itl_ms_p99": 9.0, "tokens_per_chunk": 1.0},
             "scheduler": {"peak_running": 4, "peak_waiting": 0, "peak_kv_usage_perc": 10,
                           "preemptions": 0, "server_ttft_ms_mean": 1.0, "server_itl_ms_mean": 1.0}}
    memory = {"pss_mib": 100.0, "processes": 3}
    session = {"repeat": repeat, "cold_start": {"process_to_ready_s": 10.0, "process_to_first_answer_s": 11.0},
               "phases": {PHASE: phase},
               "settings": {"kv_blocks": blocks, "block_size": 64, "dtype": "torch.float32",
                            "async_scheduling": None,
                            "threads": {"processes": [{"pid": 1, "name": "EngineCore", "threads": 9,
                                                       "omp_num_threads_at_start": None}],
                                        "card_actor_torch_threads": None}},
               "memory": {"idle": memory, "after_load": memory, "peak_rss_mib": 200.0},
               "start_breakdown": [{"step": "x", "seconds": None, "raw_seconds": -0.5, "note": "clocks"}]}
    if kind == "spyre_serve":
        session.update(handshake_s=0.2, status={"num_blocks": blocks})
    return session


def test_sessions_combine_into_a_judged_table():
    import report
    servers = {kind: metrics.combine_sessions([fake_session(kind, r, tps) for r, tps in enumerate(values)])
               for kind, values in (("spyre_serve", [100, 101, 99]), ("vllm", [100, 100, 100]))}
    assert [s["settings"]["kv_blocks"] for s in servers["vllm"]["sessions"]] == [64, 64, 64]
    assert servers["spyre_serve"]["phases"][PHASE]["load"]["output_tokens_per_s"] == 100
    config = {"summary": "s", "max_num_seqs": 16, "max_model_len": 512, "block_size": 64,
              "prompt_len": 128, "output_len": 64, "run_order": ["spyre_serve#1", "vllm#1"]}
    result = {"config": config, "servers": servers,
              "ratios": report.phase_ratios(servers["spyre_serve"]["phases"], servers["vllm"]["phases"]),
              "kv_usefulness": metrics.kv_usefulness(config, 64, servers["spyre_serve"], servers["vllm"])}
    result.update(verdict.judge_model(result))
    assert result["verdict"]["verdict"] == "PASS"
    text = report.table("tiny", result)
    assert "verdict: PASS" in text and "short_outputs" in text and "EngineCore 9 threads" in text


def test_async_scheduling_is_what_the_ranks_report_before_what_the_cpu_platform_forces():
    # spyre_serve's platform keeps vLLM's choice where the CPU platform turns it off: the
    # bench showed "False" for a server whose ranks all ran with it on.
    import runs
    status = {"ranks": [{"rank": 0, "async_scheduling": True},
                        {"rank": 1, "async_scheduling": True}]}
    assert runs.async_scheduling_of({}, status) == {
        "async_scheduling": True, "async_scheduling_source": "/spyre/status"}
    mixed = {"ranks": [{"async_scheduling": True}, {"async_scheduling": False}]}
    assert runs.async_scheduling_of({}, mixed)["async_scheduling"] is False
    logged = runs.async_scheduling_of({"async_scheduling": "False"}, {"ranks": [{}]})
    assert logged == {"async_scheduling": False, "async_scheduling_source": "server log"}
