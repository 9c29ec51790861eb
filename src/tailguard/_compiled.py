"""The modules ``setup.py`` compiles with mypyc, and the check that a source
checkout's compiled modules are not older than their sources.

Python imports a compiled module in preference to its source, so in a checkout
(an editable install) an edit to one of these files would otherwise be ignored
without a word until the extensions are rebuilt (``make compile``). An
installed package is built whole and is not checked. This module imports
nothing of tailguard: ``setup.py`` reads ``MODULES`` from it before the package
can be imported.
"""

from __future__ import annotations

import importlib.machinery
from pathlib import Path

# The engine model, and what the core runs at every routing decision and answer
# (the latency formulas and estimators, the learner, the default policy, the
# exchange) and the simulator at every stream report: pure computation on typed
# values. Nothing monkeypatches them, and a class that interpreted code
# subclasses says so (mypyc_attr, as the exchange does); a class
# attribute that must stay one is declared ClassVar; no configuration format
# reads their classes' fields (a compiled dataclass hides them: hence
# engine/config.py and core/policies/tailguard_options.py). Not compiled: the
# node's parts (mixins over one slotted object, which mypyc does not build),
# the detector (tests spy on it), and the pools' dataclasses (recordings replay
# them from JSON lists where tuples are declared, which a compiled class refuses).
MODULES = (
    "tailguard.engine.decode_batch",
    "tailguard.engine.model",
    "tailguard.engine.prefix_cache",
    "tailguard.engine.request",
    "tailguard.engine.scheduler",
    "tailguard.engine.segment",
    "tailguard.core.predict",
    "tailguard.core.estimate",
    "tailguard.core.policies.tailguard",
    "tailguard.core.learner",
    "tailguard.sim.streams",
    "tailguard.core.exchange",
)
# Their source files from the repository root: what setup.py compiles and `make
# compile` watches.
SOURCES = tuple("src/" + name.replace(".", "/") + ".py" for name in MODULES)


def stale(root: Path) -> list[str]:
    """The compiled modules under ``root`` (the directory that holds the tailguard
    package) whose source was changed after they were built, or that are no
    longer among ``MODULES`` (left by an earlier build)."""
    compiled = {root.joinpath(*name.split(".")).with_suffix(".py") for name in MODULES}
    out = []
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        for built in (root / "tailguard").rglob("*" + suffix):
            source = built.with_name(built.name[: -len(suffix)] + ".py")
            if source.exists() and (source not in compiled
                                    or source.stat().st_mtime > built.stat().st_mtime):
                out.append(str(source.relative_to(root)))
    return sorted(out)


def loaded() -> list[str]:
    """Which of ``MODULES`` this process runs compiled (imports them): what a
    benchmark says beside its times."""
    import importlib

    return [name for name in MODULES
            if not str(getattr(importlib.import_module(name), "__file__", "")).endswith(".py")]


def check() -> None:
    """Refuse to run a checkout whose compiled modules are older than their sources."""
    root = Path(__file__).resolve().parent.parent
    if not (root.parent / "pyproject.toml").exists():  # an installed package
        return
    old = stale(root)
    if old:
        raise ImportError(
            f"tailguard: the compiled modules of {', '.join(old)} are older than their "
            "sources, which Python would ignore: run `make compile` (or `make pure` to "
            "run every module from its source)")


__all__ = ["MODULES", "SOURCES", "check", "loaded", "stale"]
