"""vLLM's side: the platform plugin, the Ray executor with one actor per card, the card
worker and its warmup, the attention backend, and the engine the replica starts."""
