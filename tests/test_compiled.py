"""The check that keeps a checkout from running compiled modules older than their
sources (``src/tailguard/_compiled.py``), on a tree of empty files."""

from __future__ import annotations

import importlib.machinery
import os
from pathlib import Path

from tailguard import _compiled

SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def _module(root: Path, name: str, built_after: bool | None) -> None:
    """``name``'s source under ``root``, and its extension built after the source was
    last written (True), before it (False), or not at all (None)."""
    source = root.joinpath(*name.split(".")).with_suffix(".py")
    source.parent.mkdir(parents=True, exist_ok=True)
    source.write_text("")
    os.utime(source, (1_000.0, 1_000.0))
    if built_after is not None:
        built = source.with_name(source.stem + SUFFIX)
        built.write_bytes(b"")
        at = 2_000.0 if built_after else 500.0
        os.utime(built, (at, at))


def test_a_fresh_build_passes_and_an_edit_after_it_does_not(tmp_path: Path) -> None:
    segment, model = "tailguard.engine.segment", "tailguard.engine.model"
    assert {segment, model} <= set(_compiled.MODULES)
    _module(tmp_path, segment, built_after=True)
    _module(tmp_path, model, built_after=True)
    _module(tmp_path, "tailguard.core.balancer", built_after=None)  # never compiled
    assert _compiled.stale(tmp_path) == []
    _module(tmp_path, model, built_after=False)
    assert _compiled.stale(tmp_path) == ["tailguard/engine/model.py"]


def test_a_module_compiled_by_an_earlier_build_only_is_stale(tmp_path: Path) -> None:
    # Compiled when it was on the list; Python would still import it now that it is not.
    _module(tmp_path, "tailguard.core.balancer", built_after=True)
    assert _compiled.stale(tmp_path) == ["tailguard/core/balancer.py"]


def test_this_checkout_is_not_stale() -> None:
    """What `make test` ran `make compile` for (and what importing tailguard checked)."""
    assert _compiled.stale(Path(_compiled.__file__).resolve().parent.parent) == []
