"""``tailguard serve --config fleet.yaml [--listen HOST:PORT] [--log-level LEVEL] [--log-format text|json]``.

The main CLI (:mod:`tailguard.cli`) calls :func:`add_parser`; a
:class:`~tailguard.errors.ConfigError` raised here (an invalid fleet file or
``--listen``) becomes exit code 2 with one line naming the field.
"""

from __future__ import annotations

import argparse
import os


def cmd_serve(args: argparse.Namespace) -> int:
    from tailguard.adapters.logs import configure_logging
    from tailguard.config.fleet import load_fleet, parse_listen
    from tailguard.gateway.server import serve

    configure_logging(args.log_level, args.log_format)
    config = load_fleet(args.config)
    host, port = config.listen
    if args.listen:
        host, port = parse_listen(args.listen, "--listen")
    return serve(config, host, port, access_log=args.access_log, record=args.record)


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("serve", help="run the gateway in front of a fleet of engines",
                       description="Run the OpenAI-compatible gateway described by a fleet "
                                   "file. SIGHUP (or editing the file) reloads it; SIGTERM "
                                   "drains and stops.")
    p.add_argument("--config", "-c", required=True, help="the fleet file (YAML)")
    p.add_argument("--listen", help="HOST:PORT to listen on (overrides the file's listen)")
    p.add_argument("--record", metavar="FILE",
                   help="write every balancer input and decision to FILE (JSONL) for "
                        "`tailguard replay`")
    p.add_argument("--log-level", default=os.environ.get("TAILGUARD_LOG_LEVEL", "info"),
                   choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", default=os.environ.get("TAILGUARD_LOG_FORMAT", "text"),
                   choices=["text", "json"],
                   help="one line per request, as key=value text or JSON (default text)")
    p.add_argument("--access-log", action="store_true",
                   help="log every request (costs throughput)")
    p.set_defaults(func=cmd_serve)
