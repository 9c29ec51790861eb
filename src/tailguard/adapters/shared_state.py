"""Gateway replicas sharing fleet state through Redis (``shared_state:`` in the fleet file).

Every ``period_s`` (0.25 s) a background task makes one round trip to Redis:
a Lua script renews (or takes) the leader's lease, stores this replica's
report (``Balancer.report``, plus its budgets) under a key that expires
after ``ttl_s``, keeps the set of live replicas, and returns the others'
reports and the leader's id; in the same pipeline it writes the operator
actions taken here (cordon, drain, uncordon, resume) and reads everyone's.
The reports go into the balancer (``Balancer.on_peers``, recorded like any
input; ``core/shared.py`` says what is merged). The request path never
touches Redis: it reads what the last merge left in the balancer.

Keys (``NS`` is ``namespace``, default ``tailguard``)::

    NS:leader                  the leading replica's id (PX ttl_s)
    NS:replica:ID              a replica's report, JSON (PX ttl_s)
    NS:replicas                live replica ids, scored by expiry (server time, ms)
    NS:ops                     node id -> the last operator action, JSON
    NS:remediate:NODE:RULE     a remediation's lease (PX the rule's cooldown)

Redis down or slow (a sync over ``timeout_s``): the replica logs it once,
``tailguard_shared_state_up`` reads 0, and it serves on: for ``ttl_s`` on
the others' last reports as they were, then on those frozen loads and shares
(the others are most likely still serving as they were) with its own
detector deciding, since no leader's word can reach it. When Redis answers
again the next sync resumes everything (a leader is elected anew, followers
adopt its states). A replica that dies stops renewing its keys: its share
of every node's load expires from the others' view within ``ttl_s``.

Every report and operator action read from the store is untrusted input:
it is parsed through :mod:`tailguard.config.wire` (types, finite values,
ranges, sizes) and, with ``key_env`` set, must carry a valid HMAC-SHA256 of
one of the shared keys over its namespace, kind, subject (replica or node id)
and body, and a report must be newer than the last one seen from its sender.
A refused entry is dropped whole, counted
(``tailguard_shared_state_rejected_total{reason}``) and logged at most once a
minute per sender; it never reaches the request path.

Budgets: each replica's retry and hedge budgets earn on its own requests;
every replica may also borrow ``1/k`` of the others' published balance
(``k`` replicas), spending into debt that the others then see, so a
replica whose clients hit a failing node can fail over on the whole fleet's
budget while the replicas together stay within about one budget.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import secrets
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

from tailguard.config.shared_state import SharedStateConfig
from tailguard.config.wire import WireError, parse_operator_action, parse_report
from tailguard.core.events import Event
from tailguard.core.fleet import NodeState

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from tailguard.adapters.live_fleet import LiveFleet

log = logging.getLogger("tailguard.adapters.shared_state")

# One round trip: renew or take the lease, store the report, prune and list the
# live replicas, return the leader's id and the others' reports (id, report, ...).
_SYNC = """
local ns, me, report, ttl = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lk = ns .. ':leader'
local leader = redis.call('GET', lk)
if leader == me then
  redis.call('PEXPIRE', lk, ttl)
elseif not leader then
  redis.call('SET', lk, me, 'PX', ttl)
  leader = me
end
redis.call('SET', ns .. ':replica:' .. me, report, 'PX', ttl)
local set = ns .. ':replicas'
redis.call('ZADD', set, now + ttl, me)
redis.call('ZREMRANGEBYSCORE', set, '-inf', now)
local out = {leader}
for _, id in ipairs(redis.call('ZRANGE', set, 0, -1)) do
  if id ~= me then
    local r = redis.call('GET', ns .. ':replica:' .. id)
    if r then
      table.insert(out, id)
      table.insert(out, r)
    end
  end
end
return out
"""

# Operator states a replica shares; "healthy" ends a cordon or a drain.
OPERATOR_STATES = (NodeState.CORDONED, NodeState.DRAINING, NodeState.HEALTHY)
# A signed report older than this (the sender's clock) is a replay, not news.
MAX_REPORT_AGE_S = 60.0
REJECTION_LOG_EVERY_S = 60.0


class Seal:
    """Signs what this replica writes and checks what it reads (``key_env``).

    A sealed value is ``v1.<hex HMAC-SHA256>.<body>``; the MAC covers the
    namespace, the kind (``report``, ``op``) and the subject (the replica's or
    the node's id) besides the body, so a signed value cannot be replayed
    under another key. Without keys values go out plain and any value is read
    (a sealed one has its seal dropped, unchecked).
    """

    __slots__ = ("keys", "namespace")

    def __init__(self, keys: tuple[bytes, ...], namespace: str) -> None:
        self.keys = keys
        self.namespace = namespace

    def _mac(self, key: bytes, kind: str, subject: str, body: bytes) -> str:
        head = f"{self.namespace}\0{kind}\0{subject}\0".encode()
        return hmac.new(key, head + body, hashlib.sha256).hexdigest()

    def seal(self, kind: str, subject: str, body: str) -> str:
        if not self.keys:
            return body
        return f"v1.{self._mac(self.keys[0], kind, subject, body.encode())}.{body}"

    def open(self, kind: str, subject: str, raw: bytes | str) -> bytes:
        """The body of a value read, or :class:`WireError` (``unsigned``, ``signature``)."""
        data = raw if isinstance(raw, bytes) else raw.encode()
        sealed = data.startswith(b"v1.")
        if sealed:
            mac, _, body = data[3:].partition(b".")
        else:
            mac, body = b"", data
        if not self.keys:
            return body
        if not sealed:
            raise WireError("unsigned", f"{kind} {subject!r} carries no signature")
        given = mac.decode("ascii", "replace")
        if not any(hmac.compare_digest(given, self._mac(k, kind, subject, body))
                   for k in self.keys):
            raise WireError("signature", f"{kind} {subject!r}: the signature does not verify")
        return body


class SharedState:
    """One replica's link to the others: the sync loop, the operator log, leases."""

    def __init__(self, fleet: LiveFleet, config: SharedStateConfig) -> None:
        self.fleet = fleet
        self.config = config
        self.replica = config.replica
        self.epoch = secrets.token_hex(4)  # a restart is a new replica to the others' ledgers
        self.leader = False
        self.leader_id: str | None = None
        self.up = False
        self.replicas = 1  # live replicas seen, this one included
        self.syncs = 0
        self.errors = 0
        self.last_ok = -1.0  # monotonic time of the last good sync
        self.sync_s = 0.0  # the last good sync's round trip
        self._peers: dict[str, dict[str, Any]] = {}
        self._isolated = False
        self._pending_ops: dict[str, str] = {}  # node -> JSON, written at the next sync
        self._ops_seen: dict[str, str] = {}  # node -> the last operator action applied
        self.seal = Seal(config.keys(), config.namespace)
        self.rejected: dict[str, int] = {}  # reason -> entries refused
        self._rejection_logged: dict[str, float] = {}  # sender -> when last logged
        self._seq = 0  # of this replica's reports (a reader refuses an older one)
        self._last_seq: dict[tuple[str, str], int] = {}  # (replica, epoch) -> last seq read
        self._redis: Redis | None = None
        self._script: Any = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    # -- lifecycle -------------------------------------------------------------

    def start(self) -> None:
        from redis.asyncio import Redis

        cfg = self.config
        if not self.seal.keys:
            log.warning("shared state: no key_env: anyone who can write to %s can steer this "
                        "fleet (node states, loads, operator actions); set key_env to sign "
                        "what the replicas share", cfg.url)
        self._redis = Redis.from_url(cfg.url, socket_timeout=cfg.timeout_s,
                                     socket_connect_timeout=cfg.timeout_s,
                                     health_check_interval=0, **cfg.connection())
        self._script = self._redis.register_script(_SYNC)
        self._task = asyncio.create_task(self._loop(), name="shared-state")

    async def stop(self) -> None:
        self._closing = True
        if self._task is not None:
            # A cancel that lands as a sync's own timeout fires is taken for the
            # timeout (Python 3.11's asyncio.timeout): cancel until it is done.
            while not self._task.done():
                self._task.cancel()
                await asyncio.wait({self._task}, timeout=0.5)
            self._task = None
        if self._redis is not None:
            try:  # leave at once rather than after ttl_s: the others stop counting us
                async with asyncio.timeout(self.config.timeout_s):
                    await self._redis.delete(self._key("replica", self.replica))
                    if self.leader:
                        await self._redis.delete(self._key("leader"))
            except Exception:
                pass
            await self._redis.aclose()
            self._redis = None

    def _key(self, *parts: str) -> str:
        return ":".join((self.config.namespace, *parts))

    # -- the loop ----------------------------------------------------------------

    async def _loop(self) -> None:
        period = self.config.period_s
        loop = asyncio.get_running_loop()
        while not self._closing:
            t0 = loop.time()
            try:
                async with asyncio.timeout(self.config.timeout_s):
                    await self.sync()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._failed(exc)
            await asyncio.sleep(max(0.0, period - (loop.time() - t0)))

    async def sync(self) -> None:
        """One round trip: publish, take in the others, and exchange operator actions."""
        assert self._redis is not None
        fleet = self.fleet
        t0 = time.monotonic()
        report = fleet.balancer.report(t0, self.leader)
        self._seq += 1
        report.update(epoch=self.epoch, seq=self._seq, ts=time.time(),
                      budgets=fleet.budget_balances())
        body = self.seal.seal("report", self.replica, json.dumps(report, allow_nan=False))
        ops, self._pending_ops = self._pending_ops, {}
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                await self._script(args=[self.config.namespace, self.replica, body,
                                         int(self.config.ttl_s * 1000)], client=pipe)  # queued
                if ops:
                    pipe.hset(self._key("ops"), mapping=cast("Mapping[Any, Any]", ops))
                pipe.hgetall(self._key("ops"))
                replies = await pipe.execute()
        except BaseException:
            for node, op in ops.items():  # not written: try again next time
                self._pending_ops.setdefault(node, op)
            raise
        out, all_ops = replies[0], replies[-1]
        now = time.monotonic()
        leader_id = _text(out[0]) if out and out[0] is not None else None
        peers: dict[str, dict[str, Any]] = {}
        budgets: list[dict[str, list[float | None]]] = []
        for i in range(1, len(out) - 1, 2):
            rid = _text(out[i])
            try:
                rep = parse_report(self.seal.open("report", rid, out[i + 1]))
                self._check_fresh(rid, rep.epoch, rep.seq, rep.ts)
            except WireError as exc:
                self._reject(rid, exc)
                continue
            peers[rid] = rep.core(rid == leader_id)
            budgets.append({m: list(b) for m, b in rep.budgets.items()})
        self.leader_id = leader_id
        self.leader = leader_id == self.replica
        self._peers = peers
        self.replicas = 1 + len(peers)
        self.sync_s = now - t0
        self.syncs += 1
        self.last_ok = now
        if not self.up:
            log.info("shared state: %s at %s, %d replica(s), leader %s", "connected"
                     if self.errors == 0 else "back", self.config.url, self.replicas, leader_id)
        self.up = True
        self._isolated = False
        self._apply_ops(all_ops)
        fleet.lend_budgets(budgets)
        self._publish_events(fleet.balancer.on_peers(now, peers, self.leader))

    def _check_fresh(self, rid: str, epoch: str, seq: int, ts: float) -> None:
        """A signed report must be newer than the last one read from its sender and
        not older than MAX_REPORT_AGE_S by its clock: an old one replayed is refused."""
        if not self.seal.keys:
            return
        if abs(time.time() - ts) > MAX_REPORT_AGE_S:
            raise WireError("stale", f"report of {rid!r} is {time.time() - ts:+.0f} s old")
        key = (rid, epoch)
        if seq < self._last_seq.get(key, 0):
            raise WireError("replayed", f"report of {rid!r} is older than one already read")
        self._last_seq[key] = seq

    def _reject(self, sender: str, exc: WireError) -> None:
        self.rejected[exc.reason] = self.rejected.get(exc.reason, 0) + 1
        now = time.monotonic()
        if now - self._rejection_logged.get(sender, -REJECTION_LOG_EVERY_S) \
                >= REJECTION_LOG_EVERY_S:
            self._rejection_logged[sender] = now
            log.warning("shared state: refused an entry from %s (%s): %s", sender[:80],
                        exc.reason, exc)

    def _failed(self, exc: BaseException) -> None:
        self.errors += 1
        if self.up or (self.syncs == 0 and self.errors == 1):
            log.warning("shared state: %s unreachable (%s: %s); serving on this replica's view",
                        self.config.url, type(exc).__name__, exc)
        self.up = False
        now = time.monotonic()
        if not self._isolated and (self.last_ok < 0.0 or now - self.last_ok > self.config.ttl_s):
            # No leader's word can reach us: decide alone, on the others' last loads.
            self._isolated = True
            self.leader = False
            frozen = {r: {**rep, "leader": False} for r, rep in self._peers.items()}
            self._publish_events(self.fleet.balancer.on_peers(now, frozen, False))

    def _publish_events(self, events: list[Event]) -> None:
        for ev in events:
            self.fleet.publish_event(ev)

    # -- operator actions ------------------------------------------------------------

    def operator(self, node_id: str, state: NodeState) -> None:
        """An operator set ``node_id`` to ``state`` here: the others follow at the next sync."""
        if state not in OPERATOR_STATES:
            return
        op = self.seal.seal("op", node_id, json.dumps(
            {"state": state.value, "by": self.replica, "id": secrets.token_hex(6),
             "ts": time.time()}))
        self._pending_ops[node_id] = op
        self._ops_seen[node_id] = op

    def _apply_ops(self, raw: Mapping[Any, Any]) -> None:
        for k, v in raw.items():
            node_id, op = _text(k), _text(v)
            if self._ops_seen.get(node_id) == op or node_id in self._pending_ops:
                continue
            self._ops_seen[node_id] = op
            try:
                action = parse_operator_action(self.seal.open("op", node_id, v))
            except WireError as exc:
                self._reject(f"operator action on {node_id[:80]!r}", exc)
                continue
            state, by = NodeState(action.state), action.by
            node = self.fleet.balancer.nodes.get(node_id)
            if node is None or node.state is state or state not in OPERATOR_STATES:
                continue
            if state is NodeState.HEALTHY and node.state not in (NodeState.CORDONED,
                                                                 NodeState.DRAINING):
                continue  # an uncordon ends an operator's state, not the detector's
            log.info("node %s: %s by an operator on replica %s", node_id, state.value, by)
            self.fleet.set_state(node_id, state, shared=False)

    # -- remediation leases ---------------------------------------------------------

    async def lease(self, name: str, seconds: float) -> bool:
        """Whether this replica may act on ``name`` now (held for ``seconds``, fleet-wide).

        With Redis unreachable, only the replica that led last may act.
        """
        if self._redis is None:
            return True
        try:
            async with asyncio.timeout(self.config.timeout_s):
                got = await self._redis.set(self._key("remediate", name), self.replica,
                                            nx=True, px=max(1, int(seconds * 1000)))
            return bool(got)
        except Exception:
            return self.leader_id == self.replica

    # -- what the admin API and the metrics show -------------------------------------

    def status(self) -> dict[str, Any]:
        return {"replica": self.replica, "up": self.up, "leader": self.leader_id,
                "leading": self.leader, "replicas": sorted([self.replica, *self._peers]),
                "syncs": self.syncs, "errors": self.errors,
                "age_s": round(time.monotonic() - self.last_ok, 3) if self.last_ok >= 0 else None}


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
