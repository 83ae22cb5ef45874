"""spyre_serve: vLLM on IBM Spyre cards, one Ray actor per card, served by Ray Serve."""
import logging


def _log_like_vllm() -> None:
    logger = logging.getLogger("spyre_serve")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [spyre_serve %(module)s] "
                                               "%(message)s", "%m-%d %H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


_log_like_vllm()
