"""Straggler and failure detection, and the quarantine lifecycle of a node.

A *straggler* is a node slow **for its own hardware**: a T4 running at T4
speed is healthy (the router already prices it by its roofline prior and its
class's learned speed); an A100 running at 40% of what its peers deliver is
not. The detector never compares a node with the fleet's fastest node.

Signal
------
Every first token and every successful finish gives the balancer one latency
sample and what the roofline model expected for it *at the batch and backlog
it met* (:mod:`tailguard.core.predict`): ``x = log(observed/expected)``,
separately for prefill (TTFT) and decode (TPOT). The roofline is a prior, not
the truth: real engines add fixed per-request overheads (tokenising, HTTP,
scheduling) that dominate a short or cached prompt, and on a CPU the time per
token grows with the batch, which a GPU roofline does not assume (measured on
llama.cpp with one thread: TPOTs at batch 2 1.6-2.5x those at batch 1). So a
sample is never judged against the roofline itself but against the same kind
of sample on healthy peers: each sample falls into a **bucket** (decode: the
running batch in powers of two; prefill: the tokens computed before the
first token, the backlog ahead plus the prompt's uncached part, in powers of
two, times the batch it joined in powers of two, since a short prompt's first
token waits for the step that also computes its neighbours' prompts; a
request that waited for an engine slot, which the roofline does not price,
has buckets of its own), and its residual is

    r = x - reference(bucket)

with the reference

* the **median of the other healthy nodes of its GPU class** in that bucket,
  each node's recent level there (the mean of its last 16 samples there,
  whose weight decays with a half-life of ``level_half_life_s``, 15 s, while
  the bucket is quiet): identical cards at the same batch share the
  roofline's error, and what every node meets at the same moment (a burst of
  load, a shared host's contention), which then cancel, and a node slow *from its first
  request* is compared with its peers from its first request; two nodes are
  enough (the slower one is the outlier: nobody is flagged for being fast);
* else, for decode, the node's **own history** in that bucket: its level the
  last time it was healthy and showed no excess (a class of one; TTFT is
  judged against peers only, see ``prefill_slow_ratio``), or its peers' older
  levels there (at most ``FRESH`` intervals old) where those are slower: a
  history keeps a node's fastest moments, which on a shared host are its
  quiet ones. A history rises by
  at most 1.1x an interval (``HISTORY_RISE``): a slowdown's first seconds can
  close an interval before they have moved the CUSUM, and taken whole they
  became the reference for the rest of it. A class of one also prices the
  prompt chunks in its decode pieces at its prefill speed as of its last
  clean interval (:meth:`SampleIntake.judged_prefill_slowdown`), since its
  class's learned speed is its own and would learn a throttle too; a node in
  a larger class whose TTFT already reads slow prices them at its peers'
  prefill speed, not at the class's mean with its own. A class of one's
  window counts its whole ratio, its decode share weighing the evidence,
  with windows mostly decode kept apart (``MOSTLY_DECODE``), and its history
  and clean prefill speed rise only with no excess under way at all
  (:meth:`SampleIntake.on_decode`, :meth:`OutlierDetector._close_interval`);
* else nothing: the sample only teaches the node's own level.

Evidence, not a fixed sample count
----------------------------------
Each node keeps, per kind, Page's CUSUM (Page 1954, "Continuous inspection
schemes") of its residuals in units of its own sample noise ``sigma`` (an EWMA
of the spread around its recent mean, floored at ``sigma_floor``):

    S = min(2h, max(0, S + (r - k) / sigma)),   k = 0.75 log(slow_ratio)

so every sample slower than ``exp(k)`` (1.36x at the default ``slow_ratio``
1.5) adds evidence and every faster one removes it, whatever the request rate;
one sample adds at most 3 (a GC pause or a cold cache is one sample, not a
verdict).
The kind is *flagged* when ``S >= h`` (``evidence``, 6), at least
``min_samples`` (2) samples make up the current excess, and the node's recent
slowness ``s = exp(EWMA of r)`` (about the last two or three samples) exceeds
``slow_ratio`` (TTFT: ``prefill_slow_ratio``, 3). The two guards cover each other: the CUSUM needs sustained
evidence, so one slow burst is not enough; the recent slowness makes the flag
fall as soon as the node is fast again (the capped CUSUM alone would take a
dozen samples to drain). At ten samples per interval a node 2.5x slow for its
class (``r = 0.92``, ``sigma`` 0.15) crosses ``h`` in two samples; at under one
request per second the same evidence takes as many seconds as the samples take
to arrive, and an interval with no new sample gives no verdict at all.
Verdicts come at each interval's close and act after K flagged intervals, but a
decode flag (at ``sure_ratio``, by default the flag's own 1.5x) degrades a
healthy node at once when its excess has outlived the requests that showed it
first (a slow sample over work begun after the excess's first sample had ended:
a stall slows every request in flight at once, and the work after it runs at
full speed). TPOT carries no queue; at a few samples a minute the wait for a
second interval was most of the detection time (a llama.cpp server at a third
of its speed, read 2.1x slow beside peers sharing its two cores, took over 20 s
that way; acting at once, the simulated healthy hour still has no detection).

A streamed answer's decode is judged in pieces as it runs (``segment_s``, 1 s,
and at least 8 tokens each, where the driver reports the stream's progress, as
the gateway and the simulator do): a node slowed mid-answer shows within a
second or two of the answers running on it, not when they end. The decode
samples of one node and batch bucket within one such window are one sample
(:meth:`OutlierDetector.on_decode`): they timed the same moments of the node.

Why ``k`` is 0.75 of the threshold and not Page's half: identical SKUs differ by
~8% on average (SC'22, "Not All GPUs Are Created Equal") and a simulated fleet
spreads them +-10%: a card 1.22x slower than its class median must drift
*down*, or a zero-drift CUSUM would reach ``h`` by chance over an hour.

Worked example: an A100 throttled to 40% among three healthy ones, decode
``sigma`` 0.15 (a simulated fleet's). Its residuals are ``log(2.5) = 0.92``; each
would add ``(0.92 - 0.30) / 0.15 = 4.1``, capped at 3, so ``S`` passes ``h`` at
the second sample and is 9 after three, and ``s``, which moves half of the way
per sample, is then ``2.5 ** (1 - 0.5 ** 3) = 2.23x``: flagged. A healthy
peer 10% slower than the median (``r = 0.10``) moves ``S`` by -1.3 per sample
and stays at 0.

Failures (Envoy outlier detection): ``consecutive_failures`` (5) node failures
in a row (connect failure, timeout, 5xx; a 429 or a client's own error says
nothing about the node), a ``failure_ratio`` (0.25) of at least
``failure_min_requests`` (20) requests over the last ``failure_window``
intervals (6: 30 s; Envoy's failure-percentage check, with a threshold low
enough to catch a node failing a third of its requests, and a window long
enough that a node failing 5% does not reach it by chance), or a **hang**: requests
waiting for their first token and no first token nor finish on the node for
``hang_s`` (120 s: the gateway sees no first token of a non-streamed answer,
so a lone long non-streamed generation must not look like a hang).

Lifecycle
---------
::

    healthy --K flagged intervals--> degraded --still >= quarantine_ratio--> quarantined
       ^  \\--failures/hang----------------------------------------------^   |
       |           (recover_intervals clean)                               backoff
       +------------- probation (canary weight, slow-start ramp) <---------+
                          \\--flagged or failing--> quarantined (n+1)

* **degraded**: still routed, ``weight_scale = 1/s`` (the policy divides its
  cost by it, so the node is priced at the speed it really has), refreshed
  every interval; ``recover_intervals`` clean intervals make it healthy (an
  interval without samples multiplies its weight by ``regain_factor``, up to
  1, so the router tries it again; only clean samples make it healthy). A
  slow node still delivers capacity the pool may need: taking a card at 40%
  out of a busy fleet makes every other node's queue longer (measured: P99
  TTFT 16x the no-fault run instead of 1.1x), so only a node at least
  ``quarantine_ratio`` (3x) slow for K more intervals, in decode *and*
  prefill, is quarantined.
* **quarantined**: no new requests (in-flight ones finish); after a backoff of
  ``base_ejection_s * 2^(n-1)`` capped at ``max_ejection_s``, times
  ``1 +- jitter`` from the injected rng (Envoy multiplies linearly; the issue
  asks for exponential), it goes on probation.
* **probation**: ``weight_scale`` ramps from ``canary_weight`` to 1 over
  ``slow_start_s`` (Envoy's slow start), and the balancer sends the node
  ``canary_share`` (2%) of the pool's requests whatever the policy prefers,
  so that probation has samples to judge; a failure trigger or a flagged
  interval at ``quarantine_ratio`` sends it back, ``n + 1`` (a milder flag
  degrades it); ``slow_start_s`` without either makes it healthy.

The **ejection cap** (Envoy's ``max_ejection_percent``, here by capacity):
quarantining a node must not take more than ``max_ejection_share`` (34%) of
any of its pools' nominal decode capacity out of rotation; past it the node
is degraded instead, and the detection is counted as *detected* but not
*enforced*. Nodes an operator cordoned, drained, or the health checks marked
down are left alone.
"""

from tailguard.core.outliers.config import OutlierConfig, PoolView
from tailguard.core.outliers.detector import OutlierDetector
from tailguard.core.outliers.evidence import NodeHealth, Verdict, decode_bucket, prefill_bucket

__all__ = ["NodeHealth", "OutlierConfig", "OutlierDetector", "PoolView", "Verdict",
           "decode_bucket", "prefill_bucket"]
