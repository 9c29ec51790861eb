"""One benchmark run's records and their summary (:mod:`tailguard.bench.loadgen`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from tailguard.sim.results import summary

if TYPE_CHECKING:
    from tailguard.bench.loadgen import BenchConfig

DIRECT = "direct"  # the node of a request sent to an engine itself (no gateway header)
OK = "ok"


class Record:
    """What happened to one request (times in seconds from the run's start)."""

    __slots__ = ("arrival", "blocks", "cached", "end", "error", "first", "input", "max_tokens",
                 "node", "prefill_node", "prefill_s", "prompt_reported", "salt", "session",
                 "status", "target", "tokens")

    def __init__(self, arrival: float, n_in: int, n_out: int,
                 blocks: tuple[int, ...] | None = None, salt: int = 0,
                 session: int | None = None) -> None:
        self.arrival = arrival
        self.session = session  # sent as x-session-id (session affinity)
        self.blocks = blocks  # its prompt's blocks, when the workload shares prefixes
        self.salt = salt
        self.cached = -1  # prompt tokens the server reported cached (-1: not reported)
        self.prompt_reported = 0
        self.input = n_in
        self.max_tokens = n_out
        self.first = -1.0
        self.end = -1.0
        self.tokens = 0
        self.status = 0
        self.node = DIRECT
        # Disaggregated (the gateway's headers): where its prompt was computed, and the
        # seconds that leg took; None: computed where it was decoded.
        self.prefill_node: str | None = None
        self.prefill_s = 0.0
        self.error = "unfinished"
        self.target = 0  # which of several targets it was sent to


def _per_node(nodes: np.ndarray[Any, Any], ok: np.ndarray[Any, Any], meets: np.ndarray[Any, Any],
              ttft: np.ndarray[Any, Any], tpot: np.ndarray[Any, Any],
              requests: int) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for node in sorted(set(nodes.tolist())):
        mask = nodes == node
        done = mask & ok
        out[node] = {
            "requests": int(mask.sum()),
            "share": round(float(mask.sum()) / requests, 6) if requests else 0.0,
            "completed": int(done.sum()),
            "ttft_p50_s": round(float(np.percentile(ttft[done], 50)), 6) if done.any() else 0.0,
            "ttft_p99_s": round(float(np.percentile(ttft[done], 99)), 6) if done.any() else 0.0,
            "tpot_p50_s": round(float(np.percentile(tpot[done], 50)), 6) if done.any() else 0.0,
            "tpot_p99_s": round(float(np.percentile(tpot[done], 99)), 6) if done.any() else 0.0,
            "slo_attainment": round(float(meets[mask].mean()), 6) if mask.any() else 0.0,
        }
    return out


def summarize(records: list[Record], cfg: BenchConfig, elapsed_s: float) -> dict[str, Any]:
    """One result entry in the shape of ``tailguard sim --json`` (see the module docstring)."""
    n = len(records)
    arrival = np.fromiter((r.arrival for r in records), float, n)
    first = np.fromiter((r.first for r in records), float, n)
    end = np.fromiter((r.end for r in records), float, n)
    tokens = np.fromiter((r.tokens for r in records), float, n)
    errors = [r.error for r in records]
    nodes = np.array([r.node for r in records], dtype=object)
    ok = np.array([e == OK for e in errors], dtype=bool)
    rejected = sum(1 for e in errors if e == "http_429")
    ttft = np.where(ok, first - arrival, 0.0)
    tpot = np.where(ok & (tokens > 1), (end - first) / np.maximum(tokens - 1, 1), 0.0)
    e2e = end - arrival
    meets = ok & (ttft <= cfg.slo.ttft_s) & (tpot <= cfg.slo.tpot_s)
    # As in the simulator's report: a request cut off by the drain enters the
    # TTFT statistics with what it had waited, so a stalled server cannot hide
    # its queue by never answering.
    cut = np.array([e == "unfinished" for e in errors], dtype=bool)
    waited = np.where(first[cut] >= 0, first[cut], elapsed_s) - arrival[cut]
    ttft_stats = np.concatenate([ttft[ok], waited])
    span = cfg.duration_s
    completed = int(ok.sum())
    by_kind: dict[str, int] = {}
    for e in errors:
        if e != OK:
            by_kind[e] = by_kind.get(e, 0) + 1
    offered = cfg.rate if cfg.rate is not None else n / span
    result: dict[str, Any] = {
        "offered_rps": round(offered, 6),
        "mode": "closed" if cfg.concurrency is not None else "open",
        "concurrency": cfg.concurrency,
        "stream": cfg.stream,
        "duration_s": span,
        "elapsed_s": round(elapsed_s, 3),
        "requests": n,
        "completed": completed,
        "failed": n - completed - rejected,
        "rejected": rejected,
        "unfinished": by_kind.get("unfinished", 0),
        "errors": dict(sorted(by_kind.items())),
        "throughput_rps": round(completed / span, 6),
        "output_tokens_per_s": round(float(tokens[ok].sum()) / span, 6),
        "ttft_s": summary(ttft_stats),
        "tpot_s": summary(tpot[ok]),
        "e2e_s": summary(e2e[ok]),
        "slo_attainment": round(float(meets.mean()), 6) if n else 0.0,
        "goodput_rps": round(float(meets.sum()) / span, 6),
        "per_node": _per_node(nodes, ok, meets, ttft, tpot, n),
    }
    reported = [r for r, good in zip(records, ok, strict=True) if good and r.cached >= 0]
    if reported:
        prompt = sum(r.prompt_reported or r.input for r in reported)
        cached = sum(r.cached for r in reported)
        hit = np.array([r.cached > 0 for r in reported])
        t = np.array([r.first - r.arrival for r in reported])
        result["prefix"] = {
            "hit_rate": round(cached / prompt, 6) if prompt else 0.0,
            "requests_hit": round(float(hit.mean()), 6),
            "prefill_tokens_saved": cached,
            "ttft_cached_s": summary(t[hit]),
            "ttft_uncached_s": summary(t[~hit]),
        }
    remote = [r for r, good in zip(records, ok, strict=True) if good and r.prefill_node]
    if remote:  # a P/D fleet: how much went through two legs, and the prefill leg's time
        legs = np.array([r.prefill_s for r in remote])
        ttft_remote = np.array([r.first - r.arrival for r in remote])
        by: dict[str, int] = {}
        for r in remote:
            assert r.prefill_node is not None
            by[r.prefill_node] = by.get(r.prefill_node, 0) + 1
        result["disaggregated"] = {
            "remote_share": round(len(remote) / completed, 6),
            "prefill_leg_s": summary(legs),
            # what the decode side added to a remote prompt's first token: the KV
            # transfer, the decode node's queue, its first step, the gateway's hops
            "after_prefill_s": summary(ttft_remote - legs),
            "per_prefill_node": dict(sorted(by.items())),
        }
    return result
