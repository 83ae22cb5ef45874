"""Shared pieces of the engine test modules (one engine per module: vLLM keeps one
Prometheus registry per process, so two live engines would share metrics)."""
import functools

import torch
from vllm import SamplingParams

PROMPTS = ["Beautiful is better than ugly.", "the quick brown fox", "Errors should never",
           "import torch", "Now is better than never.", "Simple is better", "lazy dog", "x"]
MAX_MODEL_LEN = 256


@functools.lru_cache
def hf_greedy(model_path, prompts, max_tokens):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    outs = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        g = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                           do_sample=False)
        outs.append(g[0, ids.shape[1]:].tolist())
    return outs


def greedy(max_tokens):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def metric(llm, name):
    """A gauge's or counter's value; an unknown name fails (a rename must not read as 0)."""
    values = [m.value for m in llm.get_metrics() if m.name == name and hasattr(m, "value")]
    if not values:
        raise KeyError(f"the engine has no gauge or counter called {name!r}")
    return sum(values)




def assert_nothing_compiled_since_warmup(llm):
    llm.generate(PROMPTS, greedy(20))
    for rank in llm.collective_rpc("spyre_status"):
        assert rank["warmup"]["graphs"] >= 1  # the KV program was compiled during warmup
        assert rank["graphs_now"] == rank["warmup"]["graphs"], rank


def assert_greedy_matches_transformers(llm, model_path):
    prompts = tuple(PROMPTS[:3])
    assert token_ids(llm.generate(list(prompts), greedy(12))) == hf_greedy(model_path, prompts, 12)
