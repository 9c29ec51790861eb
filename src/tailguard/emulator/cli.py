"""``tailguard emulate``: serve the local nodes of a fleet file as emulated engines.

Runs until SIGINT/SIGTERM, then closes every port and connection. Exit code 2
with one line naming the field for a bad fleet file or flag.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import signal
from typing import Any

from rich.console import Console
from rich.table import Table

from tailguard.emulator.fleet import EmulatedNode, load_emulated_nodes
from tailguard.emulator.server import Emulator
from tailguard.errors import ConfigError
from tailguard.traffic.workload import LengthDist


def _speed(text: str) -> float:
    if text.lower() in ("inf", "instant"):
        return math.inf
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def add_parser(sub: Any) -> None:
    p = sub.add_parser("emulate", help="serve emulated GPU engines for the local nodes of a fleet",
                       description=__doc__)
    p.add_argument("--fleet", required=True, help="fleet file (the one `tailguard serve` reads)")
    p.add_argument("--base-port", type=int, default=8100,
                   help="first port for local nodes whose url has no port (default 8100)")
    p.add_argument("--speed", type=_speed, default=1.0,
                   help="time scale: 2 runs twice as fast; 'inf' answers at once (default 1)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--default-max-tokens", type=int, default=256,
                   help="tokens generated when a request gives no max_tokens (default 256)")
    p.add_argument("--eos", metavar="DIST",
                   help="draw answer lengths (capped at max_tokens) from a distribution, "
                        "e.g. azure-conv or lognormal:4.5,0.6; default: exactly max_tokens")
    p.add_argument("--seed", type=int, default=0, help="seed of error faults and --eos draws")
    p.set_defaults(func=cmd_emulate)


def _table(nodes: list[EmulatedNode], emu: Emulator) -> Table:
    table = Table(title="emulated engines (Ctrl-C stops)")
    for col in ("node", "gpu", "tp", "models", "url", "KV tokens", "faults"):
        table.add_column(col)
    for n in nodes:
        srv = emu.server(n.id)
        table.add_row(n.id, n.gpu, str(n.tp), ", ".join(n.models), srv.url,
                      str(srv.driver.kv_capacity_tokens), str(len(n.faults)))
    return table


async def serve(nodes: list[EmulatedNode], speed: float, host: str, default_max_tokens: int,
                eos: LengthDist | None, seed: int, console: Console | None = None) -> None:
    """Run the emulator until SIGINT or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with Emulator(nodes, speed=speed, host=host, default_max_tokens=default_max_tokens,
                            eos=eos, seed=seed) as emu:
            if console is not None:
                console.print(_table(nodes, emu))
            await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def cmd_emulate(args: argparse.Namespace) -> int:
    from tailguard.traffic.length_args import parse_length_arg

    if args.default_max_tokens < 1:
        raise ConfigError("--default-max-tokens", "must be >= 1")
    nodes = load_emulated_nodes(args.fleet, args.base_port)
    eos = parse_length_arg(args.eos, "--eos", "output_tokens") if args.eos else None
    coro = serve(nodes, args.speed, args.host, args.default_max_tokens, eos, args.seed, Console())
    try:
        import uvloop

        uvloop.run(coro)
    except ImportError:  # pragma: no cover - uvloop is missing on Windows
        asyncio.run(coro)
    return 0
