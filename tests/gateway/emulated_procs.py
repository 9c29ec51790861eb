"""Emulated engines in processes of their own, so that a test can stop (SIGSTOP) and
kill (SIGKILL) them as it would a real engine process."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

SRC = str(Path(__file__).resolve().parents[2] / "src")


@contextmanager
def engine_process(tmp: Path, node: dict[str, Any]) -> Iterator[subprocess.Popen[bytes]]:
    """One emulated engine in a process of its own (so it can be stopped and killed)."""
    path = tmp / f"{node['id']}.yaml"
    path.write_text(yaml.safe_dump({"nodes": [node]}))
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.Popen([sys.executable, "-m", "tailguard", "emulate", "--fleet", str(path)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        proc.wait(timeout=10)


async def wait_listening(port: int, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            _, w = await asyncio.open_connection("127.0.0.1", port)
            w.close()
            return
        except OSError:
            if loop.time() > deadline:
                raise AssertionError(f"nothing listens on {port}") from None
            await asyncio.sleep(0.1)



__all__ = ["engine_process", "wait_listening"]
