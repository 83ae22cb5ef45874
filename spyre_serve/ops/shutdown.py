"""Graceful Serve shutdown: drain every application first, then shut Serve down.

Ray Serve 2.60's `serve.shutdown()` kills its HTTP proxies as its first step, which cuts
every in-flight stream although the replicas would drain. Deleting the applications first
lets each replica finish what it holds (within its graceful_shutdown_timeout_s) while the
proxies still carry the responses; the shutdown that follows has nothing left to cut.
"""
from __future__ import annotations

import time

from spyre_serve import get_logger

logger = get_logger("spyre_serve.ops.shutdown")


def drain_and_shutdown(timeout_s: float = 300.0) -> list[str]:
    """Delete every Serve app, wait until they are gone, then `serve.shutdown()`.

    Needs a connected Ray driver. Returns the names of the apps it drained.
    """
    from ray import serve

    names = list(serve.status().applications)
    for name in names:
        logger.info("Draining Serve application %r before shutdown", name)
        serve.delete(name, _blocking=False)
    deadline = time.monotonic() + timeout_s
    while serve.status().applications and time.monotonic() < deadline:
        time.sleep(0.5)
    left = list(serve.status().applications)
    if left:
        logger.warning("Applications %s still draining after %.0f s; shutting down anyway",
                       left, timeout_s)
    serve.shutdown()
    return names


def drain_cluster(address: str, timeout_s: float = 300.0, head_stops: bool = False) -> list[str]:
    """Connect to the cluster at `address` as a driver and drain its Serve apps; when the
    head stops next (`head_stops`), also end what would keep its node from draining."""
    import ray

    ray.init(address=address, namespace="serve", log_to_driver=False,
             logging_level="WARNING")
    try:
        drained = drain_and_shutdown(timeout_s)
        if head_stops:
            from spyre_serve.handshake.catalog import end_catalog
            end_catalog()
        return drained
    finally:
        ray.shutdown()
