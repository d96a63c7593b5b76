"""`GET /metrics`'s counts, checked by hand on small rounds, and the online gauges read from an adapter's stats."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from adaflash_hf.engine.serve.metrics import ServerMetrics


def _samples(metrics: ServerMetrics) -> dict[str, float]:
    return {s.name + "".join(f"{{{v}}}" for _, v in sorted(s.labels.items())): s.value
            for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}


def _out(accepted, verify_lengths, prompt=3, tokens=5, finish="length"):
    return SimpleNamespace(accepted=accepted, verify_lengths=verify_lengths, prompt_ids=[0] * prompt,
                           token_ids=[0] * tokens, finish_reason=finish)


# (rounds as (accepted, verify length), block size, expected verified per position, accepted per position)
CASES = {
    "whole blocks": ([(2, 4), (0, 4), (3, 4)], 4, [3, 3, 3], [2, 2, 1]),
    "adaptive lengths": ([(1, 2), (0, 1), (2, 3)], 4, [2, 1, 0], [2, 1, 0]),
    "nothing accepted": ([(0, 4)], 4, [1, 1, 1], [0, 0, 0]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_spec_counts_per_position(case):
    rounds, block, verified, accepted = CASES[case]
    m = ServerMetrics(block_size=block)
    m.observe(_out([a for a, _ in rounds], [v for _, v in rounds]))
    s = _samples(m)
    assert [s[f"adaflash_spec_decode_num_draft_tokens_per_pos_total{{{j}}}"] for j in range(1, block)] == verified
    assert [s[f"adaflash_spec_decode_num_accepted_tokens_per_pos_total{{{j}}}"] for j in range(1, block)] == accepted
    n = len(rounds)
    assert s["adaflash_spec_decode_num_drafts_total"] == n
    assert s["adaflash_spec_decode_num_accepted_tokens_total"] == sum(accepted)
    assert s["adaflash_spec_decode_tau"] == pytest.approx((sum(a for a, _ in rounds) + n) / n)
    assert s["adaflash_spec_decode_mean_verify_length"] == pytest.approx(sum(v for _, v in rounds) / n)


def test_requests_tokens_and_online_gauges():
    stats = {"updates": 3, "failures": 1, "versions": [1, 2, 3], "served_version": 3, "samples_seen": 40,
             "samples_dropped": 2, "samples_buffered": 5, "last_loss": 1.25, "head_error": None}
    m = ServerMetrics(block_size=4, online_stats=lambda: stats)
    m.observe(_out([1], [4], prompt=7, tokens=2, finish="eos"))
    m.observe(_out([], [], prompt=1, tokens=1, finish="cancelled"))
    s = _samples(m)
    assert s["adaflash_requests_total{eos}"] == 1 and s["adaflash_requests_total{cancelled}"] == 1
    assert s["adaflash_prompt_tokens_total"] == 8 and s["adaflash_generation_tokens_total"] == 3
    assert s["adaflash_online_served_version"] == 3 and s["adaflash_online_updates_total"] == 3
    assert s["adaflash_online_update_failures_total"] == 1 and s["adaflash_online_last_loss"] == 1.25
    assert math.isnan(s["adaflash_online_last_head_error"])  # unknown yet: NaN, not a made-up 0


def test_without_a_drafter_or_adapter_no_spec_or_online_metrics():
    m = ServerMetrics(block_size=1)
    m.observe(_out([0, 0], [1, 1]))
    names = set(_samples(m))
    assert "adaflash_generation_tokens_total" in names
    assert not any(n.startswith(("adaflash_spec_", "adaflash_online_")) for n in names)
