"""The live dashboard in headless Chromium, against emulated engines behind a gateway.

Drives ``chromedriver`` through the W3C WebDriver protocol with plain HTTP
(no Selenium dependency). Checks that every node renders under its GPU
class, that a crash injected into one engine shows up in the open page as a
state change (health checks mark the node ``down``) and in the event list,
and saves a screenshot. ``TAILGUARD_UPDATE_DOCS=1`` also writes it to
``docs/dashboard.png``.
"""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from live_stack import MIXED, LiveStack, free_port, http_json, need_binary

from tailguard.core.fleet import NodeState

DOCS = Path(__file__).resolve().parents[2] / "docs"
UPDATE_DOCS = os.environ.get("TAILGUARD_UPDATE_DOCS") == "1"
CHROME_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
               "--no-first-run", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
               "--window-size=1440,1400", "--hide-scrollbars"]


class Browser:
    """A chromedriver process and one session."""

    def __init__(self, chrome: str, driver: str, profile: str) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen([driver, f"--port={self.port}", "--allowed-ips=127.0.0.1"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.base = f"http://127.0.0.1:{self.port}"
        self.session = ""
        deadline = time.monotonic() + 15
        while True:
            try:
                if http_json("GET", self.base + "/status", timeout=1)["value"]["ready"]:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise AssertionError("chromedriver did not start")
            time.sleep(0.1)
        caps = {"capabilities": {"alwaysMatch": {"goog:chromeOptions": {
            "binary": chrome, "args": [*CHROME_ARGS, f"--user-data-dir={profile}"]}}}}
        self.session = http_json("POST", self.base + "/session", caps, timeout=60)["value"][
            "sessionId"]

    def cmd(self, method: str, path: str, body: Any = None) -> Any:
        return http_json(method, f"{self.base}/session/{self.session}{path}", body,
                         timeout=30)["value"]

    def js(self, script: str) -> Any:
        return self.cmd("POST", "/execute/sync", {"script": script, "args": []})

    def wait(self, script: str, timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = self.js(script)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.2)

    def close(self) -> None:
        if self.session:
            with contextlib.suppress(OSError):
                http_json("DELETE", f"{self.base}/session/{self.session}", timeout=10)
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


NODE_STATES = """return Object.fromEntries([...document.querySelectorAll('.node')]
    .map(e => [e.dataset.node, e.dataset.state]));"""
CLASSES = """return Object.fromEntries([...document.querySelectorAll('.gpu-class')]
    .map(s => [s.dataset.gpu, [...s.querySelectorAll('.node')].map(e => e.dataset.node)]));"""


def test_dashboard_in_headless_chromium(tmp_path: Path) -> None:
    chrome = need_binary("chromium")
    driver = need_binary("chromedriver")
    profile = tempfile.mkdtemp(prefix="tg-chrome-")
    try:
        # round_robin spreads the load, so that every card has measurements to show.
        with LiveStack(rate=8.0, pool={"policy": "round_robin"}) as st:
            browser = Browser(chrome, driver, profile)
            try:
                browser.cmd("POST", "/url", {"url": st.url + "/dashboard"})
                # Every node renders, grouped by its GPU class, all healthy.
                expected = {nid for nid, _ in MIXED}
                states = browser.wait(f"""const s = (() => {{{NODE_STATES}}})();
                    return Object.keys(s).length === {len(expected)} ? s : null;""",
                                      15, "all nodes rendered")
                assert set(states) == expected
                assert set(states.values()) == {"healthy"}
                assert browser.js(CLASSES) == {
                    "H100-SXM": ["h100-0"], "A100-80GB": ["a100-0", "a100-1"],
                    "L4": ["l4-0", "l4-1", "l4-2"]}
                # Load shows: some node has a measured TPOT against the SLO.
                browser.wait("""return [...document.querySelectorAll('.node .val')]
                    .some(e => / ms \\/ 100 ms$/.test(e.textContent) &&
                               !e.textContent.startsWith('-'));""", 15, "a TPOT value")

                # A fault: one engine crashes; health checks take it out; the open
                # page shows the state change and the event without a reload.
                st.fault("a100-1", {"kind": "crash", "duration_s": 60})
                # And one L4 throttled after a healthy start: its TPOT goes over the SLO.
                st.fault("l4-1", {"kind": "throttle", "factor": 0.3})
                browser.wait("""return document.querySelector('.node[data-node="a100-1"]')
                    .dataset.state === 'down';""", 15, "a100-1 shown down")
                browser.wait("""return [...document.querySelectorAll('#events tr')]
                    .some(r => r.dataset.eventNode === 'a100-1' &&
                               r.textContent.includes('down'));""", 5, "the down event")
                after = browser.js(NODE_STATES)
                assert after["a100-1"] == "down"
                assert [n for n, s in after.items() if s != "healthy"] == ["a100-1"]
                # An operator's drain shows as well, in its own colour.
                st.call(lambda gw: gw.fleet.set_state("a100-0", NodeState.DRAINING))
                browser.wait("""return document.querySelector('.node[data-node="a100-0"]')
                    .dataset.state === 'draining';""", 10, "a100-0 shown draining")
                colours = browser.js("""return ['a100-1', 'h100-0', 'a100-0'].map(id =>
                    getComputedStyle(document.querySelector(`.node[data-node="${id}"]`))
                    .borderLeftColor);""")
                assert len(set(colours)) == 3, colours
                time.sleep(4.0)  # let the sparklines and the timeline gather a few points
                if UPDATE_DOCS:
                    # For the picture: give the outlier detector time to act on the
                    # throttled L4 (about 15 s), so the timeline shows it.
                    with contextlib.suppress(AssertionError):
                        browser.wait("""return document.querySelector('.node[data-node="l4-1"]')
                            .dataset.state !== 'healthy';""", 40, "l4-1 degraded")
                    time.sleep(5.0)
                png = base64.b64decode(browser.cmd("GET", "/screenshot"))
            finally:
                browser.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    assert png.startswith(b"\x89PNG") and len(png) > 20_000
    (tmp_path / "dashboard.png").write_bytes(png)
    if UPDATE_DOCS:
        (DOCS / "dashboard.png").write_bytes(png)
