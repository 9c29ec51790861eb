"""The ext_proc side of the endpoint picker: GIE's header and metadata names,
and the protobuf messages the picker reads and sends (:mod:`tailguard.epp.picker`)."""

from __future__ import annotations

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from tailguard.adapters.api_errors import NO_NODE, NODE_HEADER, error_body

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
OBJECTIVE = "x-gateway-inference-objective"
# Disaggregated P/D behind a data plane (llm-d's convention): the request goes to the
# decode endpoint, whose routing sidecar runs the prefill leg on the endpoint named here.
PREFILLER = "x-prefiller-host-port"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
# Objective names understood without configuration (GIE's former criticality levels).
OBJECTIVES = {"critical": 0, "high": 0, "standard": 1, "normal": 1, "sheddable": 2, "low": 2}

DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
NO_BODY = processing_mode_pb2.ProcessingMode.NONE
CONTINUE_BODY = pb.ProcessingResponse(response_body=pb.BodyResponse())
CONTINUE_HEADERS = pb.ProcessingResponse(request_headers=pb.HeadersResponse())


def header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key,
                                                                  raw_value=value.encode()))


def read_headers(msg: pb.HttpHeaders) -> dict[str, str]:
    out = {}
    for h in msg.headers.headers:
        out[h.key.lower()] = h.raw_value.decode("latin-1") if h.raw_value else h.value
    return out


def metadata(req: pb.ProcessingRequest, namespace: str, key: str) -> list[str] | None:
    """A string or list of strings under ``metadata_context.filter_metadata[namespace][key]``."""
    if not req.HasField("metadata_context"):
        return None
    ns = req.metadata_context.filter_metadata.get(namespace)
    if ns is None or key not in ns.fields:
        return None
    v = ns.fields[key]
    kind = v.WhichOneof("kind")
    if kind == "string_value":  # a header_to_metadata filter writes one comma-joined string
        return [e.strip() for e in v.string_value.split(",") if e.strip()]
    if kind == "list_value":
        return [e.string_value for e in v.list_value.values if e.string_value]
    return []


def immediate(status: int, message: str, code: str, headers: dict[str, str] | None = None,
              param: str | None = None) -> pb.ProcessingResponse:
    """An ``ImmediateResponse``: Envoy answers the client with an OpenAI-style error."""
    hdrs = {"content-type": "application/json", NODE_HEADER: NO_NODE, **(headers or {})}
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status={"code": status},
        headers=pb.HeaderMutation(set_headers=[header(k, v) for k, v in hdrs.items()]),
        body=error_body(status, message, code, param), details=code))


def routing(endpoints: str, key: str | None, duplex: bool,
            prefiller: str | None = None) -> pb.ProcessingResponse:
    """The reply that routes to ``endpoints`` (``ip:port,...``): the header and
    ``dynamic_metadata["envoy.lb"]``, on the headers' reply (full duplex) or the
    body's (buffered); ``key``: the upstream's API key, sent as its bearer token;
    ``prefiller``: the prefill endpoint of a disaggregated request (:data:`PREFILLER`)."""
    set_headers = [header(DESTINATION, endpoints)]
    if key:
        set_headers.append(header("authorization", f"Bearer {key}"))
    if prefiller:
        set_headers.append(header(PREFILLER, prefiller))
    common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=set_headers))
    meta = struct_pb2.Struct()
    meta.update({LB_NAMESPACE: {DESTINATION: endpoints}})
    if duplex:
        return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common),
                                     dynamic_metadata=meta)
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common),
                                 dynamic_metadata=meta)


def body_echo(body: bytes) -> pb.ProcessingResponse:
    """The request's whole body streamed back to Envoy unchanged (full duplex)."""
    return pb.ProcessingResponse(request_body=pb.BodyResponse(
        response=pb.CommonResponse(body_mutation=pb.BodyMutation(
            streamed_response=pb.StreamedBodyResponse(body=body, end_of_stream=True)))))


def streamed_body(chunk: bytes, end: bool) -> pb.ProcessingResponse:
    """A response body chunk sent back in full-duplex mode, unchanged."""
    return pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(
        body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
            body=chunk, end_of_stream=end)))))
