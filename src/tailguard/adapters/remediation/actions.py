"""The remediation actions: run a command, POST a webhook, delete a Kubernetes pod.

Each returns ``(ok, detail)`` and never raises for the action's own failure
(a non-zero exit, a timeout, an HTTP error): the caller records it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Mapping
from typing import Any

import aiohttp


async def run_command(argv: tuple[str, ...], env: Mapping[str, str],
                      timeout_s: float) -> tuple[bool, str]:
    """Run ``argv`` (no shell) with ``env`` added to the gateway's environment."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, env={**os.environ, **env}, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    except OSError as exc:
        return False, f"cannot start {argv[0]}: {exc}"
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        return False, f"timed out after {timeout_s:g} s (killed)"
    text = out.decode("utf-8", "replace").strip()[-300:]
    if proc.returncode != 0:
        return False, f"exit {proc.returncode}: {text}"
    return True, text or "exit 0"


async def post_webhook(session: aiohttp.ClientSession, url: str, payload: dict[str, Any],
                       headers: Mapping[str, str], timeout_s: float) -> tuple[bool, str]:
    try:
        async with session.post(url, json=payload, headers=dict(headers),
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            await resp.read()
            return 200 <= resp.status < 300, f"HTTP {resp.status}"
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        return False, f"{type(exc).__name__}: {exc}"


def _delete_pod_sync(namespace: str, pod: str) -> str:
    # Imported here: ``kubernetes`` is an optional extra (pip install tailguard[kubernetes]).
    from kubernetes import client, config  # type: ignore[import-not-found, unused-ignore]

    try:
        config.load_incluster_config()
    except config.ConfigException:
        # KUBECONFIG as it is now (the client reads it once, at its import).
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
    client.CoreV1Api().delete_namespaced_pod(pod, namespace)
    return f"deleted pod {namespace}/{pod}"


async def delete_pod(namespace: str, pod: str, timeout_s: float) -> tuple[bool, str]:
    """Delete ``namespace/pod`` so its controller replaces it (in-cluster or kubeconfig)."""
    try:
        detail = await asyncio.wait_for(asyncio.to_thread(_delete_pod_sync, namespace, pod),
                                        timeout_s)
    except ImportError:
        return False, "the kubernetes package is not installed (pip install 'tailguard[kubernetes]')"
    except TimeoutError:
        return False, f"timed out after {timeout_s:g} s"
    except Exception as exc:  # the client raises ApiException, config errors, ...
        return False, f"{type(exc).__name__}: {exc}"
    return True, detail
