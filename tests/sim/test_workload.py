"""Workload parsing, generation and traces (tailguard.traffic.workload)."""

from __future__ import annotations

import copy
import json
import math
import random
import statistics
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from tailguard.errors import ConfigError
from tailguard.traffic.workload import (
    DISTS,
    PROCESSES,
    TOKEN_CAP,
    ArrivalSpec,
    Component,
    FixedLength,
    MixtureLength,
    Requests,
    UniformLength,
    WorkloadSpec,
    generate,
    parse_length_dist,
    parse_workload,
    read_trace,
    sample_lengths,
    write_trace,
)

BASE: dict[str, Any] = {
    "duration_s": 600,
    "warmup_s": 60,
    "arrival": {"process": "poisson", "rate": 10.0},
    "input_tokens": {"dist": "lognormal", "mu": 6.6, "sigma": 1.0, "max": 8192},
    "output_tokens": {"dist": "azure-conv"},
}


def raw(**changes: Any) -> dict[str, Any]:
    """BASE with top-level keys replaced (None deletes the key)."""
    out = copy.deepcopy(BASE)
    for key, value in changes.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def write_lines(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def sample(dist_raw: dict[str, Any], field: str, n: int, seed: int = 1) -> list[int]:
    dist = parse_length_dist(dist_raw, "x", field)  # type: ignore[arg-type]
    return dist.sample_many(random.Random(seed), n)


# --------------------------------------------------------------------------- parsing


def test_parse_full_example() -> None:
    spec = parse_workload(raw(arrival={"process": "poisson", "load": 0.8}))
    assert spec.duration_s == 600.0
    assert spec.warmup_s == 60.0
    assert spec.arrival == ArrivalSpec(process="poisson", rate=None, load=0.8, cv=1.0)
    assert spec.input_tokens == MixtureLength.lognormal(6.6, 1.0, 1, 8192)
    assert spec.output_tokens is not None
    assert spec.output_tokens.name == "azure-conv"
    assert spec.output_tokens.max_tokens == 4096


def test_parse_warmup_defaults_to_zero() -> None:
    assert parse_workload(raw(warmup_s=None)).warmup_s == 0.0


def test_parse_gamma() -> None:
    spec = parse_workload(raw(arrival={"process": "gamma", "cv": 2.0, "rate": 25}))
    assert spec.arrival == ArrivalSpec(process="gamma", rate=25.0, load=None, cv=2.0)


def test_parse_trace_relative_to_base_dir(tmp_path: Path) -> None:
    write_lines(tmp_path / "trace.jsonl", [{"t": 0.5, "input_tokens": 3, "output_tokens": 4}])
    spec = parse_workload(
        raw(
            arrival={"process": "trace", "path": "trace.jsonl"},
            input_tokens=None,
            output_tokens=None,
        ),
        base_dir=tmp_path,
    )
    assert spec.arrival.process == "trace"
    assert spec.arrival.path == tmp_path / "trace.jsonl"
    assert spec.arrival.cv is None
    assert spec.input_tokens is None and spec.output_tokens is None


@pytest.mark.parametrize(
    ("dist_raw", "field", "expected"),
    [
        ({"dist": "fixed", "value": 128}, "input_tokens", FixedLength(128)),
        ({"dist": "uniform", "min": 10, "max": 20}, "input_tokens", UniformLength(10, 20)),
        (
            {"dist": "lognormal", "mu": 5, "sigma": 0.5},
            "output_tokens",
            MixtureLength.lognormal(5.0, 0.5, 1, TOKEN_CAP),
        ),
        (
            {"dist": "lognormal", "mu": 5, "sigma": 0.5, "min": 4, "max": 100},
            "output_tokens",
            MixtureLength.lognormal(5.0, 0.5, 4, 100),
        ),
        (
            {"dist": "azure-conv"},
            "input_tokens",
            MixtureLength.lognormal(6.63, 0.99, 1, 8192, name="azure-conv"),
        ),
        (
            {"dist": "azure-code", "max": 16384},
            "input_tokens",
            MixtureLength.lognormal(7.00, 1.36, 1, 16384, name="azure-code"),
        ),
        (
            {"dist": "azure-conv"},
            "output_tokens",
            MixtureLength(
                (
                    Component("lognormal", 0.665, 4.50, 0.55),
                    Component("normal", 0.335, 426.0, 69.0),
                ),
                1,
                4096,
                name="azure-conv",
            ),
        ),
        (
            {"dist": "azure-code"},
            "output_tokens",
            MixtureLength.lognormal(2.79, 0.85, 1, 4096, name="azure-code"),
        ),
    ],
)
def test_parse_length_dists(dist_raw: dict[str, Any], field: str, expected: object) -> None:
    assert parse_length_dist(dist_raw, "x", field) == expected  # type: ignore[arg-type]


BAD: list[tuple[dict[str, Any], str]] = [
    (raw(extra=1), "workload.extra"),
    (raw(duration_s=None), "workload.duration_s"),
    (raw(duration_s=0), "workload.duration_s"),
    (raw(duration_s=-5), "workload.duration_s"),
    (raw(duration_s="600"), "workload.duration_s"),
    (raw(duration_s=True), "workload.duration_s"),
    (raw(duration_s=math.inf), "workload.duration_s"),
    (raw(warmup_s=-1), "workload.warmup_s"),
    (raw(warmup_s=600), "workload.warmup_s"),
    (raw(arrival=None), "workload.arrival"),
    (raw(arrival="poisson"), "workload.arrival"),
    (raw(arrival={"rate": 1}), "workload.arrival.process"),
    (raw(arrival={"process": "uniform", "rate": 1}), "workload.arrival.process"),
    (raw(arrival={"process": "poisson"}), "workload.arrival.rate"),
    (raw(arrival={"process": "poisson", "rate": 1, "load": 0.5}), "workload.arrival.rate"),
    (raw(arrival={"process": "poisson", "rate": 0}), "workload.arrival.rate"),
    (raw(arrival={"process": "poisson", "rate": -2}), "workload.arrival.rate"),
    (raw(arrival={"process": "poisson", "load": 0}), "workload.arrival.load"),
    (raw(arrival={"process": "poisson", "load": -0.5}), "workload.arrival.load"),
    (raw(arrival={"process": "poisson", "rate": 1, "cv": 2}), "workload.arrival.cv"),
    (raw(arrival={"process": "gamma", "rate": 1}), "workload.arrival.cv"),
    (raw(arrival={"process": "gamma", "rate": 1, "cv": 0}), "workload.arrival.cv"),
    (raw(arrival={"process": "gamma", "rate": 1, "cv": -1}), "workload.arrival.cv"),
    (raw(arrival={"process": "trace"}), "workload.arrival.path"),
    (raw(arrival={"process": "trace", "path": "/nonexistent/t.jsonl"}), "workload.arrival.path"),
    (raw(input_tokens=None), "workload.input_tokens"),
    (raw(output_tokens=None), "workload.output_tokens"),
    (raw(input_tokens=[1, 2]), "workload.input_tokens"),
    (raw(input_tokens={"mu": 1}), "workload.input_tokens.dist"),
    (raw(input_tokens={"dist": "zipf"}), "workload.input_tokens.dist"),
    (raw(input_tokens={"dist": "fixed"}), "workload.input_tokens.value"),
    (raw(input_tokens={"dist": "fixed", "value": 0}), "workload.input_tokens.value"),
    (raw(input_tokens={"dist": "fixed", "value": 1.5}), "workload.input_tokens.value"),
    (raw(input_tokens={"dist": "fixed", "value": 1, "max": 3}), "workload.input_tokens.max"),
    (raw(input_tokens={"dist": "uniform", "min": 10}), "workload.input_tokens.max"),
    (raw(input_tokens={"dist": "uniform", "min": 10, "max": 5}), "workload.input_tokens.max"),
    (raw(input_tokens={"dist": "lognormal", "sigma": 1}), "workload.input_tokens.mu"),
    (
        raw(input_tokens={"dist": "lognormal", "mu": math.nan, "sigma": 1}),
        "workload.input_tokens.mu",
    ),
    (raw(input_tokens={"dist": "lognormal", "mu": 5}), "workload.input_tokens.sigma"),
    (raw(input_tokens={"dist": "lognormal", "mu": 5, "sigma": 0}), "workload.input_tokens.sigma"),
    (
        raw(input_tokens={"dist": "lognormal", "mu": 5, "sigma": 1, "max": 8192.0}),
        "workload.input_tokens.max",
    ),
    (
        raw(input_tokens={"dist": "lognormal", "mu": 5, "sigma": 1, "min": 0}),
        "workload.input_tokens.min",
    ),
    (
        raw(input_tokens={"dist": "lognormal", "mu": 5, "sigma": 1, "min": 9, "max": 8}),
        "workload.input_tokens.max",
    ),
    (raw(output_tokens={"dist": "azure-conv", "mu": 3}), "workload.output_tokens.mu"),
    (raw(output_tokens={"dist": "azure-code", "max": 0}), "workload.output_tokens.max"),
]


@pytest.mark.parametrize(("bad", "field"), BAD)
def test_bad_input_names_the_field(bad: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_workload(bad)
    assert info.value.field == field
    assert str(info.value).startswith(field)


def test_top_level_must_be_a_mapping() -> None:
    with pytest.raises(ConfigError) as info:
        parse_workload([1, 2], where="scenario.workload")  # type: ignore[arg-type]
    assert info.value.field == "scenario.workload"


def test_enum_errors_list_allowed_values() -> None:
    with pytest.raises(ConfigError) as info:
        parse_workload(raw(arrival={"process": "weibull", "rate": 1}))
    assert info.value.allowed == list(PROCESSES)
    with pytest.raises(ConfigError) as info:
        parse_workload(raw(output_tokens={"dist": "zipf"}))
    assert info.value.allowed == list(DISTS)
    with pytest.raises(ConfigError) as info:
        parse_workload(raw(surprise=1))
    assert info.value.allowed is not None and "duration_s" in info.value.allowed


def test_trace_accepts_one_scaling_only(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", [{"t": 1, "input_tokens": 1, "output_tokens": 1}])
    with pytest.raises(ConfigError) as info:
        parse_workload(
            raw(arrival={"process": "trace", "path": str(path), "speedup": 2, "rate": 3})
        )
    assert info.value.field == "workload.arrival.rate"
    with pytest.raises(ConfigError) as info:
        parse_workload(raw(arrival={"process": "trace", "path": str(path), "speedup": 0}))
    assert info.value.field == "workload.arrival.speedup"


# --------------------------------------------------------------------------- generation


def poisson_spec(rate: float = 50.0, duration: float = 100.0) -> WorkloadSpec:
    return parse_workload(
        {
            "duration_s": duration,
            "arrival": {"process": "poisson", "rate": rate},
            "input_tokens": {"dist": "azure-conv"},
            "output_tokens": {"dist": "azure-conv"},
        }
    )


def test_generate_is_deterministic_for_a_seed() -> None:
    spec = poisson_spec()
    a = generate(spec, None, random.Random(7))
    b = generate(spec, None, random.Random(7))
    c = generate(spec, None, random.Random(8))
    assert a == b
    assert a != c
    assert len(a) > 0


def test_times_sorted_within_window_and_lists_parallel() -> None:
    spec = poisson_spec(rate=200.0, duration=30.0)
    reqs = generate(spec, None, random.Random(1))
    assert reqs.arrival_s == sorted(reqs.arrival_s)
    assert all(0.0 <= t < 30.0 for t in reqs.arrival_s)
    assert len(reqs.arrival_s) == len(reqs.input_tokens) == len(reqs.output_tokens)


def test_duration_override() -> None:
    reqs = generate(poisson_spec(duration=100.0), None, random.Random(1), duration_s=5.0)
    assert reqs.arrival_s[-1] < 5.0


def test_lengths_do_not_depend_on_rate() -> None:
    """Request i gets the same lengths at any rate: a load sweep compares like with like."""
    slow = generate(poisson_spec(rate=10.0), None, random.Random(3))
    fast = generate(poisson_spec(rate=50.0), None, random.Random(3))
    k = len(slow)
    assert fast.input_tokens[:k] == slow.input_tokens
    assert fast.output_tokens[:k] == slow.output_tokens


def test_load_must_be_resolved_by_the_caller() -> None:
    spec = parse_workload(raw(arrival={"process": "poisson", "load": 0.8}))
    with pytest.raises(ValueError, match="load"):
        generate(spec, None, random.Random(1))
    assert len(generate(spec, 5.0, random.Random(1), duration_s=10.0)) > 0


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip([0.0, *times], times, strict=False)]


def test_poisson_rate_and_cv() -> None:
    reqs = generate(poisson_spec(rate=100.0, duration=500.0), None, random.Random(11))
    assert len(reqs) / 500.0 == pytest.approx(100.0, rel=0.02)
    g = gaps(reqs.arrival_s)
    assert statistics.pstdev(g) / statistics.fmean(g) == pytest.approx(1.0, rel=0.03)


@pytest.mark.parametrize("cv", [0.5, 2.0, 4.0])
def test_gamma_cv_and_rate(cv: float) -> None:
    spec = parse_workload(raw(arrival={"process": "gamma", "cv": cv, "rate": 100.0}))
    reqs = generate(spec, None, random.Random(5), duration_s=1000.0)
    g = gaps(reqs.arrival_s)
    assert statistics.fmean(g) == pytest.approx(0.01, rel=0.05)
    assert statistics.pstdev(g) / statistics.fmean(g) == pytest.approx(cv, rel=0.06)


def test_generate_200k_requests_fast() -> None:
    spec = poisson_spec(rate=1000.0, duration=200.0)
    best = math.inf
    for seed in (1, 2):
        start = time.perf_counter()
        reqs = generate(spec, None, random.Random(seed))
        best = min(best, time.perf_counter() - start)
    assert len(reqs) > 195_000
    assert best < 1.0


# --------------------------------------------------------------------------- lengths vs facts

N = 200_000


def median(xs: list[int]) -> float:
    return statistics.median(xs)


def test_azure_conv_input_matches_fit() -> None:
    """facts.md: mean 1155 and median 1020 in the trace; the lognormal(6.63, 0.99)
    fit (clamped at 8192) has mean 1206 and median e**6.63 = 757. The fit is what
    the preset implements; its mean stays within 5% of the trace's."""
    xs = sample({"dist": "azure-conv"}, "input_tokens", N)
    assert statistics.fmean(xs) == pytest.approx(1155, rel=0.05)
    assert median(xs) == pytest.approx(math.exp(6.63), rel=0.02)
    assert max(xs) == 8192


def test_azure_conv_output_matches_facts() -> None:
    xs = sample({"dist": "azure-conv"}, "output_tokens", N)
    assert statistics.fmean(xs) == pytest.approx(211, rel=0.02)
    assert median(xs) == pytest.approx(129, rel=0.03)
    assert sorted(xs)[int(0.99 * N)] == pytest.approx(601, rel=0.10)


def test_azure_code_input_matches_facts() -> None:
    xs = sample({"dist": "azure-code"}, "input_tokens", N)
    assert statistics.fmean(xs) == pytest.approx(2048, rel=0.03)


def test_azure_code_output_matches_fit() -> None:
    """facts.md: mean 28 and median 13 in the trace; lognormal(2.79, 0.85) has
    mean exp(2.79 + 0.85**2/2) = 23.4 and median e**2.79 = 16.3."""
    xs = sample({"dist": "azure-code"}, "output_tokens", N)
    assert statistics.fmean(xs) == pytest.approx(23.4, rel=0.02)
    assert median(xs) == pytest.approx(16, abs=1)


@pytest.mark.parametrize(
    ("dist_raw", "field"),
    [
        ({"dist": "azure-conv"}, "input_tokens"),
        ({"dist": "azure-conv"}, "output_tokens"),
        ({"dist": "azure-code"}, "input_tokens"),
        ({"dist": "azure-code"}, "output_tokens"),
        ({"dist": "lognormal", "mu": 3.0, "sigma": 2.0, "min": 5, "max": 500}, "input_tokens"),
        ({"dist": "uniform", "min": 3, "max": 9}, "input_tokens"),
        ({"dist": "fixed", "value": 42}, "input_tokens"),
    ],
)
def test_mean_and_median_agree_with_samples(dist_raw: dict[str, Any], field: str) -> None:
    dist = parse_length_dist(dist_raw, "x", field)  # type: ignore[arg-type]
    xs = dist.sample_many(random.Random(2), 100_000)
    assert statistics.fmean(xs) == pytest.approx(dist.mean(), rel=0.02)
    assert median(xs) == pytest.approx(dist.quantile(0.5), rel=0.03, abs=1)
    assert dist.quantile(0.0) == dist.min_tokens
    assert dist.quantile(1.0) == dist.max_tokens


def test_uniform_is_inclusive() -> None:
    assert set(sample({"dist": "uniform", "min": 3, "max": 5}, "input_tokens", 1000)) == {3, 4, 5}


def test_single_sample_is_an_int_in_range() -> None:
    dist = parse_length_dist({"dist": "azure-conv"}, "x", "output_tokens")
    value = dist.sample(random.Random(0))
    assert isinstance(value, int)
    assert 1 <= value <= 4096


def test_quantile_rejects_out_of_range() -> None:
    dist = parse_length_dist({"dist": "azure-conv"}, "x", "input_tokens")
    with pytest.raises(ValueError):
        dist.quantile(1.5)


# --------------------------------------------------------------------------- traces


def test_trace_round_trip(tmp_path: Path) -> None:
    reqs = generate(poisson_spec(rate=20.0, duration=20.0), None, random.Random(4))
    path = tmp_path / "out.jsonl"
    write_trace(path, reqs)
    assert read_trace(path) == reqs


def test_read_trace_sorts_and_ignores_extra_keys(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "t.jsonl",
        [
            {"t": 2.0, "input_tokens": 20, "output_tokens": 2, "id": "b"},
            {"t": 1, "input_tokens": 10, "output_tokens": 1},
            {"t": 3.5, "input_tokens": 30, "output_tokens": 3},
        ],
    )
    assert read_trace(path) == Requests([1.0, 2.0, 3.5], [10, 20, 30], [1, 2, 3])


@pytest.mark.parametrize(
    "line",
    [
        "not json",
        "[1, 2]",
        '{"input_tokens": 1, "output_tokens": 1}',
        '{"t": -1, "input_tokens": 1, "output_tokens": 1}',
        '{"t": "1", "input_tokens": 1, "output_tokens": 1}',
        '{"t": 1, "input_tokens": 0, "output_tokens": 1}',
        '{"t": 1, "input_tokens": 1}',
        '{"t": 1, "input_tokens": 1, "output_tokens": 2.5}',
    ],
)
def test_read_trace_rejects_bad_lines(tmp_path: Path, line: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"t": 0, "input_tokens": 1, "output_tokens": 1}\n' + line + "\n")
    with pytest.raises(ConfigError) as info:
        read_trace(path, where="workload.arrival.path")
    assert info.value.field == "workload.arrival.path"
    assert f"{path}:2" in str(info.value)


def trace_spec(path: Path, **arrival: Any) -> WorkloadSpec:
    return parse_workload(
        {"duration_s": 10, "arrival": {"process": "trace", "path": str(path), **arrival}}
    )


ROWS = [
    {"t": 4.0, "input_tokens": 40, "output_tokens": 4},
    {"t": 1.0, "input_tokens": 10, "output_tokens": 1},
    {"t": 12.0, "input_tokens": 120, "output_tokens": 12},
    {"t": 8.0, "input_tokens": 80, "output_tokens": 8},
]


def test_generate_from_trace_uses_times_and_lengths(tmp_path: Path) -> None:
    spec = trace_spec(write_lines(tmp_path / "t.jsonl", ROWS))
    reqs = generate(spec, 123.0, random.Random(0))  # rate ignored without scaling
    assert reqs == Requests([1.0, 4.0, 8.0], [10, 40, 80], [1, 4, 8])


def test_trace_speedup(tmp_path: Path) -> None:
    spec = trace_spec(write_lines(tmp_path / "t.jsonl", ROWS), speedup=2)
    reqs = generate(spec, None, random.Random(0))
    assert reqs.arrival_s == [0.5, 2.0, 4.0, 6.0]


def test_trace_rate_scaling(tmp_path: Path) -> None:
    # Native rate: 4 requests / 12 s = 1/3 req/s; at 2/3 req/s times halve.
    path = write_lines(tmp_path / "t.jsonl", ROWS)
    reqs = generate(trace_spec(path, load=0.5), 2.0 / 3.0, random.Random(0))
    assert reqs.arrival_s == pytest.approx([0.5, 2.0, 4.0, 6.0])
    reqs = generate(trace_spec(path, rate=2.0 / 3.0), None, random.Random(0))
    assert reqs.arrival_s == pytest.approx([0.5, 2.0, 4.0, 6.0])


def test_trace_length_override(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", ROWS)
    spec = parse_workload(
        {
            "duration_s": 10,
            "arrival": {"process": "trace", "path": str(path)},
            "output_tokens": {"dist": "fixed", "value": 7},
        }
    )
    reqs = generate(spec, None, random.Random(0))
    assert reqs.input_tokens == [10, 40, 80]
    assert reqs.output_tokens == [7, 7, 7]


def test_sample_lengths_synthetic_and_trace(tmp_path: Path) -> None:
    n_in, n_out = sample_lengths(poisson_spec(), 1000, random.Random(1))
    assert len(n_in) == len(n_out) == 1000
    assert (n_in, n_out) == sample_lengths(poisson_spec(), 1000, random.Random(1))
    spec = trace_spec(write_lines(tmp_path / "t.jsonl", ROWS))
    n_in, n_out = sample_lengths(spec, 500, random.Random(1))
    assert set(zip(n_in, n_out, strict=True)) <= {(10, 1), (40, 4), (120, 12), (80, 8)}
    assert len(set(n_in)) == 4


# --------------------------------------------------------------------------- properties

lognormal_raw = st.fixed_dictionaries(
    {
        "dist": st.just("lognormal"),
        "mu": st.floats(-5.0, 30.0),
        "sigma": st.floats(0.01, 8.0),
    },
    optional={"min": st.integers(1, 1000), "max": st.integers(1000, 100_000)},
)
preset_raw = st.fixed_dictionaries(
    {"dist": st.sampled_from(["azure-conv", "azure-code"])},
    optional={"max": st.integers(1, 20_000)},
)
uniform_raw = st.integers(1, 10_000).flatmap(
    lambda lo: st.fixed_dictionaries(
        {"dist": st.just("uniform"), "min": st.just(lo), "max": st.integers(lo, lo + 10_000)}
    )
)
fixed_raw = st.fixed_dictionaries({"dist": st.just("fixed"), "value": st.integers(1, 10**6)})


@settings(derandomize=True, deadline=None, max_examples=150)
@given(
    dist_raw=st.one_of(lognormal_raw, preset_raw, uniform_raw, fixed_raw),
    field=st.sampled_from(["input_tokens", "output_tokens"]),
    seed=st.integers(0, 2**32),
)
def test_lengths_within_bounds(dist_raw: dict[str, Any], field: str, seed: int) -> None:
    dist = parse_length_dist(dist_raw, "x", field)  # type: ignore[arg-type]
    lo, hi = dist.min_tokens, dist.max_tokens
    assert 1 <= lo <= hi <= TOKEN_CAP
    if "max" in dist_raw:
        assert hi == dist_raw["max"]
    xs = dist.sample_many(random.Random(seed), 300)
    assert all(isinstance(x, int) and lo <= x <= hi for x in xs)
    qs = [dist.quantile(q) for q in (0.0, 0.01, 0.5, 0.99, 1.0)]
    assert qs == sorted(qs)
    assert lo <= qs[0] and qs[-1] <= hi
    assert lo <= dist.mean() <= hi
