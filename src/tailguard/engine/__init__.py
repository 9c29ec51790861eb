"""Model of one continuous-batching inference engine, for the simulator and the emulator.

See :mod:`tailguard.engine.model` for the scheduler it models and
:mod:`tailguard.engine.segment` for the closed-form timing of decode runs.
"""

from tailguard.engine.model import FAILED, FINISH, FIRST_TOKEN, Engine, EngineConfig, Event

__all__ = ["FAILED", "FINISH", "FIRST_TOKEN", "Engine", "EngineConfig", "Event"]
