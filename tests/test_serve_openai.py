"""The Serve app end to end: real Ray Serve, vLLM engine, HTTP on 127.0.0.1, openai client.

One app for the whole module (engine start is the slow part): a 2-card replica whose
simulated cards have different budgets, so the handshake has a limiting rank to show.
"""
import os
import time

import httpx
import openai
import pytest

from support import MiB, metric

pytestmark = pytest.mark.slow
MODEL = "tiny-test"
MAX_MODEL_LEN = 256
BUDGETS = [256 * MiB, 160 * MiB]


@pytest.fixture(scope="module")
def server(serve_instance, tiny_model):
    from ray import serve

    from deployments.openai_app import build_app
    from spyre_serve.serve.app_args import AppArgs

    port = serve_instance.ensure()
    args = AppArgs(model=tiny_model, served_model_name=MODEL, tensor_parallel_size=2,
                   spyre={"card_memory_bytes": BUDGETS}, max_model_len=MAX_MODEL_LEN, max_num_seqs=4,
                   replica_num_cpus=0.5)
    started = time.monotonic()
    serve.run(build_app(args), name="openai-test", route_prefix="/")
    print(f"serve.run -> ready: {time.monotonic() - started:.1f} s")
    yield f"http://127.0.0.1:{port}"
    if serve_instance.alive():
        serve.delete("openai-test")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", timeout=300, max_retries=0)


def test_the_proxy_runs_with_serves_grpc_transport_on(server, ray_cluster):
    # spyre-serve's Ray nodes (and this suite's) run Serve's proxy with
    # RAY_SERVE_PROXY_USE_GRPC=1 (cli.SERVE_NODE_ENV), which Serve reads when the proxy
    # starts: the streams of this module go over gRPC. This checks the setting reached it.
    import psutil
    from ray._private.state import actors  # the proxy's pid; no dashboard in the suite
    proxies = [a for a in actors().values()
               if a["ActorClassName"] == "ProxyActor" and a["State"] == "ALIVE"]
    assert proxies
    for proxy in proxies:
        assert psutil.Process(proxy["Pid"]).environ().get("RAY_SERVE_PROXY_USE_GRPC") == "1"


def test_models_lists_the_served_name(client):
    (model,) = client.models.list().data
    assert model.id == MODEL


def test_completion(client):
    result = client.completions.create(model=MODEL, prompt="the quick brown", max_tokens=3,
                                       extra_body={"ignore_eos": True})
    assert result.usage.completion_tokens == 3
    assert isinstance(result.choices[0].text, str)
    assert result.choices[0].finish_reason == "length"


def test_chat_completion(client):
    result = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=3,
        extra_body={"ignore_eos": True})
    assert result.choices[0].message.role == "assistant"
    assert isinstance(result.choices[0].message.content, str)
    assert result.usage.completion_tokens == 3


def test_chat_streams_each_token_as_its_own_event(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
        logprobs=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    usage, tokens_per_event = None, []
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        # Logprobs name each token an event carries, even one that decodes to no text.
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            tokens_per_event.append(len(chunk.choices[0].logprobs.content))
    assert usage.completion_tokens == 4
    # With no batching interval every generated token is its own SSE event.
    assert tokens_per_event == [1, 1, 1, 1]


def test_completion_streams(client):
    tokens_per_event = [len(c.choices[0].logprobs.tokens) for c in client.completions.create(
        model=MODEL, prompt="the lazy dog", max_tokens=3, stream=True, logprobs=1,
        extra_body={"ignore_eos": True}) if c.choices and c.choices[0].logprobs]
    assert tokens_per_event == [1, 1, 1]


def _assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert error["code"] == status and error["message"]
    return error


@pytest.mark.parametrize("body, status, says", [
    ({"model": "no-such-model", "prompt": "hi", "max_tokens": 2}, 404, "no-such-model"),
    ({"model": MODEL, "prompt": "the quick brown fox " * 120, "max_tokens": 2}, 400,
     str(MAX_MODEL_LEN)),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
    ({"model": MODEL}, 400, "prompt"),
])
def test_bad_completion_requests_get_openai_errors(server, body, status, says):
    error = _assert_openai_error(httpx.post(f"{server}/v1/completions", json=body, timeout=60),
                                 status)
    assert says in error["message"] or says in str(error["param"])


def test_malformed_json_gets_an_openai_error(server):
    for path in ("/v1/completions", "/v1/chat/completions"):
        response = httpx.post(f"{server}{path}", content=b'{"model": ',
                              headers={"content-type": "application/json"}, timeout=60)
        _assert_openai_error(response, 400)


def test_bad_chat_request_gets_an_openai_error(server):
    response = httpx.post(f"{server}/v1/chat/completions", timeout=60,
                          json={"model": MODEL, "messages": "not a list"})
    _assert_openai_error(response, 400)


def test_server_stays_healthy_after_bad_requests(server, client):
    # Runs after the bad-request tests (file order): the replica took them all.
    assert httpx.get(f"{server}/health", timeout=30).json() == {"status": "ok"}
    result = client.completions.create(model=MODEL, prompt="still here", max_tokens=2,
                                       extra_body={"ignore_eos": True})
    assert result.usage.completion_tokens == 2


def test_status_shows_per_rank_reports_and_the_chosen_block_count(server):
    status = httpx.get(f"{server}/spyre/status", timeout=60).json()
    reports = status["reports"]
    assert [r["rank"] for r in reports] == [0, 1]
    assert [r["memory_budget_bytes"] for r in reports] == BUDGETS
    assert status["limiting_rank"] == 1
    assert status["num_blocks"] == min(r["num_blocks"] for r in reports) == reports[1]["num_blocks"]
    # Every card really holds the chosen number of blocks, not the 4 of warmup.
    for rank in status["ranks"]:
        assert {tuple(s)[0] for s in rank["kv_cache_shapes"]} == {status["num_blocks"]}
        assert {tuple(s)[0] for s in rank["warmup"]["kv_cache_shapes"]} == {4}
    kv = status["kv_cache"]
    assert kv["num_blocks"] == status["num_blocks"]
    assert kv["usable_blocks"] == status["num_blocks"] - 1
    assert 0 <= kv["used_blocks"] <= kv["usable_blocks"]


def test_metrics_expose_spyre_and_vllm_kv_figures(server):
    text = httpx.get(f"{server}/metrics", timeout=30).text
    status = httpx.get(f"{server}/spyre/status", timeout=60).json()
    replica = status["replica"]
    assert f'spyre_kv_blocks_total{{model_name="{MODEL}",replica="{replica}"}} ' \
           f'{float(status["num_blocks"])}' in text
    assert "spyre_kv_blocks_used{" in text
    # Whether this replica's cards started warm (from the catalog) or cold, and how long.
    start = "warm" if status["warm_start"]["state"].startswith("warm") else "cold"
    slowest = max(r["warmup_seconds"] for r in status["reports"])
    assert metric(text, "spyre_warmup_seconds", replica=replica, start=start) == \
        pytest.approx(slowest)
    for vllm_metric in ("vllm:kv_cache_usage_perc", "vllm:num_preemptions_total",
                        "vllm:time_to_first_token_seconds_bucket",
                        "vllm:generation_tokens_total", "vllm:prompt_tokens_total"):
        assert f'{vllm_metric}{{' in text, vllm_metric
    # Client traffic moves vLLM's counter by exactly what the client was told it got (the
    # replica's own startup request happened before `before`).
    before = metric(text, "vllm:generation_tokens_total")
    result = httpx.post(f"{server}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": "count me", "max_tokens": 5, "ignore_eos": True}).json()
    after = metric(httpx.get(f"{server}/metrics", timeout=30).text,
                   "vllm:generation_tokens_total")
    assert result["usage"]["completion_tokens"] == 5
    assert after - before == 5


def test_card_actors_run_in_the_replicas_placement_group(server, ray_cluster):
    from ray._private import state

    from spyre_serve.vllm_plugin.card_actors import NAMESPACE, CardActor

    pg = httpx.get(f"{server}/spyre/status", timeout=60).json()["placement_group"]
    table = ray_cluster.util.placement_group_table()[pg]
    assert table["strategy"] == "STRICT_PACK"
    assert list(table["bundles"].values()) == [{"CPU": 0.5}, {"spyre": 1.0}, {"spyre": 1.0}]
    # The engine's card actors are the ones the replica started ahead of it (card_actors.py
    # names them), one per card bundle of the replica's group: none was created twice.
    cards = [a["Name"] for a in state.actors().values()
             if a["ActorClassName"] == CardActor.__name__ and a["State"] == "ALIVE"]

    def group_of(name: str) -> str:
        actor = ray_cluster.get_actor(name, namespace=NAMESPACE)
        return ray_cluster.get(actor.__ray_call__.remote(
            lambda _: __import__("ray").get_runtime_context().get_placement_group_id()))

    ours = sorted(name.rsplit("-", 2)[1] + "-" + name.rsplit("-", 1)[1]
                  for name in cards if name and group_of(name) == pg)
    assert ours == ["rank0-bundle1", "rank1-bundle2"], cards
    # Started ahead by the replica, they start with their share of the node's CPUs less
    # one as threads (card_actors.card_process_env, the default).
    ranks = httpx.get(f"{server}/spyre/status", timeout=60).json()["ranks"]
    share = max(1, (len(os.sched_getaffinity(0)) - 1) // 2)
    assert [r["torch_num_threads"] for r in ranks] == [share, share]


def test_health_is_ok(server):
    response = httpx.get(f"{server}/health", timeout=30)
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}
    # Every response names its replica: the one the status endpoint reports.
    assert response.headers["x-spyre-replica"] == \
        httpx.get(f"{server}/spyre/status", timeout=60).json()["replica"]
