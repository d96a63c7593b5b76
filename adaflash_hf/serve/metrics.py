"""What the server exposes at ``GET /metrics``, in the Prometheus text format (``prometheus_client``).

Counters grow from the server's start; rates and ratios are PromQL's job, as in vLLM (whose
speculative-decoding and latency names these follow). Every finished engine request (one per choice) is
counted once, streamed or not, by the service that submitted it.

======================================================  =============================================
name                                                    meaning
======================================================  =============================================
``adaflash_requests_total{finish_reason}``              finished requests: ``stop`` (end of sequence or a
                                                        stop string), ``length``, ``cancelled`` (the client
                                                        left, or the server stopped), ``error``
``adaflash_requests_rejected_total{status}``            requests answered with an error status (400, 401,
                                                        404, 408, 413, 429, 503, ...; a client gone is not)
``adaflash_prompt_tokens_total``                        prompt tokens of finished requests
``adaflash_generation_tokens_total``                    tokens generated
``adaflash_time_to_first_token_seconds``                histogram: submission to the first token
``adaflash_inter_token_latency_seconds``                histogram: between a request's successive rounds
                                                        (one observation per round that committed tokens)
``adaflash_e2e_request_latency_seconds``                histogram: submission to the last token
``adaflash_spec_decode_num_drafts_total``               verify rounds (one per request per round)
``adaflash_spec_decode_num_draft_tokens_total``         drafted tokens verified
``adaflash_spec_decode_num_accepted_tokens_total``      drafted tokens accepted
``adaflash_spec_decode_num_emitted_tokens_total``       tokens verify rounds committed (accepted + 1 each)
``adaflash_spec_decode_num_draft_tokens_per_pos_total`` verified, by draft position (1 = first draft)
``adaflash_spec_decode_num_accepted_tokens_per_pos_total`` accepted, by draft position
``adaflash_spec_decode_tau``                            tau since the start: (accepted + rounds) / rounds
``adaflash_spec_decode_mean_verify_length``             tokens verified per round, the target's own included
======================================================  =============================================

Tau over a window is ``rate(adaflash_spec_decode_num_emitted_tokens_total[5m]) /
rate(adaflash_spec_decode_num_drafts_total[5m])``; the gauge averages since the start.

With an online adapter (``online_stats``: a callable returning the adapter's ``stats`` dict):
``adaflash_online_served_version`` (0: the weights the server started with), ``adaflash_online_updates_total``,
``adaflash_online_update_failures_total``, ``adaflash_online_swaps_refused_total``, ``adaflash_online_rollbacks_total``,
``adaflash_online_write_failures_total`` (versions that could not be written: a full disk),
``adaflash_online_versions_rejected_total`` (damaged versions skipped when the server resumed),
``adaflash_online_last_loss``, ``adaflash_online_last_head_error`` (the length head's mean absolute error on the
rounds served since the last swap), ``adaflash_online_samples_seen_total``, ``adaflash_online_samples_buffered``,
``adaflash_online_samples_dropped_total``, ``adaflash_online_served_tau`` (tau of the rounds served since the last
swap), and the live acceptance of each version, ``adaflash_online_served_rounds_total{version}`` /
``adaflash_online_served_accepted_tokens_total{version}`` (rounds served while that version served, and the drafts they
accepted; the start weights and swaps not yet written count under the newest version written, so without
``--output-dir`` all under 0): tau by version over a window is ``1 + rate(..._served_accepted_tokens_total[5m]) /
rate(..._served_rounds_total[5m])``. Acceptance per position over a window is
``rate(..._accepted_tokens_per_pos_total[5m]) / rate(..._draft_tokens_per_pos_total[5m])``.

Example::

    metrics = ServerMetrics(block_size=16)
    metrics.observe(engine_output)          # once per finished request
    text = metrics.render()                 # what GET /metrics answers
"""

from __future__ import annotations

import math
import threading
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..speculation.rounds import position_counts

__all__ = ["CONTENT_TYPE", "ServerMetrics", "online_health"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_ONLINE_COUNTERS = (  # (name, help, key of the adapter's stats)
    ("online_updates", "online updates swapped in", "updates"),
    ("online_update_failures", "online updates that failed (serving weights unchanged)", "failures"),
    ("online_swaps_refused", "updates kept aside: they lowered acceptance on held-back traffic", "swaps_refused"),
    ("online_rollbacks", "swaps undone because served tau fell after them", "rollbacks"),
    ("online_write_failures", "versions that could not be written (their weights serve all the same)", "write_failures"),
    ("online_versions_rejected", "damaged versions skipped when the server resumed", "versions_rejected"),
    ("online_samples_seen", "samples offered to the adapter's buffer", "samples_seen"),
    ("online_samples_dropped", "samples dropped from the buffer (full, or superseded by an update)", "samples_dropped"),
)
_ONLINE_GAUGES = (
    ("online_samples_buffered", "samples waiting for the next update", "samples_buffered"),
    ("online_last_loss", "the last update's mean distillation loss (last epoch)", "last_loss"),
    ("online_last_head_error", "the length head's mean absolute error on rounds served since the last swap", "head_error"),
    ("online_served_tau", "tokens per verify round served since the last swap", "tau_since_update"),
)


# Buckets as vLLM's (seconds): a CPU's slower tail fits in them too.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
                960.0, 1920.0, 7680.0)


def round_ends(output, n_times: int) -> list[int]:
    """Indices (into a request's token times) of the last token each engine step committed: the prefill's first
    token, then each verify round's ``accepted + 1`` (fewer where the request stopped inside); one token per
    step when the rounds do not account for every token (plain decoding)."""
    sizes = [1] + [a + 1 for a in output.accepted]
    ends, total = [], 0
    for size in sizes:
        total += size
        ends.append(min(total, n_times) - 1)
        if total >= n_times:
            break
    return ends if total >= n_times else list(range(n_times))


class ServerMetrics:
    """The server's counters in their own registry (several servers in one process never collide).

    Args:
        block_size: the drafter's block (draft positions ``1 .. block_size - 1``); 1 without a drafter.
        online_stats: returns the online adapter's ``stats`` (or None); read at every scrape.
    """

    def __init__(self, block_size: int = 1, online_stats: Callable[[], dict | None] | None = None):
        self.registry = CollectorRegistry(auto_describe=True)
        self.online_stats = online_stats
        self._lock = threading.Lock()  # finished requests arrive on the engine thread, scrapes on the loop
        self._positions = max(int(block_size) - 1, 0)
        self._rounds = self._accepted = self._verified = 0
        self._by_pos = [[0, 0] for _ in range(self._positions)]  # [verified, accepted] per draft position
        self.requests = Counter("adaflash_requests", "finished requests", ["finish_reason"], registry=self.registry)
        self.prompt_tokens = Counter("adaflash_prompt_tokens", "prompt tokens of finished requests", registry=self.registry)
        self.generation_tokens = Counter("adaflash_generation_tokens", "tokens generated", registry=self.registry)
        self.rejected = Counter("adaflash_requests_rejected", "requests answered with an error status", ["status"],
                                registry=self.registry)
        self.ttft = Histogram("adaflash_time_to_first_token_seconds", "seconds from submission to the first token",
                              buckets=_TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("adaflash_inter_token_latency_seconds", "seconds between a request's successive rounds",
                             buckets=_ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("adaflash_e2e_request_latency_seconds", "seconds from submission to the last token",
                             buckets=_E2E_BUCKETS, registry=self.registry)
        self.registry.register(_Collector(self))

    def reject(self, status: int) -> None:
        """Count a request answered with error ``status`` (a client that left before its answer is not counted)."""
        if status >= 400 and status != 499:
            self.rejected.labels(str(status)).inc()

    def observe(self, output, finish_reason: str | None = None,
                timing: tuple[float, list[float], float] | None = None) -> None:
        """Count one finished request (an :class:`~adaflash_hf.engine.EngineOutput`); ``finish_reason``: as the
        client sees it (default: the output's); ``timing``: (submitted, each token's time, finished) on
        ``time.perf_counter``'s clock, for the latency histograms."""
        self.requests.labels(finish_reason or output.finish_reason).inc()
        self.prompt_tokens.inc(len(output.prompt_ids))
        self.generation_tokens.inc(len(output.token_ids))
        if timing is not None:
            self._observe_latency(output, *timing)
        if not self._positions:
            return
        by_pos = position_counts(output.accepted, output.verify_lengths, self._positions)
        with self._lock:
            self._rounds += len(output.accepted)
            self._accepted += sum(output.accepted)
            for total, (verified, accepted) in zip(self._by_pos, by_pos):
                total[0] += verified
                total[1] += accepted
            self._verified += sum(v for v, _ in by_pos)

    def _observe_latency(self, output, started: float, times: list[float], finished: float) -> None:
        self.e2e.observe(max((times[-1] if times else finished) - started, 0.0))
        if not times:
            return
        self.ttft.observe(max(times[0] - started, 0.0))
        ends = [times[i] for i in round_ends(output, len(times))]
        for before, after in zip(ends, ends[1:]):
            self.itl.observe(max(after - before, 0.0))

    def spec_counts(self) -> dict:
        """``rounds``, ``accepted``, ``verified`` (drafted tokens) and ``by_position`` ([verified, accepted])."""
        with self._lock:
            return {"rounds": self._rounds, "accepted": self._accepted, "verified": self._verified,
                    "by_position": [list(p) for p in self._by_pos]}

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric (served with :data:`CONTENT_TYPE`)."""
        return generate_latest(self.registry)


class _Collector:
    """The metrics computed at scrape time: speculative counts, tau, and the online adapter's state."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def describe(self):
        return []  # computed per scrape: nothing to check at registration

    def collect(self):
        m = self.metrics
        if m._positions:
            yield from self._spec(m.spec_counts())
        stats = m.online_stats() if m.online_stats is not None else None
        if stats:
            yield from self._online(stats)

    @staticmethod
    def _spec(c: dict):
        p = "adaflash_spec_decode_"
        for name, what, value in (("num_drafts", "verify rounds", c["rounds"]),
                                  ("num_draft_tokens", "drafted tokens verified", c["verified"]),
                                  ("num_accepted_tokens", "drafted tokens accepted", c["accepted"]),
                                  ("num_emitted_tokens", "tokens verify rounds committed (accepted + 1 each)",
                                   c["accepted"] + c["rounds"])):
            yield CounterMetricFamily(p + name, what, value=value)
        verified = CounterMetricFamily(p + "num_draft_tokens_per_pos", "drafted tokens verified, by draft position",
                                       labels=["position"])
        accepted = CounterMetricFamily(p + "num_accepted_tokens_per_pos", "drafted tokens accepted, by draft position",
                                       labels=["position"])
        for j, (v, a) in enumerate(c["by_position"], start=1):
            verified.add_metric([str(j)], v)
            accepted.add_metric([str(j)], a)
        yield verified
        yield accepted
        rounds = c["rounds"]
        yield GaugeMetricFamily(p + "tau", "tokens committed per verify round since the start",
                                value=(c["accepted"] + rounds) / rounds if rounds else 0.0)
        yield GaugeMetricFamily(p + "mean_verify_length", "tokens verified per round, the target's own included",
                                value=(c["verified"] + rounds) / rounds if rounds else 0.0)

    @staticmethod
    def _online(stats: dict):
        versions = stats.get("versions") or []
        yield GaugeMetricFamily("adaflash_online_served_version", "the online version being served (0: the start weights)",
                                value=float(stats.get("served_version", versions[-1] if versions else 0) or 0))
        for name, what, key in _ONLINE_COUNTERS:
            yield CounterMetricFamily("adaflash_" + name, what, value=float(stats.get(key) or 0))
        for name, what, key in _ONLINE_GAUGES:
            value = stats.get(key)
            yield GaugeMetricFamily("adaflash_" + name, what, value=math.nan if value is None else float(value))
        rounds = CounterMetricFamily("adaflash_online_served_rounds", "verify rounds served, by the version serving them",
                                     labels=["version"])
        accepted = CounterMetricFamily("adaflash_online_served_accepted_tokens",
                                       "drafted tokens accepted, by the version serving them", labels=["version"])
        for version, counts in sorted((stats.get("served_by_version") or {}).items()):
            rounds.add_metric([str(version)], counts["rounds"])
            accepted.add_metric([str(version)], counts["accepted"])
        yield rounds
        yield accepted


_HEALTH_KEYS = ("served_version", "resumed_from", "updates", "failures", "write_failures", "swaps_refused", "rollbacks",
                "versions_rejected", "stopped", "last_error")


def online_health(stats: dict) -> dict:
    """What ``/health`` says of an online adapter (its ``stats``): the version serving, the counts of what went
    wrong, the last error, and ``status``: ``ok``, or ``degraded`` once a version could not be written, an update
    failed, a damaged version was skipped or adapting stopped (serving goes on either way).

    Example:
        >>> online_health({"served_version": 3, "write_failures": 1, "last_error": "OSError: disk full"})["status"]
        'degraded'
    """
    out = {k: stats.get(k) for k in _HEALTH_KEYS}
    bad = any(stats.get(k) for k in ("failures", "write_failures", "versions_rejected", "stopped"))
    return {"status": "degraded" if bad else "ok", **out}
