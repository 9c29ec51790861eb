"""The fleet file's ``discovery:`` section (the watcher is :mod:`tailguard.adapters.discovery`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import Field, ValidationInfo, field_validator, model_validator

from tailguard.config import Block, parse


@dataclass(frozen=True, slots=True)
class KubernetesDiscoveryConfig:
    namespace: str
    selector: str  # "" with inference_pool: the pool's own selector
    port: int | str  # a number, or the name of a container port (0: the pool's targetPorts)
    inference_pool: str | None = None  # an InferencePool (inference.networking.k8s.io/v1)
    models: tuple[str, ...] = ()
    kubeconfig: str | None = None  # default: in-cluster, else the usual kubeconfig
    watch_timeout_s: int = 300  # the server ends each watch after this; it resumes


class KubernetesBlock(Block):
    """``discovery: {kubernetes: ...}``: pods by label selector, or an InferencePool's."""

    CORE = KubernetesDiscoveryConfig

    namespace: str = Field(min_length=1)
    inference_pool: str | None = Field(None, min_length=1)
    selector: str = Field("", validate_default=True)  # the pool's own with inference_pool
    port: int | str | None = Field(None, validate_default=True)
    models: tuple[str, ...] = Field((), strict=False)
    kubeconfig: str | None = None
    watch_timeout_s: int = Field(300, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _one_model(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("models"), str):
            return {**data, "models": [data["models"]]}  # one model name, as a list
        return data

    @field_validator("selector")
    @classmethod
    def _selector_or_pool(cls, selector: str, info: ValidationInfo) -> str:
        pool = info.data.get("inference_pool")
        if pool is None and not selector:
            raise ValueError("is required (a non-empty string)")
        if pool is not None and selector:
            raise ValueError("comes from the InferencePool: give one or the other")
        return selector

    @field_validator("port")
    @classmethod
    def _a_port(cls, port: int | str | None, info: ValidationInfo) -> int | str:
        pooled = info.data.get("inference_pool") is not None
        if port is None and pooled:
            return 0  # the pool's targetPorts
        if isinstance(port, str) and port:
            return port  # a container port's name
        if isinstance(port, int) and (0 < port < 65536 or (port == 0 and pooled)):
            return port
        raise ValueError("is required: a port number or a container port name")

    @field_validator("models")
    @classmethod
    def _named(cls, models: tuple[str, ...]) -> tuple[str, ...]:
        if not all(models):
            raise ValueError("must be a list of model names")
        return models


class DiscoveryBlock(Block):
    """The fleet file's ``discovery:`` (only ``kubernetes`` so far)."""

    kubernetes: KubernetesBlock


def parse_discovery(raw: Any) -> KubernetesDiscoveryConfig | None:
    """The fleet file's ``discovery:`` (None: the nodes of the file alone)."""
    if raw is None:
        return None
    cfg: KubernetesDiscoveryConfig = parse(DiscoveryBlock, raw, "discovery").kubernetes.core()
    return cfg
