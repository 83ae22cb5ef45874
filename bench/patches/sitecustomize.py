"""Proposed spyre_serve fixes, tried in the servers the bench starts before they land.

Only active when SPYRE_BENCH_PATCH names them (compare_vllm.py --experiment ...), which
the results JSON records; a normal bench run measures spyre_serve exactly as it is.
Python imports `sitecustomize` from PYTHONPATH at start-up, and Ray's daemons, its
workers and vLLM's EngineCore inherit that environment, so a patch reaches the card
actors too.

kv-flat: the card's KV program writes through a flat view (see kv_flat.py).
"""
import importlib.util
import os
import sys

PATCHES = set(filter(None, os.environ.get("SPYRE_BENCH_PATCH", "").split(",")))


def _patch_attention(attention) -> None:
    from kv_flat import flat_program

    def install_kv_program(compile_fn):
        attention._program = flat_program(compile_fn)

    attention.install_kv_program = install_kv_program


class _AfterImport:
    """Runs a patch right after a module executes, before anyone imports names from it."""

    def __init__(self, name, patch):
        self.name, self.patch = name, patch

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            self.patch(module)

        spec.loader.exec_module = exec_module
        return spec


if "kv-flat" in PATCHES:
    sys.meta_path.insert(0, _AfterImport("spyre_serve.attention", _patch_attention))
