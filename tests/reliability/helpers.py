"""Helpers of the reliability suite: bounded waits, a Serve app on 127.0.0.1, metrics.

Every wait here is a poll with a deadline; nothing sleeps to synchronise. The suite shares
one Serve instance (one HTTP port) per package run, and one small TP=1 app between the
load, disconnect and bad-input modules; the rank-failure and shutdown modules run their
own apps next to it, under their own route prefixes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import httpx
from support import (MiB, ServeInstance, free_port, metric,  # noqa: F401 (re-exported)
                     serve_controller_running, wait_for)

MODEL = "tiny-rel"
MAX_MODEL_LEN = 256
# An engine start (model load, warmup, handshake) is 20-50 s on 2 busy cores.
APP_START_TIMEOUT_S = 240
# A simulated card with room to spare: the weights and warmup's activation peak (resident
# memory, so it varies from run to run) take about 50 MiB of it.
CARD = 256 * MiB


def in_engine(metrics_text: str) -> float:
    """Requests the engine holds (running, or waiting in its scheduler: a request preempted
    for blocks waits again), from a replica's /metrics; a request queued in Serve is not."""
    return (metric(metrics_text, "vllm:num_requests_running")
            + metric(metrics_text, "vllm:num_requests_waiting"))


def sse_events(lines) -> list[dict]:
    """The JSON events of an OpenAI server-sent-event stream, up to `data: [DONE]`."""
    events = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            break
        events.append(json.loads(data))
    return events


def completion_body(prompt: str, max_tokens: int, stream: bool = False, **extra) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, **extra}
    if stream:
        body["stream"] = True
    return body


@dataclass
class App:
    """One Serve application of this suite, reached through Serve's HTTP proxy."""
    name: str
    url: str  # http://127.0.0.1:<port><route prefix>
    args: dict = field(default_factory=dict)

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kwargs.pop("timeout", 60), **kwargs)

    def async_client(self, **kwargs) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=kwargs.pop("timeout", 120),
                                 limits=httpx.Limits(max_connections=256,
                                                     max_keepalive_connections=64), **kwargs)

    def metrics(self) -> str:
        with self.client() as c:
            r = c.get("/metrics")
            r.raise_for_status()
            return r.text

    def status(self) -> dict:
        with self.client() as c:
            r = c.get("/spyre/status")
            r.raise_for_status()
            return r.json()

    def complete(self, prompt: str, max_tokens: int, **extra) -> str:
        with self.client() as c:
            r = c.post("/v1/completions", json=completion_body(prompt, max_tokens, **extra))
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

    def idle_and_empty(self) -> dict | None:
        """The KV figures once nothing runs or waits and every block is free, else None."""
        text = self.metrics()
        kv = self.status()["kv_cache"]
        quiet = (metric(text, "vllm:num_requests_running") == 0
                 and metric(text, "vllm:num_requests_waiting") == 0
                 and metric(text, "vllm:kv_cache_usage_perc") == 0
                 and kv["used_blocks"] == 0 and kv["running_requests"] == 0
                 and kv["waiting_requests"] == 0)
        return kv if quiet else None


def app_args(tiny_model: str, **overrides):
    from spyre_serve.serve.app_args import AppArgs
    args = {"model": tiny_model, "served_model_name": MODEL, "max_model_len": MAX_MODEL_LEN,
            "max_num_seqs": 8, "replica_num_cpus": 0.5, "spyre": {"card_memory_bytes": CARD}}
    args.update(overrides)
    return AppArgs(**args)


def deploy(serve_instance: ServeInstance, name: str, args, *, wait: bool = True,
           **deployment_options) -> App:
    """serve.run without blocking forever: poll the app's status with a deadline."""
    from ray import serve

    from spyre_serve.serve.replica import SpyreLLMServer

    port = serve_instance.ensure()
    options = {**args.deployment_options(), **deployment_options}
    # What deployments/openai_app.build_app builds, plus the test's own deployment options.
    target = SpyreLLMServer.options(**options).bind(args.model_dump())
    prefix = f"/{name}"
    serve._run(target, name=name, route_prefix=prefix, _blocking=False)
    app = App(name=name, url=f"http://127.0.0.1:{port}{prefix}", args=args.model_dump())
    if wait:
        wait_for_app(name, "RUNNING", APP_START_TIMEOUT_S)
    return app


def app_status(name: str):
    from ray import serve
    return serve.status().applications.get(name)


def wait_for_app(name: str, state: str, timeout: float):
    def reached():
        status = app_status(name)
        if status is None:
            return None
        if status.status == "DEPLOY_FAILED" and state != "DEPLOY_FAILED":
            raise AssertionError(f"app {name} failed to deploy: {status.deployments}")
        return status if status.status == state else None
    return wait_for(f"app {name} to be {state}", reached, timeout, interval=0.5)


def delete_app(name: str, timeout: float = 120) -> None:
    from ray import serve
    try:
        serve.delete(name, _blocking=False)
    except Exception:
        return  # Serve itself is gone
    wait_for(f"app {name} to be deleted", lambda: app_status(name) is None, timeout, 0.5)


# One replica with few KV blocks: 10 blocks (9 usable) for up to 16 sequences of up to
# 256 tokens (4 blocks each), so a busy engine must preempt.
SHARED_BLOCKS = 10
SHARED_MAX_NUM_SEQS = 16

# Figures the tests measured, printed at the end of the run (requests, failures, times).
FIGURES: dict[str, dict] = {}


def record(test: str, **figures) -> None:
    FIGURES.setdefault(test, {}).update(figures)
    print(f"FIGURES {test}: {json.dumps(figures)}")
