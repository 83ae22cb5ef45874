"""README's `bench/serve_floor.py`: Ray and Serve alone, started as spyre-serve starts them,
measured for memory, start and streaming, and set beside a comparison run's plain vLLM."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import serve_floor  # noqa: E402


def test_floors_are_set_beside_plain_vllms_medians():
    sessions = [{"memory": {"idle_pss_mib": pss}, "cold_start": {"process_to_first_answer_s": s}}
                for pss, s in ((2000.0, 40.0), (2100.0, 35.0), (1900.0, 60.0))]
    compare = {"models": {"tiny": {"servers": {"vllm": {
        "sessions": sessions,
        "phases": {"concurrency_1": {"load": {"output_tokens_per_s": 500.0,
                                              "ttft_ms_p50": 16.0}}}}}}}}
    summary = {"idle_pss_mib": 900.0, "process_to_first_answer_s": 20.0,
               "tokens_per_s": {"concurrency_1": 1000.0, "concurrency_4": 2500.0},
               "ttft_ms_p50": {"concurrency_1": 4.0, "concurrency_4": 9.0}, "errors": 0}
    rows = serve_floor.against(summary, compare)["tiny"]
    assert rows["idle_pss"]["floor_over_vllm"] == 0.45
    assert rows["cold_start"]["floor_over_vllm"] == 0.5
    assert rows["concurrency_1"] == {"serve_floor_tokens_per_s": 1000.0, "vllm_tokens_per_s": 500.0,
                                     "floor_over_vllm": 2.0, "serve_floor_ttft_ms_p50": 4.0,
                                     "vllm_ttft_ms_p50": 16.0, "lowest_ttft_ratio": 1.25}
    assert "concurrency_4" not in rows  # vLLM did not run that phase


@pytest.mark.slow
def test_serve_floor_measures_ray_and_serve_without_a_model(tmp_path):
    out = tmp_path / "floor.json"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own Ray head
    run = subprocess.run([sys.executable, "bench/serve_floor.py", "--repeats", "1", "--scale", "1",
                          "--concurrency", "1", "4", "--out", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    document = json.loads(out.read_text())
    (session,) = document["sessions"]
    assert document["summary"]["errors"] == 0
    assert document["summary"]["ttft_ms_p50"]["concurrency_1"] > 0
    for phase in ("concurrency_1", "concurrency_4"):
        load = session["phases"][phase]["load"]
        assert load["output_tokens_per_s"] > 0 and load["short_outputs"] == 0
        # every token came through Serve's proxy, which spent CPU on it
        assert session["phases"][phase]["cpu_ms_per_token"].get("ray::ProxyActor", 0) > 0
    names = {p["name"] for p in session["idle_memory"]["by_process"]}
    assert {"gcs_server", "raylet", "ray::ProxyActor"} <= names
    assert any(n.startswith("ray::ServeController") for n in names)
    assert not any("EngineCore" in n or "CardActor" in n for n in names)  # no model ran
    assert session["idle_memory"]["pss_mib"] > 0
    assert 0 < session["cold_start"]["process_to_ready_s"] <= session["cold_start"]["process_to_first_answer_s"]
    assert session["teardown"]["still_running"] == []
    assert "NoModel" in Path(session["log"]).read_text()  # the session's output is kept
