"""Production trace shapes: traces generated to the published statistics of public
LLM inference traces, written in each trace's own file format.

No trace is downloaded (nothing is, at run time): an operator who has the real
file replays it as it is (``arrival: {process: trace, path: ...}``); these
shapes stand in for them in tests and benchmarks, and exercise each reader on
a file of its own format. What each shape matches, and where the numbers come
from:

=====================  ======================================================
``mooncake-conv``      Mooncake's FAST'25 conversation trace (Kimi;
                       kvcache-ai/Mooncake ``FAST25-release/traces``): 12,031
                       requests in one hour, mean prompt 12,035 tokens, mean
                       answer 343. The release gives means only: prompts are
                       drawn lognormal with sigma 1.0, answers with sigma 0.8
                       (an assumption, said here), capped at 128k tokens of
                       context; arrivals Poisson. Written as Mooncake's JSONL,
                       with a 512-token block hash per prompt block, none
                       shared (the real trace repeats 37% of its blocks: a
                       prefix cache only makes it lighter).
``azure-code``         Azure LLM inference trace 2023, code (Splitwise,
                       ISCA'24; Azure/AzurePublicDataset): 2.6 req/s, very
                       bursty (inter-arrival CV 13), prompts lognormal(7.00,
                       1.36), answers lognormal(2.79, 0.85) (mean 28), as
                       ``{dist: azure-code}`` draws them (prompts capped at
                       8,192: mean about 2,100; the trace's is 2,048).
                       Written as Azure's CSV.
``azure-conv``         The same release's conversation trace: 5.5 req/s,
                       CV 1.09, prompts lognormal(6.63, 0.99) (mean 1,155),
                       answers 0.665 lognormal(4.50, 0.55) + 0.335
                       normal(426, 69) (mean 211). Written as Azure's CSV.
``burstgpt``           BurstGPT (HPMLL/BurstGPT): Gamma arrivals of shape
                       0.25 (CV 2) at 2 req/s, Zipf(1.1) request and response
                       lengths (at most 4,096 and 2,048 tokens here).
                       Written as BurstGPT's CSV.
=====================  ======================================================

The length fits and the arrival statistics are those of ``facts.md``;
:mod:`tailguard.traffic.lengths` holds the Azure fits themselves.
"""

from __future__ import annotations

import bisect
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from tailguard.traffic.lengths import Field, LengthDist, MixtureLength, parse_length_dist
from tailguard.traffic.traces import MOONCAKE_BLOCK_TOKENS, Requests, write_trace

# The formats a shape can be written in (traffic/traces.py reads them all).
FORMATS = ("mooncake", "azure", "burstgpt", "tailguard")
LONG_CONTEXT = 131_072  # Llama 3.1's context: no prompt and answer longer


@dataclass(frozen=True, slots=True)
class ZipfLength:
    """Token counts 1..``hi`` with P(k) proportional to k^-``a`` (BurstGPT's fit)."""

    a: float
    hi: int
    name: str = "zipf"

    def _cdf(self) -> list[float]:
        acc, out = 0.0, []
        for k in range(1, self.hi + 1):
            acc += k ** -self.a
            out.append(acc)
        return [c / acc for c in out]

    def sample_many(self, rng: random.Random, n: int) -> list[int]:
        cdf = self._cdf()
        return [bisect.bisect_left(cdf, rng.random()) + 1 for _ in range(n)]

    def mean(self) -> float:
        weights = [float(k) ** -self.a for k in range(1, self.hi + 1)]
        return float(sum(k * w for k, w in enumerate(weights, 1)) / sum(weights))


Sampler = LengthDist | ZipfLength


@dataclass(frozen=True, slots=True)
class TraceShape:
    """One production trace's shape: its rate, burstiness and lengths, and its format."""

    name: str
    fmt: str  # one of FORMATS: the file format the real trace comes in
    rate: float  # mean requests per second
    cv: float  # coefficient of variation of the gaps (Gamma renewal; 1 = Poisson)
    prompts: Sampler
    answers: Sampler

    def generate(self, duration_s: float, seed: int = 0) -> Requests:
        """``duration_s`` of this trace's requests, from ``seed``."""
        rng = random.Random(f"shape:{self.name}:{seed}")
        times: list[float] = []
        t = 0.0
        shape = 1.0 / (self.cv * self.cv)
        scale = 1.0 / (self.rate * shape)
        while True:
            t += rng.gammavariate(shape, scale)
            if t >= duration_s:
                break
            times.append(t)
        prompts = self.prompts.sample_many(rng, len(times))
        answers = self.answers.sample_many(rng, len(times))
        answers = [max(1, min(o, LONG_CONTEXT - p)) for p, o in zip(prompts, answers, strict=True)]
        return Requests(times, prompts, answers)


def _azure(dist: str, field: Field) -> LengthDist:
    """The workload's own Azure fit (``{dist: azure-code}``), with its caps."""
    return parse_length_dist({"dist": dist}, "shape", field)


def _lognormal_of_mean(mean: float, sigma: float, hi: int) -> MixtureLength:
    return MixtureLength.lognormal(math.log(mean) - sigma * sigma / 2.0, sigma, 1, hi)


SHAPES: dict[str, TraceShape] = {s.name: s for s in (
    TraceShape("mooncake-conv", "mooncake", 12_031 / 3600.0, 1.0,
               _lognormal_of_mean(12_035.0, 1.0, LONG_CONTEXT - 1024),
               _lognormal_of_mean(343.0, 0.8, 4096)),
    TraceShape("azure-code", "azure", 2.6, 13.0, _azure("azure-code", "input_tokens"),
               _azure("azure-code", "output_tokens")),
    TraceShape("azure-conv", "azure", 5.5, 1.09, _azure("azure-conv", "input_tokens"),
               _azure("azure-conv", "output_tokens")),
    TraceShape("burstgpt", "burstgpt", 2.0, 2.0, ZipfLength(1.1, 4096), ZipfLength(1.1, 2048)),
)}

# Azure's traces stamp requests with wall-clock times of their day.
_AZURE_EPOCH = datetime(2023, 11, 16, 18, 0, 0)


def _write_azure(out: Callable[[str], object], reqs: Requests) -> None:
    out("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    for t, n_in, n_out in zip(reqs.arrival_s, reqs.input_tokens, reqs.output_tokens,
                              strict=True):
        stamp = (_AZURE_EPOCH + timedelta(seconds=t)).strftime("%Y-%m-%d %H:%M:%S.%f")
        out(f"{stamp}0,{n_in},{n_out}\n")  # seven fractional digits, as Azure writes them


def _write_burstgpt(out: Callable[[str], object], reqs: Requests) -> None:
    out("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n")
    for t, n_in, n_out in zip(reqs.arrival_s, reqs.input_tokens, reqs.output_tokens,
                              strict=True):
        out(f"{t:.3f},ChatGPT,{n_in},{n_out},{n_in + n_out},Conversation log\n")


def _write_mooncake(out: Callable[[str], object], reqs: Requests) -> None:
    block = 0
    for t, n_in, n_out in zip(reqs.arrival_s, reqs.input_tokens, reqs.output_tokens,
                              strict=True):
        n_blocks = -(-n_in // MOONCAKE_BLOCK_TOKENS)
        row = {"timestamp": int(t * 1000.0), "input_length": n_in, "output_length": n_out,
               "hash_ids": list(range(block, block + n_blocks))}
        block += n_blocks
        out(json.dumps(row) + "\n")


def write_shape(path: str | Path, reqs: Requests, fmt: str) -> None:
    """Write ``reqs`` as a trace file of format ``fmt`` (one of FORMATS)."""
    if fmt == "tailguard":
        write_trace(path, reqs)
        return
    writers = {"azure": _write_azure, "burstgpt": _write_burstgpt, "mooncake": _write_mooncake}
    if fmt not in writers:
        raise ValueError(f"unknown trace format {fmt!r}; one of {', '.join(FORMATS)}")
    with Path(path).open("w", encoding="utf-8") as f:
        writers[fmt](f.write, reqs)


__all__ = ["FORMATS", "SHAPES", "TraceShape", "ZipfLength", "write_shape"]
