"""KV transfer between a prefill and a decode instance: bytes per token from the
model card, time over a link, and which link a pair of nodes uses."""

from __future__ import annotations

import pytest

from tailguard.core.hardware import DEFAULT_CATALOG
from tailguard.core.kv_transfer import DEFAULT_LINK, LINKS, Link, LinkMap, kv_transfer_s


def test_kv_bytes_per_token_match_the_model_cards() -> None:
    # facts.md: Llama-3.1-8B 128 KiB, Llama-3.1-70B 320 KiB (BF16).
    assert DEFAULT_CATALOG.model("llama-3.1-8b").kv_bytes_per_token == 128 * 1024
    assert DEFAULT_CATALOG.model("llama-3.1-70b").kv_bytes_per_token == 320 * 1024


def test_mooncake_mean_prompt_over_rdma_takes_18_ms() -> None:
    # The module's worked example: 12,035 tokens of Llama-3.1-8B (1.58 GB) over
    # Mooncake's 87 GB/s on 4x200 Gb RoCE.
    per_token = DEFAULT_CATALOG.model("llama-3.1-8b").kv_bytes_per_token
    rdma = LINKS["rdma-4x200"]
    t = kv_transfer_s(per_token, 12_035, rdma)
    assert t - rdma.setup_s == pytest.approx(12_035 * 131_072 / 87e9)
    assert 0.018 < t < 0.020
    assert kv_transfer_s(per_token, 12_035, LINKS["tcp"]) == pytest.approx(
        0.002 + 12_035 * 131_072 / 40e9)
    assert kv_transfer_s(per_token, 0, rdma) == 0.0


def test_a_pair_uses_its_own_link_else_the_slower_nic() -> None:
    slow = Link(3.125, 0.002)  # one 25 Gb/s NIC
    links = LinkMap(nodes={"l4-0": slow}, pairs={frozenset(("h0", "h1")): LINKS["nvlink"]})
    assert links.between("h0", "h0") is None
    assert links.between("h1", "h0") == LINKS["nvlink"]
    assert links.between("h0", "a0") == DEFAULT_LINK
    assert links.between("h0", "l4-0") == Link(3.125, 0.002)
    assert links.between("l4-0", "h0") == links.between("h0", "l4-0")
    assert links.transfer_s("h0", "h0", 131_072, 10_000) == 0.0
    assert links.transfer_s("h0", "l4-0", 131_072, 10_000) == pytest.approx(
        0.002 + 10_000 * 131_072 / 3.125e9)


def test_a_link_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="bandwidth"):
        Link(0.0)
    with pytest.raises(ValueError, match="setup"):
        Link(10.0, -1.0)
