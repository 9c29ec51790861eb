"""Roofline calibration against measured points (../shared/facts.md) and catalog lookups."""

from __future__ import annotations

import pytest

from tailguard.config.catalog import extend_catalog
from tailguard.core.hardware import DEFAULT_CATALOG, PerfModel, perf_model
from tailguard.errors import ConfigError


def within(value: float, target: float, tolerance: float = 0.30) -> bool:
    return abs(value - target) <= tolerance * target


def test_decode_70b_tp2_batch1_matches_measurements() -> None:
    # Llama-2-70B at TP2, decode at batch 1: 55 ms on A100, 37 ms on H100.
    a100 = perf_model("A100-80GB", "llama-2-70b", tp=2).decode_step(1, 512)
    h100 = perf_model("H100-SXM", "llama-2-70b", tp=2).decode_step(1, 512)
    assert within(a100, 0.055), a100
    assert within(h100, 0.037), h100


def test_prefill_2048_70b_tp2_on_a100() -> None:
    t = perf_model("A100-80GB", "llama-2-70b", tp=2).prefill_time(2048)
    assert within(t, 0.688), t


def test_h100_over_a100_decode_ratio_for_8b() -> None:
    for batch in (1, 8, 64):
        a = perf_model("A100-80GB", "llama-3.1-8b").decode_step(batch, 1000)
        h = perf_model("H100-SXM", "llama-3.1-8b").decode_step(batch, 1000)
        assert 1.3 <= a / h <= 1.8, (batch, a / h)


def test_prefill_is_compute_bound_and_faster_on_h100() -> None:
    a = perf_model("A100-80GB", "llama-3.1-8b").prefill_time(4096)
    h = perf_model("H100-SXM", "llama-3.1-8b").prefill_time(4096)
    assert 1.8 <= a / h <= 3.3


def test_kv_bytes_per_token() -> None:
    assert DEFAULT_CATALOG.model("llama-3.1-8b").kv_bytes_per_token == 128 * 1024
    assert DEFAULT_CATALOG.model("llama-3.1-70b").kv_bytes_per_token == 320 * 1024


def test_fit_and_kv_capacity() -> None:
    assert not perf_model("T4", "llama-3.1-8b").fits
    assert not perf_model("A100-80GB", "llama-3.1-70b", tp=1).fits
    assert perf_model("A100-80GB", "llama-3.1-70b", tp=2).fits
    big = perf_model("H100-SXM", "llama-3.1-8b").kv_capacity_tokens
    small = perf_model("L4", "llama-3.1-8b").kv_capacity_tokens
    # (80*0.9 - 16.06 - 1) GB / 128 KiB and (24*0.9 - 16.06 - 1) GB / 128 KiB
    assert 410_000 < big < 430_000
    assert 30_000 < small < 40_000


def test_decode_step_grows_with_batch_and_context() -> None:
    pm = perf_model("L4", "llama-3.1-8b")
    assert pm.decode_step(16, 1000) > pm.decode_step(1, 1000)
    assert pm.decode_step(8, 4000) > pm.decode_step(8, 500)


def test_max_batch_for_tpot_is_the_boundary() -> None:
    pm = perf_model("A100-80GB", "llama-3.1-8b")
    b = pm.max_batch_for_tpot(0.05, 1200)
    assert pm.decode_step(b, 1200) <= 0.05 < pm.decode_step(b + 1, 1200)
    assert perf_model("L4", "llama-3.1-8b").max_batch_for_tpot(0.05, 1200) == 0


def test_aliases_resolve() -> None:
    assert DEFAULT_CATALOG.gpu("H100").name == "H100-SXM"
    assert DEFAULT_CATALOG.gpu("A100").name == "A100-80GB"
    assert DEFAULT_CATALOG.gpu("NVIDIA A100-SXM4-40GB").name == "A100-40GB"
    assert DEFAULT_CATALOG.gpu("Tesla T4").name == "T4"
    assert DEFAULT_CATALOG.model("meta-llama/Llama-3.1-8B-Instruct").name == "llama-3.1-8b"


def test_unknown_gpu_names_allowed_values() -> None:
    with pytest.raises(ConfigError) as err:
        DEFAULT_CATALOG.gpu("H900", "fleet[0].gpu")
    assert "fleet[0].gpu" in str(err.value) and "H100-SXM" in str(err.value)


def test_catalog_extension_and_prices() -> None:
    cat = extend_catalog(DEFAULT_CATALOG, {
        "gpus": [{"name": "X1", "tflops": 100, "mem_bw_gbps": 500, "mem_gb": 32, "tdp_w": 200,
                  "price_per_hour": 1.0}],
        "models": [{"name": "tiny-1b", "params": 1e9, "layers": 16, "hidden": 2048,
                    "kv_heads": 8, "head_dim": 64}],
    }).with_prices({"H100": 8.22})
    assert cat.gpu("X1").mem_gb == 32
    assert cat.gpu("H100-SXM").price_per_hour == 8.22
    assert PerfModel(cat.gpu("X1"), cat.model("tiny-1b")).fits
    with pytest.raises(ConfigError, match=r"catalog.gpus\[0\].tflops"):
        extend_catalog(DEFAULT_CATALOG, {"gpus": [{"name": "bad", "tflops": -1, "mem_bw_gbps": 1,
                                                   "mem_gb": 1, "tdp_w": 1, "price_per_hour": 1}]})
