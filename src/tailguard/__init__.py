"""tailguard: keep LLM inference fast on fleets of mixed GPUs."""

from tailguard import _compiled

__version__ = "0.1.0"

_compiled.check()
