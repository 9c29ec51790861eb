"""Public production trace formats as input (issue 42): the Azure LLM inference traces'
CSV and BurstGPT's, beside tailguard's and Mooncake's JSONL; windows and rate scaling."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import pytest

from tailguard.bench.cli import config_from_args
from tailguard.errors import ConfigError
from tailguard.traffic.shapes import SHAPES, write_shape
from tailguard.traffic.traces import read_trace
from tailguard.traffic.workload import generate, parse_workload

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,4808,10
2023-11-16 18:15:50.9951690,3180,8
2023-11-16 18:15:45.0000000,110,27
2023-11-16 18:15:51.0000000,7433,0
"""
BURSTGPT = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
45,ChatGPT,1087,225,1312,Conversation log
118,GPT-4,417,0,417,Conversation log
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_azure_csv_is_read_sorted_from_its_first_request(tmp_path: Path) -> None:
    trace = read_trace(write(tmp_path, "azure_code.csv", AZURE))
    assert trace.input_tokens == [110, 4808, 3180, 7433]
    assert trace.output_tokens == [27, 10, 8, 1]  # a logged failure (0) replays as one token
    assert trace.arrival_s[0] == 0.0
    assert trace.arrival_s[1:] == pytest.approx([1.68059, 5.995169, 6.0])


def test_burstgpt_csv_is_read(tmp_path: Path) -> None:
    trace = read_trace(write(tmp_path, "burst.csv", BURSTGPT))
    assert trace.arrival_s == [0.0, 40.0, 113.0]
    assert trace.input_tokens == [472, 1087, 417]
    assert trace.output_tokens == [18, 225, 1]


@pytest.mark.parametrize(("text", "said"), [
    ("time,in,out\n1,2,3\n", ":1: not a trace format"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,10,10\n",
     ":2: column 'TIMESTAMP': not a time"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,ten,10\n",
     ":2: column 'ContextTokens': not a token count"),
    ("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
     "1,m,10,5,15,x\n2,m,10\n", ":3: 3 columns, the header has 6"),
    ("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
     "-4,m,10,5,15,x\n", ":2: column 'Timestamp': not a time"),
])
def test_a_bad_line_names_the_file_line_and_column(tmp_path: Path, text: str, said: str) -> None:
    path = write(tmp_path, "bad.csv", text)
    with pytest.raises(ConfigError) as err:
        read_trace(path, "workload.arrival.path")
    assert err.value.field == "workload.arrival.path"
    assert f"{path}{said}" in err.value.message


def test_a_window_of_a_trace_scaled_to_a_rate_keeps_its_bursts(tmp_path: Path) -> None:
    # Bursty: pairs 0.1 s apart, every 10 s.
    lines = [json.dumps({"t": 10.0 * k + d, "input_tokens": 100, "output_tokens": 10})
             for k in range(20) for d in (0.0, 0.1)]
    path = write(tmp_path, "burst.jsonl", "\n".join(lines))
    spec = parse_workload({"duration_s": 1000, "arrival": {"process": "trace", "path": str(path),
                                                           "start_s": 50, "rate": 2.0}},
                          "workload", None)
    reqs = generate(spec, None, random.Random(0))
    assert len(reqs) == 30  # the window from 50 s: 15 bursts of two
    gaps = [b - a for a, b in zip(reqs.arrival_s, reqs.arrival_s[1:], strict=False)]
    assert len(reqs) / reqs.arrival_s[-1] == pytest.approx(2.0)
    assert max(gaps) / min(gaps) == pytest.approx(99.0)  # the burst shape, scaled as one


def test_bench_replays_a_trace_window(tmp_path: Path) -> None:
    path = write(tmp_path, "azure.csv", AZURE)
    args = argparse.Namespace(
        target="http://127.0.0.1:9", model=None, rate=None, concurrency=None, workload=None,
        trace=str(path), trace_start=1.0, speedup=2.0, duration=3.0, input_tokens="200",
        output_tokens="200", slo_ttft=2.0, slo_tpot=0.1, stream=True, endpoint="chat",
        api_key=None, ignore_eos=False, seed=0, max_requests=None, drain=60.0, timeout=600.0)
    cfg = config_from_args(args)
    assert cfg.workload is not None
    # From 1 s in: the requests at 1.68, 5.995 and 6.0 s, replayed twice as fast.
    assert cfg.workload.arrival_s == pytest.approx([0.340295, 2.4975845, 2.5])
    assert cfg.workload.input_tokens == [4808, 3180, 7433]
    args.trace_start = 100.0
    with pytest.raises(ConfigError, match="no request"):
        config_from_args(args)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_each_trace_shape_reads_back_from_its_own_format(tmp_path: Path, name: str) -> None:
    shape = SHAPES[name]
    reqs = shape.generate(600.0, seed=3)
    path = tmp_path / f"{name}.{'csv' if shape.fmt in ('azure', 'burstgpt') else 'jsonl'}"
    write_shape(path, reqs, shape.fmt)
    back = read_trace(path)
    assert back.input_tokens == reqs.input_tokens
    assert back.output_tokens == reqs.output_tokens
    # Times as precise as the format keeps them (Mooncake: whole milliseconds),
    # counted from the first request where the format counts wall-clock time.
    shift = 0.0 if shape.fmt == "mooncake" else reqs.arrival_s[0]
    assert max(abs(a - shift - b) for a, b in zip(reqs.arrival_s, back.arrival_s,
                                                  strict=True)) < 2e-3


@pytest.mark.parametrize(("name", "rate", "prompt", "answer"), [
    ("mooncake-conv", 12_031 / 3600, 12_035, 343),  # Mooncake FAST'25 conversation trace
    ("azure-code", 2.6, 2_048, 28),  # Azure 2023 code (answers' mean: the fit's, 23)
    ("azure-conv", 5.5, 1_155, 211),  # Azure 2023 conversation
])
def test_trace_shapes_match_their_published_statistics(name: str, rate: float, prompt: float,
                                                        answer: float) -> None:
    reqs = SHAPES[name].generate(3600.0, seed=1)
    assert len(reqs) / 3600.0 == pytest.approx(rate, rel=0.1)
    assert sum(reqs.input_tokens) / len(reqs) == pytest.approx(prompt, rel=0.1)
    assert sum(reqs.output_tokens) / len(reqs) == pytest.approx(answer, rel=0.2)


def test_the_code_shape_is_bursty() -> None:
    reqs = SHAPES["azure-code"].generate(3600.0, seed=1)
    per_minute = [0] * 60
    for t in reqs.arrival_s:
        per_minute[int(t // 60)] += 1
    assert max(per_minute) / (len(reqs) / 60) > 3.0  # Azure's code trace: peak minute 4.2x
