"""One client request as the forwarder sees it, and what its answer is counted and sent with."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web
from multidict import CIMultiDict

from tailguard.adapters.api_errors import NODE_HEADER, PREFILL_NODE_HEADER, PREFILL_TIME_HEADER
from tailguard.adapters.metrics import GatewayMetrics
from tailguard.adapters.openai_request import RoutedRequest
from tailguard.adapters.upstream import UpstreamResponse
from tailguard.config.fleet import PoolSettings

_RESPONSE_SKIP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "content-length", "date",
})
# Set once the request's status is in the metrics (a late disconnect must not count it again).
_COUNTED = web.RequestKey("tailguard_counted", int)



def count_answer(metrics: GatewayMetrics, request: web.Request, pool: str, status: int) -> None:
    """Count the request's answer, once whatever happens after (a late disconnect)."""
    if _COUNTED not in request:
        request[_COUNTED] = status
        metrics.request_done(pool, status)


@dataclass(slots=True)
class Call:
    """One client request as the forwarder sees it."""

    request: web.Request
    endpoint: str
    body: bytes
    req: RoutedRequest
    settings: PoolSettings
    headers: CIMultiDict[str]  # what goes upstream (hop-by-hop headers dropped)
    priority: int
    deadline: float  # loop time by which everything must be done (timeouts.total_s)
    t0: float  # monotonic arrival
    # Disaggregated: the node that computed the prompt, and the seconds its leg took
    # (the latest attempt's), told to the client with the answer's headers; and
    # when its answer came (monotonic).
    prefill: tuple[str, float] | None = None
    prefill_done: float = 0.0


def response_headers(resp: UpstreamResponse, node_id: str,
                     prefill: tuple[str, float] | None = None) -> CIMultiDict[str]:
    """The engine's headers less hop-by-hop ones, with the node that answered and, for
    a disaggregated request, the node that computed its prompt and its leg's time."""
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in resp.headers.items():
        if k.lower() not in _RESPONSE_SKIP:
            out.add(k, v)
    out[NODE_HEADER] = node_id
    if prefill is not None:
        out[PREFILL_NODE_HEADER] = prefill[0]
        out[PREFILL_TIME_HEADER] = f"{prefill[1]:.4f}"
    return out



__all__ = ["Call", "count_answer", "response_headers"]
