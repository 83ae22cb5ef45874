"""spyre_serve: vLLM on IBM Spyre cards, one Ray actor per card, served by Ray Serve."""
import logging


def get_logger(name: str) -> logging.Logger:
    """Our loggers live under vLLM's, so they share its handler, format and level in every
    process vLLM starts (engine core, Ray worker actors)."""
    return logging.getLogger(f"vllm.{name}")
