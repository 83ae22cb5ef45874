"""Running it: the spyre-serve CLI, draining shutdown, and the builtin models."""
