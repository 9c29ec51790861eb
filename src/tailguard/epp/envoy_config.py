"""An Envoy bootstrap in front of a fleet, with or without tailguard as its endpoint picker.

``tailguard envoy-config --config fleet.yaml`` prints it; the tests and
``benchmarks/epp.py`` run a real Envoy on it; ``deploy/envoy/`` ships one
with the explanation. Two shapes:

* ``picker=None``: Envoy alone, ``LEAST_REQUEST`` over the fleet's nodes
  (the baseline the endpoint picker must beat);
* ``picker="host:port"``: the ``ext_proc`` HTTP filter calls tailguard for
  every request (request headers and a full-duplex streamed body). With
  ``observer`` (the default) a second ``ext_proc`` filter after it, in
  observability mode, sends tailguard the routed request's headers and the
  response (headers and a streamed body) without waiting for replies, so the
  response reaches the client at Envoy's own pace; without it the picker's
  filter takes the response too (each message waits for its reply). The cluster
  routes with the ``override_host`` load-balancing policy, which reads the
  picker's ``x-gateway-destination-endpoint`` (dynamic metadata
  ``envoy.lb``, or the header) and, on each retry, takes the next endpoint
  of its list. The route adds ``x-tailguard-node`` (the node id, from the
  endpoint's metadata) to the response, and without the observer
  ``x-gateway-destination-endpoint-served`` (the address Envoy dialled),
  which the picker strips again.

Why not an ``ORIGINAL_DST`` cluster (``use_http_header``)? It routes on one
address only: its retries can only go back to the same endpoint, so the
picker's fallback list would be lost. Data planes built that way still exist
(older llm-d and GIE guides): ``original_dst=True`` writes one, for a picker
run with ``--single-endpoint``. ``override_host`` walks it, as
Istio's and Envoy Gateway's InferencePool support do; its cluster lists the
pool's endpoints (on Kubernetes: from the InferencePool, via EDS).

Envoy's ``failure_mode_allow``: with the picker down, true lets requests
through to the fallback policy (least request over the same endpoints);
false answers them with ``status_on_error`` (503). Envoy cannot let a
request through once its body has streamed to a picker that failed (it
keeps no copy), so with ``failure_mode_allow`` the request body is sent
``BUFFERED`` (Envoy holds it, up to the fleet's ``max_body_bytes``; the
routing rides on the body's reply) rather than ``FULL_DUPLEX_STREAMED``.
"""

from __future__ import annotations

from typing import Any

import yaml

from tailguard.config.fleet import FleetConfig

HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
EXT_PROC = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
OVERRIDE_HOST = ("type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3"
                 ".OverrideHost")
LEAST_REQUEST = ("type.googleapis.com/envoy.extensions.load_balancing_policies.least_request.v3"
                 ".LeastRequest")
HTTP_OPTIONS = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
UPSTREAM_TLS = ("type.googleapis.com/envoy.extensions.transport_sockets.tls.v3"
                ".UpstreamTlsContext")
DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _endpoints(hosts: list[tuple[str, int]], names: list[str] | None = None) -> dict[str, Any]:
    """A load assignment; ``names``: each endpoint's tailguard node id, as its metadata."""
    eps: list[dict[str, Any]] = [{"endpoint": {"address": _address(h, p)}} for h, p in hosts]
    for ep, name in zip(eps, names or (), strict=False):
        ep["metadata"] = {"filter_metadata": {"tailguard": {"node": name}}}
    return {"endpoints": [{"lb_endpoints": eps}]}


def _least_request() -> dict[str, Any]:
    return {"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.least_request",
        "typed_config": {"@type": LEAST_REQUEST}}}]}


def _upstream_options(protocol: str, idle_timeout: str | None = None) -> dict[str, Any]:
    """A cluster's upstream protocol (``http`` or ``http2``) and connection idle timeout."""
    options: dict[str, Any] = {"@type": HTTP_OPTIONS,
                               "explicit_http_config": {f"{protocol}_protocol_options": {}}}
    if idle_timeout is not None:
        options["common_http_protocol_options"] = {"idle_timeout": idle_timeout}
    return {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": options}


def _engines_cluster(config: FleetConfig, picker: bool,
                     original_dst: bool = False) -> dict[str, Any]:
    """The engines; with a picker, routed to the endpoint it names (override_host, or
    ``original_dst``: the address in the header, one endpoint)."""
    if picker and original_dst:
        return {"name": "engines", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
                "connect_timeout": "1s",
                "original_dst_lb_config": {"use_http_header": True,
                                           "http_header_name": DESTINATION},
                "typed_extension_protocol_options": _upstream_options("http",
                                                                      idle_timeout="4s")}
    nodes = [(n.host, n.port) for n in config.nodes]
    cluster: dict[str, Any] = {
        "name": "engines", "type": "STATIC", "connect_timeout": "1s",
        "load_assignment": {"cluster_name": "engines",
                            **_endpoints(nodes, [n.id for n in config.nodes])},
        "typed_extension_protocol_options": _upstream_options("http", idle_timeout="4s"),
    }
    if not picker:
        cluster["load_balancing_policy"] = _least_request()
        return cluster
    cluster["load_balancing_policy"] = {"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.override_host",
        "typed_config": {
            "@type": OVERRIDE_HOST,
            "override_host_sources": [
                {"metadata": {"key": "envoy.lb", "path": [{"key": DESTINATION}]}},
                {"header": DESTINATION}],
            "fallback_policy": _least_request()}}}]}
    return cluster


def _epp_cluster(picker: str, tls: bool = False) -> dict[str, Any]:
    epp_host, _, epp_port = picker.rpartition(":")
    cluster: dict[str, Any] = {
        "name": "epp", "type": "STATIC", "connect_timeout": "1s",
        "load_assignment": {"cluster_name": "epp", **_endpoints([(epp_host, int(epp_port))])},
        "typed_extension_protocol_options": _upstream_options("http2"),
    }
    if tls:  # as the Inference Gateways dial it: TLS, the certificate not validated
        cluster["transport_socket"] = {"name": "envoy.transport_sockets.tls", "typed_config": {
            "@type": UPSTREAM_TLS, "common_tls_context": {"alpn_protocols": ["h2"]}}}
    return cluster


def _ext_proc_filters(observer: bool, failure_mode_allow: bool, message_timeout_s: float,
                      response_body_mode: str = "STREAMED",
                      response_trailer_mode: str = "SKIP") -> list[dict[str, Any]]:
    """The picker's filter, then the observer's where there is one."""
    filters: list[dict[str, Any]] = []
    grpc_service = {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "60s"}
    response = {"response_header_mode": "SEND", "response_body_mode": response_body_mode,
                "response_trailer_mode": response_trailer_mode}
    skip = {"response_header_mode": "SKIP", "response_body_mode": "NONE",
            "response_trailer_mode": "SKIP"}
    filters.append({"name": "envoy.filters.http.ext_proc", "typed_config": {
        "@type": EXT_PROC,
        "grpc_service": grpc_service,
        "failure_mode_allow": failure_mode_allow,
        "status_on_error": {"code": 503},
        "message_timeout": f"{message_timeout_s:g}s",
        "max_message_timeout": f"{message_timeout_s:g}s",
        "processing_mode": {
            "request_header_mode": "SEND",
            "request_body_mode": "BUFFERED" if failure_mode_allow else "FULL_DUPLEX_STREAMED",
            "request_trailer_mode": "SKIP" if failure_mode_allow else "SEND",
            **(skip if observer else response)},
        "metadata_options": {
            "forwarding_namespaces": {"untyped": ["envoy.lb", "envoy.lb.subset_hint"]},
            "receiving_namespaces": {"untyped": ["envoy.lb"]}},
    }})
    if observer:
        # The response in observability mode: Envoy sends it without waiting. After
        # the picker, so that its stream opens once the request is routed, off the
        # routing's path: first in the chain, the picker process would take its
        # headers before the picker's own.
        filters.append({"name": "envoy.filters.http.ext_proc", "typed_config": {
            "@type": EXT_PROC, "grpc_service": grpc_service, "observability_mode": True,
            "failure_mode_allow": True, "deferred_close_timeout": "1s",
            "processing_mode": {"request_header_mode": "SEND", "request_body_mode": "NONE",
                                "request_trailer_mode": "SKIP", "response_header_mode": "SEND",
                                "response_body_mode": "STREAMED",
                                "response_trailer_mode": "SKIP"}}})
    return filters


def _virtual_host(retries: int, picker: bool, observer: bool) -> dict[str, Any]:
    route: dict[str, Any] = {
        "cluster": "engines",
        "timeout": "0s",  # streams run as long as they stream; tailguard's idle rules stay
        "retry_policy": {
            "retry_on": "connect-failure,refused-stream,reset-before-request,5xx,"
                        "retriable-status-codes",
            "retriable_status_codes": [429],
            "num_retries": retries,
            "per_try_timeout": "0s",
        },
    }
    vhost: dict[str, Any] = {"name": "inference", "domains": ["*"],
                             "routes": [{"match": {"prefix": "/"}, "route": route}],
                             "include_attempt_count_in_response": True}
    if picker:
        # Which node served it: its id from the endpoint's metadata (as tailguard
        # serve's answers say), and, where the picker can strip it again, its address.
        vhost["response_headers_to_add"] = [
            {"header": {"key": "x-tailguard-node", "value": "%UPSTREAM_METADATA(tailguard:node)%"}}]
        if not observer:
            vhost["response_headers_to_add"].append(
                {"header": {"key": SERVED, "value": "%UPSTREAM_REMOTE_ADDRESS%"}})
    return vhost


def envoy_bootstrap(config: FleetConfig, *, port: int = 10000, admin_port: int = 9901,
                    picker: str | None = None, failure_mode_allow: bool = False,
                    retries: int = 2, host: str = "127.0.0.1",
                    message_timeout_s: float = 30.0, observer: bool = True,
                    response_body_mode: str = "STREAMED",
                    response_trailer_mode: str = "SKIP",
                    original_dst: bool = False, picker_tls: bool = False) -> dict[str, Any]:
    """The bootstrap as a dict (``yaml.safe_dump`` it). ``retries``: Envoy's retries,
    the picker's fallbacks (``retries.attempts - 1`` of the pool); ``message_timeout_s``
    bounds one picker reply, and so how long a request may wait in tailguard's queue.
    ``response_body_mode``/``response_trailer_mode``: how the one-filter shape (no
    observer) sends the response (``FULL_DUPLEX_STREAMED`` and ``SEND``: GIE's
    reference deployments). ``original_dst``: an ``ORIGINAL_DST`` cluster routing on
    the header alone (run the picker with ``--single-endpoint``). ``picker_tls``:
    dial the picker over TLS (``tailguard epp --grpc-tls-cert``)."""
    clusters = [_engines_cluster(config, picker is not None, original_dst)]
    filters: list[dict[str, Any]] = []
    if picker is not None:
        filters = _ext_proc_filters(observer, failure_mode_allow, message_timeout_s,
                                    response_body_mode, response_trailer_mode)
        clusters.append(_epp_cluster(picker, picker_tls))
    filters.append({"name": "envoy.filters.http.router", "typed_config": {"@type": ROUTER}})
    vhost = _virtual_host(retries, picker is not None, observer)
    hcm = {"@type": HCM, "stat_prefix": "inference", "codec_type": "AUTO",
           "stream_idle_timeout": "300s",
           # Envoy's own failures (no upstream, a reset, an overflow: a response flag
           # is set) in OpenAI's error shape; the picker's answers are left as they are.
           "local_reply_config": {"mappers": [{
               "filter": {"response_flag_filter": {}},
               "body_format_override": {"json_format": {"error": {
                   "message": "%LOCAL_REPLY_BODY%", "type": "server_error",
                   "param": None, "code": "%RESPONSE_CODE_DETAILS%"}}}}]},
           "route_config": {"name": "inference", "virtual_hosts": [vhost]},
           "http_filters": filters}
    return {
        "admin": {"address": _address(host, admin_port)},
        "static_resources": {
            "listeners": [{"name": "inference", "address": _address(host, port),
                           # room for a buffered body as large as the fleet accepts
                           "per_connection_buffer_limit_bytes": config.max_body_bytes + 65536,
                           "filter_chains": [{"filters": [{
                               "name": "envoy.filters.network.http_connection_manager",
                               "typed_config": hcm}]}]}],
            "clusters": clusters,
        },
    }


def envoy_yaml(config: FleetConfig, **kwargs: Any) -> str:
    return yaml.safe_dump(envoy_bootstrap(config, **kwargs), sort_keys=False)


__all__ = ["envoy_bootstrap", "envoy_yaml"]
