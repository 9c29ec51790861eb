"""Builds tailguard, with its hot paths compiled by mypyc.

The engine model and the core's modules that run at every routing decision and
answer (``COMPILED``, listed with why in ``src/tailguard/_compiled.py``): mypyc
compiles these typed modules, unchanged, to C extensions, and the simulator
then runs faster with the same results to the last bit (benchmarks/README.md,
"Compiled hot paths"). Everything else stays plain Python, and so can these:
without mypyc or a C compiler, or with ``TAILGUARD_PURE=1`` in the environment,
the package installs uncompiled and behaves the same.

An editable install builds the extensions beside their sources. Python then
imports the compiled module, so an edit to one of these files counts only once
it is rebuilt: ``make compile`` (``make test`` and ``make demo`` run it), and
importing tailguard from a checkout whose compiled modules are older than their
sources fails, saying so (``src/tailguard/_compiled.py``).
"""

from __future__ import annotations

import os
import runpy
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext

# The compiled modules (and why these): src/tailguard/_compiled.py, which imports
# nothing of tailguard, so that it is read before the package can be imported.
COMPILED: list[str] = list(runpy.run_path("src/tailguard/_compiled.py")["SOURCES"])


class OptionalBuildExt(build_ext):
    """Builds the compiled modules, or none of them: a failed build leaves the
    package pure Python, with a warning, rather than failing the install."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # a missing compiler, headers, or a mypyc error
            for path in self.get_outputs():
                if os.path.exists(path):
                    os.remove(path)
            print(f"tailguard: not compiled ({type(exc).__name__}: {exc}); "
                  "installing pure Python", file=sys.stderr)


def ext_modules() -> list[object]:
    if os.environ.get("TAILGUARD_PURE"):
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        print("tailguard: mypyc not available; installing pure Python", file=sys.stderr)
        return []
    try:
        return list(mypycify(COMPILED, opt_level="3"))
    except (Exception, SystemExit) as exc:  # mypyc refused the code (its type check)
        print(f"tailguard: mypyc failed ({exc}); installing pure Python", file=sys.stderr)
        return []


setup(ext_modules=ext_modules(), cmdclass={"build_ext": OptionalBuildExt})
