"""Progress on long commands: live in a terminal (a real pseudo-terminal), silent when piped.

Each command runs as its own process, as a user would start it. In a terminal,
the gaps between its writes are measured; piped, its output must hold no
cursor movement and no live line.
"""

from __future__ import annotations

import itertools
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

TAILGUARD = [sys.executable, "-m", "tailguard"]
SCENARIO = Path(__file__).resolve().parents[1] / "scenarios" / "mixed.yaml"
CURSOR = ("\x1b[", "\r")  # a live display redraws with CSI sequences or carriage returns


def in_terminal(args: list[str], timeout_s: float) -> tuple[str, list[float]]:
    """Run ``args`` on a pseudo-terminal: its output, and the times of its start and writes."""
    leader, follower = pty.openpty()
    env = {**os.environ, "COLUMNS": "160", "LINES": "50", "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen(args, stdin=follower, stdout=follower, stderr=follower, env=env,
                            close_fds=True)
    os.close(follower)
    chunks: list[bytes] = []
    times = [time.monotonic()]  # the start counts: a silent start is a gap too
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 0.2)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(leader, 65536)
            except OSError:  # the child closed its end
                break
            if not data:
                break
            chunks.append(data)
            times.append(time.monotonic())
        assert proc.wait(timeout=max(1.0, deadline - time.monotonic())) == 0, \
            b"".join(chunks).decode(errors="replace")[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(leader)
    return b"".join(chunks).decode(errors="replace"), times


def piped(args: list[str], timeout_s: float) -> str:
    out = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, check=True)
    return out.stdout + out.stderr


def largest_gap(times: list[float]) -> float:
    return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


def test_demo_shows_progress_every_two_seconds_in_a_terminal_and_none_piped() -> None:
    args = [*TAILGUARD, "demo", "--duration", "4", "--no-baseline"]
    text, times = in_terminal(args, timeout_s=120)
    assert "attainment so far" in text  # the live view
    assert "SLO attainment" in text  # the final table
    assert largest_gap(times) < 2.0, f"silent for {largest_gap(times):.1f} s"

    out = piped(args, timeout_s=120)
    assert "SLO attainment" in out and "/dashboard" in out
    assert "attainment so far" not in out and not any(c in out for c in CURSOR), out[-2000:]


def test_sim_progress_only_in_a_terminal_and_without_quiet() -> None:
    args = [*TAILGUARD, "sim", str(SCENARIO), "--duration", "150", "--policies",
            "tailguard,round_robin"]
    text, times = in_terminal(args, timeout_s=180)
    assert re.search(r"tailguard\S*\s.*\d+/\d+ s", text), text[:1000]  # "t/horizon s"
    assert largest_gap(times) < 2.0, f"silent for {largest_gap(times):.1f} s"

    quiet, _ = in_terminal([*args, "--quiet"], timeout_s=180)
    out = piped(args, timeout_s=180)
    for text in (quiet, out):
        assert "SLO att." in text  # the result table
        assert not re.search(r"\d+/150 s", text), text[:1000]
    assert "\x1b[" not in out


def test_demo_stops_cleanly_on_ctrl_c() -> None:
    """SIGINT mid-run (what Ctrl-C sends): exit 130, no traceback, nothing left running."""
    env = {**os.environ, "COLUMNS": "160"}
    proc = subprocess.Popen([*TAILGUARD, "demo", "--duration", "60", "--no-baseline"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # wait for the load to start (its gateway's URL)
            if "/dashboard" in line:
                break
        time.sleep(3.0)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, out[-2000:]
    assert "stopped" in out and "Traceback" not in out, out[-2000:]
