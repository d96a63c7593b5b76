"""`GET /metrics`'s counts, checked by hand on small rounds, and the online gauges read from an adapter's stats."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from adaflash_hf.serve.metrics import ServerMetrics


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


def test_finish_reason_as_the_client_sees_it_and_tau_as_counters():
    """The service passes the finish reason its client saw (a stop string's `stop`, where the engine says
    `cancelled`); emitted tokens (accepted + 1 per round) over rounds is tau over any window."""
    m = ServerMetrics(block_size=4)
    m.observe(_out([2, 0], [4, 4], finish="cancelled"), finish_reason="stop")
    m.observe(_out([3], [4], finish="cancelled"))
    before = _samples(m)
    m.observe(_out([1, 1, 1], [4, 4, 4]))
    s = _samples(m)
    assert s["adaflash_requests_total{stop}"] == 1 and s["adaflash_requests_total{cancelled}"] == 1
    assert s["adaflash_spec_decode_num_emitted_tokens_total"] == (2 + 0 + 3 + 3) + 6
    window = (s["adaflash_spec_decode_num_emitted_tokens_total"] - before["adaflash_spec_decode_num_emitted_tokens_total"]) \
        / (s["adaflash_spec_decode_num_drafts_total"] - before["adaflash_spec_decode_num_drafts_total"])
    assert window == pytest.approx(2.0) != pytest.approx(s["adaflash_spec_decode_tau"])  # the gauge: since the start


def test_latency_histograms_observe_one_gap_per_round():
    """First token at 0.5 s (prefill), then rounds of 3 and 2 tokens ending at 1.0 s and 1.25 s, tokens within a round
    1 ms apart: one inter-token gap per round (0.5 s, 0.25 s), not one per token."""
    m = ServerMetrics(block_size=4)
    times = [10.5, 10.998, 10.999, 11.0, 11.249, 11.25]
    m.observe(_out([2, 1], [4, 4], tokens=6), timing=(10.0, times, 11.3))
    s = _samples(m)
    assert s["adaflash_time_to_first_token_seconds_count"] == 1
    assert s["adaflash_time_to_first_token_seconds_sum"] == pytest.approx(0.5)
    assert s["adaflash_inter_token_latency_seconds_count"] == 2
    assert s["adaflash_inter_token_latency_seconds_sum"] == pytest.approx(0.75)
    assert s["adaflash_e2e_request_latency_seconds_sum"] == pytest.approx(1.25)
    plain = ServerMetrics(block_size=1)  # no rounds recorded: one step per token
    plain.observe(_out([], [], tokens=3), timing=(0.0, [0.1, 0.2, 0.4], 0.5))
    assert _samples(plain)["adaflash_inter_token_latency_seconds_count"] == 2


def test_rejections_are_counted_by_status_but_a_client_gone_is_not():
    m = ServerMetrics()
    for status in (400, 400, 401, 408, 429, 503, 499, 200):
        m.reject(status)
    s = {k: v for k, v in _samples(m).items() if k.startswith("adaflash_requests_rejected_total")}
    assert s == {f"adaflash_requests_rejected_total{{{c}}}": n for c, n in ((400, 2), (401, 1), (408, 1), (429, 1), (503, 1))}


def test_online_write_failures_and_rejected_versions_reach_metrics_and_health():
    from adaflash_hf.serve.metrics import online_health

    stats = {"updates": 2, "failures": 0, "write_failures": 3, "versions_rejected": 1, "served_version": 4,
             "resumed_from": 4, "last_error": "could not write online version: OSError: No space left on device"}
    s = _samples(ServerMetrics(block_size=4, online_stats=lambda: stats))
    assert s["adaflash_online_write_failures_total"] == 3 and s["adaflash_online_versions_rejected_total"] == 1
    health = online_health(stats)
    assert health["status"] == "degraded" and health["served_version"] == 4 and "No space" in health["last_error"]
    assert online_health({**stats, "write_failures": 0, "versions_rejected": 0})["status"] == "ok"  # control
