"""What an online server says of its learning: a log line per update (samples, loss, the guard's verdict), per
swap and per version published (held-back tau before and after), a rate-limited line when the full buffer drops
samples, `/metrics`' live acceptance by served version (parsed by prometheus_client's own parser), and the warning
that `serve --online` without `--output-dir` keeps nothing."""

from __future__ import annotations

import logging
import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

import adaflash_hf.serve.server as server_mod
from adaflash_hf.cli import main
from adaflash_hf.serve.metrics import ServerMetrics
from adaflash_hf.online import OnlineAdapter
from adaflash_hf.online import adapter as adapter_mod
from online_helpers import BLOCK, fresh_drafter, pair, real_requests, real_rounds  # noqa: F401 (pair: a fixture)


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "adaflash_hf.online"]


def _metrics(metrics: ServerMetrics) -> dict[str, float]:
    text = metrics.render().decode()
    return {s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_an_update_logs_its_samples_loss_guard_swap_and_version(pair, tmp_path, caplog):
    requests = real_requests(pair, fresh_drafter(pair))
    adapter = OnlineAdapter(fresh_drafter(pair), pair, samples_per_update=4, guard_samples=1, guard_margin=100.0,
                            epochs=1, lr=1e-3, rollback_rounds=0, output_dir=str(tmp_path / "versions"))
    caplog.set_level(logging.INFO, logger="adaflash_hf.online")
    try:
        for r in requests[:4]:
            adapter.on_request(r)
        assert adapter.wait_for_update(60) and adapter.flush(60)
    finally:
        adapter.close()
    lines = _lines(caplog)
    update = [m for m in lines if m.startswith("online update 1 (opd)")]
    assert len(update) == 1, lines
    m = re.search(r": (\d+) samples, loss ([\d.]+) -> ([\d.]+), guard: passed, held-back tau ([\d.]+) -> ([\d.]+) "
                  r"on 1 requests", update[0])
    assert m is not None, update[0]
    record = adapter.stats["history"][0]
    assert int(m.group(1)) == record["samples"] == 3  # one of the four held back for the guard
    assert float(m.group(4)) == pytest.approx(record["guard_serving"], abs=1e-3)
    assert float(m.group(5)) == pytest.approx(record["guard_candidate"], abs=1e-3)
    assert any(m.startswith("online swap: update 1's weights serve from now on") for m in lines), lines
    published = [m for m in lines if m.startswith("online version 1 published (update 1)")]
    assert len(published) == 1 and f"held-back tau {record['guard_serving']:.3f} -> " in published[0], lines


def test_a_refused_update_logs_its_samples_loss_and_verdict(pair, caplog):
    requests = real_requests(pair, fresh_drafter(pair))
    # margin -100: a candidate must gain 100 tokens per block, so the guard refuses it (the test above: the control)
    adapter = OnlineAdapter(fresh_drafter(pair), pair, samples_per_update=4, guard_samples=1, guard_margin=-100.0,
                            epochs=1, lr=1e-3, rollback_rounds=0)
    caplog.set_level(logging.INFO, logger="adaflash_hf.online")
    try:
        for r in requests[:4]:
            adapter.on_request(r)
        assert adapter.wait_for_update(60)
    finally:
        adapter.close()
    lines = _lines(caplog)
    refused = [m for m in lines if m.startswith("online update 1 (opd): 3 samples, loss ")]
    assert len(refused) == 1 and "guard: refused, serving weights unchanged" in refused[0], lines
    assert not any(m.startswith(("online swap", "online version")) for m in lines), lines


def test_drops_from_a_full_buffer_are_logged_at_most_once_an_interval(pair, caplog, monkeypatch):
    rounds = real_rounds(pair, fresh_drafter(pair))
    assert len(rounds) >= 7
    adapter = OnlineAdapter(fresh_drafter(pair), pair, sample_unit="round", samples_per_update=100, max_buffer_samples=2)
    caplog.set_level(logging.INFO, logger="adaflash_hf.online")
    try:
        for r in rounds[:5]:  # the third drops the first; the fourth and fifth drop within the interval: no line
            adapter.on_round(r)
        full = [m for m in _lines(caplog) if m.startswith("online buffer full")]
        assert len(full) == 1 and "its 1 oldest sample dropped" in full[0], full
        monkeypatch.setattr(adapter_mod, "DROP_LOG_INTERVAL_S", 0.0)  # the interval over: the next drop says all
        adapter.on_round(rounds[5])
        full = [m for m in _lines(caplog) if m.startswith("online buffer full")]
        assert len(full) == 2 and "its 3 oldest samples dropped" in full[1] and "(4 dropped in all)" in full[1], full
        assert adapter.stats["samples_dropped"] == 4 and adapter.stats["samples_buffered"] == 2
    finally:
        adapter.close()


def test_metrics_count_live_acceptance_under_the_version_serving(pair, tmp_path):
    drafter = fresh_drafter(pair)
    rounds = real_rounds(pair, drafter)
    requests = real_requests(pair, drafter)
    adapter = OnlineAdapter(drafter, pair, samples_per_update=4, guard_samples=0, epochs=1, lr=1e-3,
                            rollback_rounds=0, output_dir=str(tmp_path / "versions"))
    metrics = ServerMetrics(block_size=BLOCK, online_stats=lambda: adapter.stats)
    try:
        first, later = rounds[: len(rounds) // 2], rounds[len(rounds) // 2 :]
        for r in first:
            adapter.on_round(r)
        before = _metrics(metrics)
        assert before["adaflash_online_served_version"] == 0
        assert before['adaflash_online_served_rounds_total{version=0}'] == len(first)
        assert before['adaflash_online_served_accepted_tokens_total{version=0}'] == sum(r.num_accepted for r in first)
        assert before["adaflash_online_served_tau"] == pytest.approx(1 + sum(r.num_accepted for r in first) / len(first))
        for r in requests[:4]:
            adapter.on_request(r)
        assert adapter.wait_for_update(60) and adapter.flush(60)
        for r in later:
            adapter.on_round(r)
        after = _metrics(metrics)
    finally:
        adapter.close()
    assert after["adaflash_online_served_version"] == 1
    assert after['adaflash_online_served_rounds_total{version=0}'] == len(first)  # a counter: never moves back
    assert after['adaflash_online_served_rounds_total{version=1}'] == len(later)
    assert after['adaflash_online_served_accepted_tokens_total{version=1}'] == sum(r.num_accepted for r in later)
    assert after["adaflash_online_served_tau"] == pytest.approx(1 + sum(r.num_accepted for r in later) / len(later))


@pytest.mark.parametrize("keep", [False, True])
def test_serve_online_without_an_output_dir_says_nothing_will_be_kept(monkeypatch, capsys, tmp_path, keep):
    class Stop(server_mod.OpenAIServer):  # stopped where the server would bind: no model loads
        def __init__(self, address, service=None, settings=None):
            raise OSError(98, "stopped by the test")

    monkeypatch.setattr(server_mod, "OpenAIServer", Stop)
    rc = main(["serve", "--online", *(["--output-dir", str(tmp_path / "v")] if keep else [])])
    err = capsys.readouterr().err
    assert rc == 2 and "stopped by the test" in err
    assert ("--online without --output-dir" in err and "nothing is kept" in err) != keep, err
