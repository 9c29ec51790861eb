"""``tailguard bench``: a load generator for OpenAI-compatible endpoints.

See :mod:`tailguard.bench.loadgen` for what is offered and measured, and
:mod:`tailguard.traffic.length_args` for the command-line length distributions.

Programmatic use (the demo, tests)::

    cfg = BenchConfig("http://127.0.0.1:8080", rate=20, duration_s=60,
                      output_tokens=parse_length_arg("azure-conv", "--output-tokens",
                                                     "output_tokens"))
    doc = await run_bench(cfg)
    doc["results"]["bench"]["ttft_s"]["p99"]
"""

from tailguard.bench.loadgen import BenchConfig, LoadGenerator, Progress, run_bench
from tailguard.bench.summary import Record
from tailguard.traffic.length_args import length_dist_mapping, parse_length_arg

__all__ = [
    "BenchConfig",
    "LoadGenerator",
    "Progress",
    "Record",
    "length_dist_mapping",
    "parse_length_arg",
    "run_bench",
]
