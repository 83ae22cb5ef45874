"""Embeddings through the same platform, cards and block handshake: a decoder model served
as a pooling model (`runner: pooling, convert: embed`, as `vllm serve` takes them), asked
through the `openai` client, against transformers on the same weights.

A decoder embedder attends causally over its prompt, so it keeps a KV cache during prefill
and the handshake sizes it as for generation; an encoder-only model (no KV cache) is
refused at startup with a message saying so (worker.py).
"""
from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from support import MiB

pytestmark = pytest.mark.slow

MODEL = "tiny-embed"
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "Spyre"]


@pytest.fixture(scope="module")
def server(serve_instance, tiny_model):
    from ray import serve

    from deployments.openai_app import build_app
    from spyre_serve.serve.app_args import AppArgs

    port = serve_instance.ensure()
    args = AppArgs(model=tiny_model, served_model_name=MODEL, max_model_len=256, max_num_seqs=4,
                   spyre={"card_memory_bytes": 256 * MiB}, replica_num_cpus=0.5,
                   engine_kwargs={"runner": "pooling", "convert": "embed"})
    serve.run(build_app(args), name="embed-test", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    if serve_instance.alive():
        serve.delete("embed-test")


def transformers_embeddings(model_path: str, token_ids: list[list[int]]) -> np.ndarray:
    """Last-token pooling, normalized: what vLLM's embed conversion of a decoder does."""
    import torch
    from transformers import AutoModel
    model = AutoModel.from_pretrained(model_path, torch_dtype=torch.float32)
    rows = []
    with torch.no_grad():
        for ids in token_ids:
            hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
            rows.append(torch.nn.functional.normalize(hidden, dim=-1).numpy())
    return np.stack(rows)


def test_embeddings_equal_transformers(server, tiny_model):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", timeout=120, max_retries=0)
    result = client.embeddings.create(model=MODEL, input=TEXTS)
    ours = np.array([d.embedding for d in sorted(result.data, key=lambda d: d.index)])
    token_ids = [httpx.post(f"{server}/tokenize", json={"model": MODEL, "prompt": t},
                            timeout=60).json()["tokens"] for t in TEXTS]
    reference = transformers_embeddings(tiny_model, token_ids)
    assert ours.shape == reference.shape
    np.testing.assert_allclose(ours, reference, atol=1e-4)
    assert result.usage.prompt_tokens == sum(len(ids) for ids in token_ids)


def test_pooling_model_went_through_the_handshake(server):
    status = httpx.get(f"{server}/spyre/status", timeout=60).json()
    assert status["block_size"] == 64
    assert status["num_blocks"] >= 256 // 64 + 1  # one full-length request fits
    assert status["num_blocks"] == min(r["num_blocks"] for r in status["reports"])
    paths = set(httpx.get(f"{server}/openapi.json", timeout=30).json()["paths"])
    assert {"/v1/embeddings", "/pooling"} <= paths
