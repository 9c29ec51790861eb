"""Prefill/decode roles in the inventory planner (``--roles auto``): the candidate
splits of the whole inventory, the choice, and one measured run of the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_formation import CAT, rater

from tailguard.cli import main
from tailguard.planner.inventory import parse_inventory
from tailguard.planner.roles import (
    NONE,
    RoleChoice,
    candidates,
    choose_roles,
    chosen_part,
    is_split,
    naive_splits,
    whole_inventory,
)

INVENTORY = {"hosts": [{"name": "h1", "gpu": "H100-SXM", "count": 2, "link": "nvlink"},
                       {"name": "a1", "gpu": "A100-80GB", "count": 2, "link": "nvlink"},
                       {"name": "l1", "gpu": "L40S", "count": 2}]}


def test_the_whole_inventory_is_formed_and_every_split_named() -> None:
    inv = parse_inventory(INVENTORY)
    full = whole_inventory(inv, rater("llama-3.1-8b"))
    assert sum(r.rated.shape.gpus for r in full.replicas) == 6
    got = candidates(full)
    assert got[0].name.startswith("co-located: ") and not is_split(got[0])
    # Three types: 7 subsets co-located, and prefill/both splits of the 4 larger ones
    # (3 pairs x 1 split point + the triple's 2) x 2 kinds.
    assert len(got) == 7 + 2 * (3 * 1 + 2)
    # Types by compute per byte of bandwidth: L40S (419 FLOP/B), H100 (295), A100 (153).
    names = {c.name for c in got}
    assert "L40S + H100-SXM prefill, A100-80GB decode" in names
    assert "H100-SXM both, A100-80GB decode" in names
    split = next(c for c in got if c.name == "H100-SXM prefill, A100-80GB decode")
    part, roles = chosen_part(full, split)
    assert roles == ("prefill", "prefill", "decode", "decode")
    assert split.cost_per_hour == pytest.approx(sum(r.rated.shape.cost_per_hour
                                                    for r in part.replicas))
    assert NONE in split.roles  # the L40S are left out of it
    naive = naive_splits(full)
    assert [c.name for c in naive] == ["naive: H100-SXM prefill, the rest decode",
                                       "naive: H100-SXM decode, the rest prefill"]


def test_a_split_must_beat_the_best_co_located_choice() -> None:
    plan = RoleChoice("co-located plan", (), 4.0, 10.0)
    colo = RoleChoice("co-located: a + b", ("both", "both"), 6.0, 12.0)  # 0.5 per $/h
    split = RoleChoice("a prefill, b decode", ("prefill", "decode"), 6.1, 12.0)
    assert choose_roles([colo, split], plan) is colo  # within 3% of it: co-located
    better = RoleChoice("a prefill, b decode", ("prefill", "decode"), 7.0, 12.0)
    assert choose_roles([colo, better], plan) is better
    assert choose_roles([RoleChoice("x", ("both",), 3.0, 10.0)], plan) is None
    assert choose_roles([colo, split], plan, "goodput") is colo


def test_cli_measures_the_splits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inv = tmp_path / "inv.yaml"
    inv.write_text("hosts:\n  - {name: h1, gpu: H100-SXM, count: 1}\n"
                   "  - {name: a1, gpu: A100-80GB, count: 1}\n")
    args = ["plan", "--inventory", str(inv), "--model", "llama-3.1-8b", "--slo-ttft", "5",
            "--slo-tpot", "0.05", "--lengths", "azure-code", "--roles", "auto", "--format", "json"]
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    roles = doc["roles"]
    assert set(roles["measured"]) >= {"co-located: H100-SXM + A100-80GB",
                                      "H100-SXM prefill, A100-80GB decode"}
    assert all(m["goodput_rps"] >= 0.0 for m in roles["measured"].values())
    assert roles["co_located_plan_goodput_rps"] > 0.0
    assert main([*args[:-2], "--rate", "3"]) == 2  # auto plans the inventory as it is
    assert CAT.gpu("H100-SXM").ridge_flops_per_byte > CAT.gpu("A100-80GB").ridge_flops_per_byte
