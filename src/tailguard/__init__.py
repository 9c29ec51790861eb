"""tailguard: keep LLM inference fast on fleets of mixed GPUs."""

__version__ = "0.1.0"
