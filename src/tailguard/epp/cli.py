"""``tailguard epp`` (the endpoint picker) and ``tailguard envoy-config`` (an Envoy in front).

    tailguard epp --config fleet.yaml --grpc-port 9002 --grpc-health-port 9003
    tailguard envoy-config --config fleet.yaml --picker 127.0.0.1:9002 > envoy.yaml
"""

from __future__ import annotations

import argparse
import os
import sys

from tailguard.errors import ConfigError


def _objectives(pairs: list[str]) -> dict[str, int]:
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or value.strip() not in ("0", "1", "2"):
            raise ConfigError("--objective", f"{pair!r}: expected NAME=PRIORITY, PRIORITY 0 "
                                             "(high), 1 or 2 (low)")
        out[name.strip()] = int(value)
    return out


def cmd_epp(args: argparse.Namespace) -> int:
    import asyncio

    from tailguard.adapters.logs import configure_logging
    from tailguard.config.fleet import load_fleet, parse_listen
    from tailguard.epp.server import serve_epp

    configure_logging(args.log_level, args.log_format)
    config = load_fleet(args.config)
    http_host, http_port = config.listen
    if args.listen:
        http_host, http_port = parse_listen(args.listen, "--listen")
    objectives = _objectives(args.objective or [])
    tls = None
    if (args.grpc_tls_cert is None) != (args.grpc_tls_key is None):
        raise ConfigError("--grpc-tls-key", "give --grpc-tls-cert and --grpc-tls-key together")
    if args.grpc_tls_cert is not None:
        for flag, path in (("--grpc-tls-cert", args.grpc_tls_cert),
                           ("--grpc-tls-key", args.grpc_tls_key)):
            if not os.path.isfile(path):
                raise ConfigError(flag, f"no such file: {path}")
        tls = (args.grpc_tls_cert, args.grpc_tls_key)
    from tailguard.adapters.runtime import loop_factory as uvloop_factory

    # TAILGUARD_EPP_UVLOOP=0: asyncio's own loop (gRPC's asyncio support is tested on it).
    loop_factory = uvloop_factory if os.environ.get("TAILGUARD_EPP_UVLOOP", "1") != "0" else None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(serve_epp(config, args.grpc_port, args.grpc_health_port, args.grpc_host,
                             http_host, http_port, objectives, args.single_endpoint, tls))
    return 0


def cmd_envoy_config(args: argparse.Namespace) -> int:
    from tailguard.config.fleet import load_fleet
    from tailguard.epp.envoy_config import envoy_yaml

    config = load_fleet(args.config)
    sys.stdout.write(envoy_yaml(config, port=args.port, admin_port=args.admin_port,
                                picker=args.picker, failure_mode_allow=args.failure_mode_allow,
                                retries=args.retries, host=args.host,
                                observer=not args.no_observer,
                                response_body_mode=args.response_body_mode,
                                response_trailer_mode=args.response_trailer_mode,
                                original_dst=args.original_dst, picker_tls=args.picker_tls))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("epp", help="run as the endpoint picker behind Envoy (ext_proc, GIE)",
                       description="Serve Envoy's ext_proc protocol as a Gateway API Inference "
                                   "Extension endpoint picker: tailguard chooses the node, "
                                   "Envoy relays the bytes.")
    p.add_argument("--config", "-c", required=True, help="the fleet file (YAML)")
    p.add_argument("--grpc-port", type=int, default=9002, help="ext_proc port (default 9002)")
    p.add_argument("--grpc-health-port", type=int, default=9003,
                   help="gRPC health port (default 9003)")
    p.add_argument("--grpc-host", default="0.0.0.0", help="address of both gRPC ports")
    p.add_argument("--listen", help="HOST:PORT of metrics, admin and dashboard (default: the "
                                    "file's listen)")
    p.add_argument("--objective", action="append", metavar="NAME=PRIORITY",
                   help="priority of an x-gateway-inference-objective name (repeatable); "
                        "critical, standard and sheddable are known")
    p.add_argument("--grpc-tls-cert", metavar="PEM",
                   help="serve the ext_proc port over TLS with this certificate (with "
                        "--grpc-tls-key): for gateways that dial their picker over TLS")
    p.add_argument("--grpc-tls-key", metavar="PEM", help="the certificate's private key")
    p.add_argument("--single-endpoint", action="store_true",
                   help="name the chosen endpoint alone, no fallback list: for data planes "
                        "that route on x-gateway-destination-endpoint by itself (an "
                        "ORIGINAL_DST cluster)")
    p.add_argument("--log-level", default=os.environ.get("TAILGUARD_LOG_LEVEL", "info"),
                   choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", default=os.environ.get("TAILGUARD_LOG_FORMAT", "text"),
                   choices=["text", "json"])
    p.set_defaults(func=cmd_epp)

    p = sub.add_parser("envoy-config", help="print an Envoy bootstrap for a fleet",
                       description="An Envoy bootstrap routing to the fleet's nodes: with "
                                   "--picker, through tailguard as endpoint picker; without, "
                                   "Envoy's least-request alone.")
    p.add_argument("--config", "-c", required=True, help="the fleet file (YAML)")
    p.add_argument("--picker", metavar="HOST:PORT", help="the endpoint picker's ext_proc address")
    p.add_argument("--port", type=int, default=10000, help="Envoy's listener (default 10000)")
    p.add_argument("--admin-port", type=int, default=9901, help="Envoy's admin (default 9901)")
    p.add_argument("--host", default="0.0.0.0", help="address of both")
    p.add_argument("--retries", type=int, default=2, help="fallbacks Envoy walks (default 2)")
    p.add_argument("--no-observer", action="store_true",
                   help="one ext_proc filter for request and response (each response message "
                        "waits for the picker), instead of an observer in observability mode")
    p.add_argument("--failure-mode-allow", action="store_true",
                   help="with the picker down, route by least request instead of failing")
    p.add_argument("--response-body-mode", default="STREAMED",
                   choices=["NONE", "STREAMED", "BUFFERED", "BUFFERED_PARTIAL",
                            "FULL_DUPLEX_STREAMED"],
                   help="how the one filter (--no-observer) sends the response body "
                        "(FULL_DUPLEX_STREAMED with --response-trailer-mode SEND: GIE's "
                        "reference shape)")
    p.add_argument("--response-trailer-mode", default="SKIP", choices=["SEND", "SKIP"])
    p.add_argument("--picker-tls", action="store_true",
                   help="dial the picker over TLS (tailguard epp --grpc-tls-cert), its "
                        "certificate not validated, as the Inference Gateways do")
    p.add_argument("--original-dst", action="store_true",
                   help="route on the picker's header alone (an ORIGINAL_DST cluster; run "
                        "the picker with --single-endpoint)")
    p.set_defaults(func=cmd_envoy_config)
