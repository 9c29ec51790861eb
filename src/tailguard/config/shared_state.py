"""The fleet file's ``shared_state:`` section (the driver is :mod:`tailguard.adapters.shared_state`)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

from pydantic import Field, ValidationInfo, field_validator, model_validator

from tailguard.config import Block, FieldError, parse_core


@dataclass(frozen=True, slots=True)
class SharedStateConfig:
    """Where replicas meet, and how often.

    ``period_s``: how often a replica publishes and merges (its view of the
    others is at most this old, plus Redis's round trip). ``ttl_s``: how long
    a replica's report, and the leader's lease, outlive its last publish: a
    dead replica's share of every node expires after it. ``timeout_s``: a
    sync that takes longer is abandoned and counted as Redis being down.

    ``key_env``: the environment variable holding the replicas' shared keys
    (comma-separated; the first signs, each verifies, so a key is rotated by
    adding the new one second, then first, then dropping the old one). With
    keys, every report and operator action carries an HMAC-SHA256 and any
    entry without a valid one is refused; without, any writer to the store
    can steer the fleet (the gateway warns at start).

    ``username`` and ``password_env``: a Redis ACL user and the variable
    holding its password. ``tls_ca_file``, ``tls_cert_file``,
    ``tls_key_file``: with a ``rediss://`` URL, the CA that signed the
    server's certificate (default: the system's), and this replica's client
    certificate and key where the server asks for one.
    """

    url: str
    replica: str  # unique per replica: default the host name and process id
    namespace: str = "tailguard"  # key prefix: several fleets may share one Redis
    period_s: float = 0.25
    ttl_s: float = 2.0
    timeout_s: float = 0.5
    key_env: str | None = None
    username: str | None = None
    password_env: str | None = None
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None

    def keys(self) -> tuple[bytes, ...]:
        """The shared keys from ``key_env`` (none: unsigned; the variable must be set
        and non-empty when named)."""
        if self.key_env is None:
            return ()
        raw = os.environ.get(self.key_env, "")
        return tuple(k.strip().encode() for k in raw.split(",") if k.strip())


    def connection(self) -> dict[str, Any]:
        """The client's connection options beyond the URL (ACL user, password, TLS)."""
        out: dict[str, Any] = {}
        if self.username is not None:
            out["username"] = self.username
        if self.password_env is not None:
            out["password"] = os.environ.get(self.password_env, "")
        if self.url.startswith("rediss://"):
            out["ssl_cert_reqs"] = "required"
            if self.tls_ca_file is not None:
                out["ssl_ca_certs"] = self.tls_ca_file
            if self.tls_cert_file is not None:
                out["ssl_certfile"] = self.tls_cert_file
                out["ssl_keyfile"] = self.tls_key_file
        return out


def default_replica() -> str:
    """``POD_NAME`` (set it from the downward API), else host name and process id."""
    return os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"




class SharedStateBlock(Block):
    """The ``shared_state:`` block. ``ttl_s`` defaults to the larger of 2 s and four
    periods, ``timeout_s`` to the smaller of 0.5 s and half the TTL."""

    CORE = SharedStateConfig

    url: str
    replica: str = Field(default_factory=default_replica)
    namespace: str = "tailguard"
    period_s: float = Field(0.25, ge=0.01)
    ttl_s: float | None = Field(None, ge=0.05)
    timeout_s: float | None = Field(None, ge=0.01)
    key_env: str | None = Field(None, min_length=1)
    username: str | None = Field(None, min_length=1)
    password_env: str | None = Field(None, min_length=1)
    tls_ca_file: str | None = Field(None, min_length=1)
    tls_cert_file: str | None = Field(None, min_length=1)
    tls_key_file: str | None = Field(None, min_length=1)

    @field_validator("tls_ca_file", "tls_cert_file", "tls_key_file")
    @classmethod
    def _readable(cls, path: str | None, info: ValidationInfo) -> str | None:
        if path is not None:
            url = info.data.get("url", "")
            if not url.startswith("rediss://"):
                raise ValueError("applies to a rediss:// URL")
            if not os.path.isfile(path):
                raise ValueError(f"no such file: {path}")
        return path

    @model_validator(mode="after")
    def _cert_with_key(self) -> SharedStateBlock:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise FieldError("tls_key_file", "give tls_cert_file and tls_key_file together")
        return self

    @field_validator("key_env", "password_env")
    @classmethod
    def _set(cls, name: str | None) -> str | None:
        # An unset variable is a deployment mistake that would leave the fleet unsigned.
        if name is not None and not os.environ.get(name, "").strip():
            raise ValueError(f"environment variable {name} is unset or empty")
        return name

    @field_validator("url")
    @classmethod
    def _a_store(cls, url: str) -> str:
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must be redis://HOST:PORT/DB (or rediss://, unix://)")
        return url

    @field_validator("replica", "namespace")
    @classmethod
    def _a_key_part(cls, name: str) -> str:
        if not name or any(c in name for c in " {}:"):
            raise ValueError("must be a non-empty name without spaces, braces or colons")
        return name

    @field_validator("ttl_s")
    @classmethod
    def _outlives_two_periods(cls, ttl: float | None, info: ValidationInfo) -> float | None:
        period = info.data.get("period_s", 0.25)
        if ttl is not None and ttl < 2 * period:
            raise ValueError(f"must be at least twice period_s ({2 * period} s): a live "
                             "replica would expire between publishes")
        return ttl

    def core(self) -> SharedStateConfig:
        ttl = self.ttl_s if self.ttl_s is not None else max(2.0, 4 * self.period_s)
        timeout = self.timeout_s if self.timeout_s is not None else min(0.5, ttl / 2)
        return SharedStateConfig(self.url, self.replica, self.namespace, self.period_s, ttl,
                                 timeout, self.key_env, self.username, self.password_env,
                                 self.tls_ca_file, self.tls_cert_file, self.tls_key_file)


def parse_shared_state(raw: Any) -> SharedStateConfig | None:
    """The fleet file's ``shared_state:`` (None: one replica on its own)."""
    cfg: SharedStateConfig | None = parse_core(SharedStateBlock, raw, "shared_state",
                                               optional=True)
    return cfg
