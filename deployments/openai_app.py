"""OpenAI-compatible API on Spyre cards: `serve run serve_config.yaml`.

Serve validates `args:` against AppArgs (the annotation) before anything starts, so an
unknown or invalid field fails `serve run` with the field's name.
"""
import logging

from ray.serve import Application

from spyre_serve.serve.app_args import AppArgs
from spyre_serve.serve.replica import SpyreLLMServer
from spyre_serve.vllm_plugin.settings import RAY_CARD_RESOURCE

logger = logging.getLogger("ray.serve")


def build_app(args: AppArgs) -> Application:
    warn_when_no_node_has_cards(args.tensor_parallel_size)
    return SpyreLLMServer.options(**args.deployment_options()).bind(args.model_dump())


def warn_when_no_node_has_cards(cards_per_replica: int) -> None:
    """Say what a replica will wait for, and the two fixes, where `serve run` shows it.

    Ray itself only logs generic "cannot be scheduled" warnings for a placement group that
    asks for a resource no node declares. An autoscaler may still add such a node, so this
    warns and does not fail.
    """
    import ray
    if not ray.is_initialized():
        return
    largest = max((node["Resources"].get(RAY_CARD_RESOURCE, 0) for node in ray.nodes()
                   if node["Alive"]), default=0)
    if largest >= cards_per_replica:
        return
    logger.warning(
        "spyre_serve: no node of this Ray cluster declares %d `spyre` resource(s) (the most "
        "on one node: %d), so each replica waits until an autoscaler adds such a node. Fix: "
        "run `spyre-serve start` (or `make serve`) on a machine with cards or simulated ones, "
        "or declare the cards when starting Ray: `ray start --head --resources='{\"spyre\": "
        "4}'` (KubeRay: rayStartParams.resources; VM clusters: available_node_types.*."
        "resources).", cards_per_replica, int(largest))
