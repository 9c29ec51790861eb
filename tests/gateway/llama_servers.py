"""Real llama.cpp servers for tests and benchmarks (built by ``scripts/real_engines.sh``).

:func:`find_engine` locates the cached ``llama-server`` and SmolLM2 model;
:class:`LlamaServer` runs one on a free port of 127.0.0.1 (one CPU thread,
``--metrics``, the model served as ``smollm``) and can pause it
(SIGSTOP/SIGCONT) or kill it like a real engine process.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from gateway_fakes import free_port

LLAMA_VERSION = "0.94.0"
MODEL_NAME = "smollm"

# The engines' hardware, declared as an operator declares a card the catalog lacks.
# Left unknown, it would get a GPU's shape (L40S), under which a prompt rides
# along with a memory-bound decode step almost free, while a CPU thread computes
# it whole between two tokens: a 52-token prompt costs some 33 decode steps here.
# Measured with llama-server's own timings (one thread, this repository's 2-core
# machine, 2026-12-07): 190 prompt tokens/s, 120 decode tokens/s at one stream.
# Under the roofline's efficiencies (eta_compute 0.7, eta_mem 0.75, 2.9 ms of
# fixed step cost for 30 layers), 0.073 TFLOP/s gives 5.3 ms of compute per token
# and 21 GB/s streams the 84 MB of Q4_1 weights in 5.3 ms: a decode step is as
# much compute as memory, so two streams cost nearly twice one. A faster or
# slower host changes the scale, which the gateway learns; the shape stays.
CPU_CATALOG: dict[str, Any] = {
    "gpus": [{"name": "llama-cpu", "tflops": 0.073, "mem_bw_gbps": 21.0, "mem_gb": 1.5,
              "tdp_w": 15.0, "price_per_hour": 0.05}],
    # SmolLM2-135M's shape (its GGUF header); Q4_1 stores 5 bits a weight.
    "models": [{"name": MODEL_NAME, "params": 1.35e8, "layers": 30, "hidden": 576,
                "kv_heads": 3, "head_dim": 64, "bytes_per_weight": 0.625,
                "max_context": 8192}],
}


def cache_dir() -> Path:
    return Path(os.environ.get("TAILGUARD_ENGINE_CACHE", Path.home() / ".cache" / "tailguard"))


def find_engine() -> tuple[Path, Path]:
    """(llama-server, model); skips the test when they are not built, fails when
    ``REQUIRE_REAL_ENGINES=1`` (``make test`` sets it after building them)."""
    binary = cache_dir() / f"llama.cpp-{LLAMA_VERSION}" / "llama-server"
    model = cache_dir() / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if binary.is_file() and model.is_file():
        return binary, model
    message = f"no llama-server at {binary} (run scripts/real_engines.sh)"
    if os.environ.get("REQUIRE_REAL_ENGINES") == "1":
        pytest.fail(message)
    pytest.skip(message)


def fleet_doc(servers: list[LlamaServer], idle_s: float, declared: bool = True
              ) -> dict[str, Any]:
    """A fleet file for a gateway in front of ``servers`` (``cpu-0``, ``cpu-1``...),
    their card declared (``CPU_CATALOG``) or, ``declared=False``, left unknown."""
    return {
        "listen": "127.0.0.1:0",
        "catalog": CPU_CATALOG if declared else {},
        "nodes": [{"id": f"cpu-{i}", "url": s.url, "gpu": "llama-cpu", "models": [MODEL_NAME],
                   "max_num_seqs": s.slots} for i, s in enumerate(servers)],
        "pools": {MODEL_NAME: {"policy": "tailguard",
                               "timeouts": {"connect_s": 1.0, "first_byte_s": 10.0,
                                            "idle_s": idle_s, "total_s": 60.0}}},
        "scrape": {"interval_s": 0.5},
    }


@dataclass
class LlamaServer:
    binary: Path
    model: Path
    threads: int = 1
    slots: int = 2
    metrics: bool = True
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> LlamaServer:
        args = [str(self.binary), "-m", str(self.model), "-t", str(self.threads),
                "-tb", str(self.threads), "--host", "127.0.0.1", "--port", str(self.port),
                "-a", MODEL_NAME, "-c", str(1024 * self.slots), "-np", str(self.slots),
                "--no-webui"]
        if self.metrics:
            args.append("--metrics")
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server on {self.port} did not start")
            time.sleep(0.2)

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


class CpuWatch:
    """How much CPU each server got while it wanted it, from the kernel's schedstat.

    ``/proc/PID/task/*/schedstat`` gives each thread's time on a CPU and its time
    runnable but waiting for one. Sampled every ``every_s`` on a thread of its own,
    so a test can tell an engine that was slow because the host gave it less CPU
    than its peers (the engines share this machine's cores) from one that was not.
    """

    def __init__(self, servers: list[LlamaServer], every_s: float = 0.2) -> None:
        self.servers = servers
        self._every_s = every_s
        self.samples: list[tuple[float, list[tuple[int, int]]]] = []  # (time.time(), per server)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-watch", daemon=True)

    def __enter__(self) -> CpuWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @staticmethod
    def _read(proc: subprocess.Popen[bytes] | None) -> tuple[int, int]:
        on = waiting = 0
        if proc is None:
            return on, waiting
        for stat in Path(f"/proc/{proc.pid}/task").glob("*/schedstat"):
            try:
                fields = stat.read_text().split()
            except OSError:  # a thread that just ended, or the process
                continue
            on += int(fields[0])
            waiting += int(fields[1])
        return on, waiting

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            self.samples.append((time.time(), [self._read(s.proc) for s in self.servers]))

    def share(self, i: int, start: float, end: float) -> float:
        """Server ``i``'s share of CPU while it was runnable in [start, end] (1: never
        waited for a CPU; nan: it never ran nor waited)."""
        inside = [per[i] for t, per in self.samples if start <= t <= end]
        if len(inside) < 2:
            return math.nan
        on = inside[-1][0] - inside[0][0]
        waiting = inside[-1][1] - inside[0][1]
        return on / (on + waiting) if on + waiting > 0 else math.nan
