"""OpenAI-compatible API on Spyre cards: `serve run serve_config.yaml`.

Serve validates `args:` against AppArgs (the annotation) before anything starts, so an
unknown or invalid field fails `serve run` with the field's name.
"""
from ray.serve import Application

from spyre_serve.app import AppArgs
from spyre_serve.replica import SpyreLLMServer


def build_app(args: AppArgs) -> Application:
    return SpyreLLMServer.options(**args.deployment_options()).bind(args.model_dump())
