"""Fault isolation in the engine (issue 19, items 1 and 5): sampling parameters are validated to numerically
safe values; a request that fails (raising callback, non-finite distribution) ends alone with an error and
frees its slots; a failed round fails what was in flight and marks the engine unhealthy. Every case checks
the outputs of the other requests against plain greedy, the free slot counts and the engine's health."""

from __future__ import annotations

import http.client
import json
import math

import pytest
import torch
from conftest import build_word_tokenizer
from generation_helpers import wrap_round_forward

from adaflash_hf.engine import Engine, layout_args
from adaflash_hf.engine.lifecycle import NON_FINITE
from adaflash_hf.engine.sampling import GREEDY_TEMPERATURE, RowSampling, SamplingParams, seed_key
from adaflash_hf.serve.server import make_server

from generation_helpers import engine_prompts, make_drafter, make_target, plain_greedy_ids

SLOTS = 3


@pytest.fixture(scope="module")
def pair():
    target = make_target("qwen3")
    return target, make_drafter(target, block_size=8)


@pytest.fixture(scope="module")
def refs(pair):
    prompts = engine_prompts([5, 7, 4, 6], seed=19)
    return prompts, [plain_greedy_ids(pair[0], p, 10) for p in prompts]


def _engine(pair, mode="packed", cls=Engine, **kw):
    return cls(pair[0], **layout_args(pair[1], mode), max_slots=SLOTS, max_len=40, token_budget=48, **kw)


def _assert_clean(engine):
    """Nothing left in flight, every slot free (target and drafter), lengths reset, engine healthy."""
    assert engine.idle and engine.cache.num_free == SLOTS
    assert engine.dcache is None or engine.dcache.num_free == SLOTS
    assert all(n == 0 for n in engine.cache.lengths)
    assert engine.healthy and engine.last_error is None


def _still_serves(engine, refs):
    prompts, expected = refs
    assert engine.generate([prompts[3]], max_new_tokens=10)[0].token_ids == expected[3]


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature="0.7"), "temperature"),
    (dict(temperature=0.7, top_p=float("nan")), "top_p"),
    (dict(temperature=0.7, top_p=0.0), "top_p"),
    (dict(temperature=0.7, top_p=1.5), "top_p"),
    (dict(temperature=0.7, top_k=float("nan")), "top_k"),
    (dict(temperature=0.7, top_k=0), "top_k"),
    (dict(temperature=0.7, top_k=2.5), "top_k"),
    (dict(temperature=0.7, seed=1.5), "seed"),
])
def test_unsafe_sampling_params_refused_before_any_work(pair, kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} must"):
        SamplingParams(**kwargs)
    engine = _engine(pair)
    with pytest.raises(ValueError, match=rf"^{field} must"):
        engine.submit([1, 2, 3], 4, **kwargs)
    _assert_clean(engine)


@pytest.mark.parametrize("temperature, greedy", [
    (0.0, True), (1e-40, True), (1e-38, True), (1e-6, True), (GREEDY_TEMPERATURE, False), (0.7, False)])
def test_tiny_temperature_is_greedy(temperature, greedy):
    params = SamplingParams(temperature=temperature)
    assert params.greedy is greedy and math.isfinite(1.0 / params.temperature if params.temperature else 0.0)
    assert params.temperature == (0.0 if greedy else temperature)


@pytest.mark.parametrize("mode", ["packed", "off"])
def test_tiny_temperatures_served_next_to_greedy(pair, refs, mode):
    """Issue 19 case 1: 1e-40 / 1e-38 overflowed logits / T and killed the round (and the innocent request)."""
    prompts, expected = refs
    engine = _engine(pair, mode)
    handles = [engine.submit(prompts[0], 10), engine.submit(prompts[1], 10, temperature=1e-40),
               engine.submit(prompts[2], 10, temperature=1e-38, seed=3)]
    outs = [h.result() for h in handles]
    assert [o.token_ids for o in outs] == expected[:3]
    assert all(o.finish_reason == "length" and o.error is None for o in outs)
    _assert_clean(engine)
    _still_serves(engine, refs)


# ---------------------------------------------------------------- one request fails alone
def _raise_at(n):
    seen = []

    def cb(tok):
        seen.append(tok)
        if len(seen) == n:
            raise KeyError("consumer bug")
    return cb


@pytest.mark.parametrize("mode, fail_at", [("packed", 1), ("packed", 4), ("fixed", 3), ("off", 2)])
def test_raising_callback_fails_only_its_request(pair, refs, mode, fail_at):
    """Issue 19 case 5: a raising on_token wedged the engine (every later step re-raised)."""
    prompts, expected = refs
    engine = _engine(pair, mode)
    good = [engine.submit(prompts[0], 10), engine.submit(prompts[2], 10, on_token=lambda t: None)]
    bad = engine.submit(prompts[1], 10, on_token=_raise_at(fail_at))
    engine.run_until_idle()
    out = bad.result()
    assert out.finish_reason == "error" and "on_token callback raised KeyError" in out.error
    assert out.token_ids == expected[1][:fail_at]  # what it produced up to the failing token
    assert [h.result().token_ids for h in good] == [expected[0], expected[2]]
    _assert_clean(engine)
    _still_serves(engine, refs)


POISON_SEED = 666


def _poisoned_probs(real):
    """``RowSampling.probs`` with NaN in every row of the request seeded with ``POISON_SEED`` (its seed's key)."""
    def probs(self, logits):
        p = real(self, logits)
        if self.keys is None:
            return p
        keyed = self.keyed_rows if self.keyed_rows is not None else torch.arange(p.shape[0], device=p.device)
        return p.index_fill(0, keyed[self.keys == seed_key(POISON_SEED)], float("nan"))
    return probs


class NaNPrefillEngine(Engine):
    """The target's prefill logits of the first admitted request are NaN (a non-finite row of one request)."""

    poison = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        wrap_round_forward(self, self._poisoned)

    def _poisoned(self, forward, segs, layout, num_prefill, verify_inputs, **kw):
        logits, hidden = forward(segs, layout, num_prefill, verify_inputs, **kw)
        if self.poison and num_prefill:
            logits, self.poison = logits.clone(), False
            logits[0] = float("nan")
        return logits, hidden


@pytest.mark.parametrize("mode", ["packed", "off"])
@pytest.mark.parametrize("fault", ["sampled_probs", "greedy_logits"])
def test_non_finite_distribution_fails_only_its_request(pair, refs, monkeypatch, mode, fault):
    prompts, expected = refs
    if fault == "sampled_probs":  # one sampled request's processed distribution is NaN
        monkeypatch.setattr(RowSampling, "probs", _poisoned_probs(RowSampling.probs))
        engine = _engine(pair, mode)
        bad = engine.submit(prompts[1], 10, temperature=0.8, seed=POISON_SEED)
    else:  # one greedy request's logits are NaN (argmax would silently emit a wrong token)
        engine = _engine(pair, mode, cls=NaNPrefillEngine)
        bad = engine.submit(prompts[1], 10)
    good = [engine.submit(prompts[0], 10), engine.submit(prompts[2], 10)]
    sampled = engine.submit(prompts[3], 10, temperature=0.8, seed=5)
    engine.run_until_idle()
    assert bad.result().finish_reason == "error" and bad.result().error == NON_FINITE
    assert [h.result().token_ids for h in good] == [expected[0], expected[2]]
    assert sampled.result().finish_reason == "length" and len(sampled.result().token_ids) == 10
    _assert_clean(engine)
    _still_serves(engine, refs)


def test_non_finite_logits_in_queued_greedy_steps_fail_only_their_request(pair, refs, monkeypatch):
    """Plain greedy decoding queues ``decode_steps`` steps before one device read (the CUDA-graph path, run
    eagerly here): a row whose logits turn NaN at a middle step fails its request with the non-finite
    error, instead of emitting argmax tokens silently; the other rows and later requests are exact."""
    from adaflash_hf.engine import graphs as graphs_mod

    prompts, expected = refs
    real, calls = graphs_mod.DecodeGraphs._forward_once, {"n": 0}

    def poisoned(self, Tb, qb, Rb=None, keep=True):
        logits, hidden = real(self, Tb, qb, Rb, keep=keep)
        calls["n"] += 1
        if calls["n"] == 3 and Tb >= 2:  # the third decode forward, second row
            logits[1] = float("nan")
        return logits, hidden

    monkeypatch.setattr(graphs_mod.DecodeGraphs, "_forward_once", poisoned)
    engine = Engine(pair[0], None, max_slots=SLOTS, max_len=40, token_budget=48, decode_steps=4, cuda_graphs=True)
    handles = [engine.submit(p, 10) for p in prompts[:3]]
    engine.run_until_idle()
    results = [h.result() for h in handles]
    assert [r.finish_reason for r in results].count("error") == 1
    for r, exp in zip(results, expected):
        if r.finish_reason == "error":
            assert r.error == NON_FINITE and r.token_ids == exp[: len(r.token_ids)]  # nothing wrong emitted
        else:
            assert r.token_ids == exp
    assert engine.num_steps > 0 and calls["n"] >= 3
    monkeypatch.undo()
    _assert_clean(engine)
    _still_serves(engine, refs)


# ---------------------------------------------------------------- the round fails
class FailingEngine(Engine):
    """The batched target forward raises once, on its ``fail_on``-th call (as a CUDA OOM would)."""

    fail_on, calls = 2, 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        wrap_round_forward(self, self._failing)

    def _failing(self, forward, *args, **kw):
        self.calls += 1
        if self.calls == self.fail_on:
            raise RuntimeError("CUDA out of memory (injected)")
        return forward(*args, **kw)


@pytest.mark.parametrize("mode", ["packed", "off"])
def test_failed_round_fails_in_flight_and_marks_unhealthy(pair, refs, mode):
    prompts, expected = refs
    engine = _engine(pair, mode, cls=FailingEngine)
    in_flight = [engine.submit(p, 10) for p in prompts[:SLOTS]]
    queued = engine.submit(prompts[3], 10)  # no slot left: waits, and survives the failed round
    assert engine.step() and engine.num_running == SLOTS
    assert engine.step()  # the failing round: step() itself does not raise
    for h in in_flight:
        out = h.result()
        assert out.finish_reason == "error" and "CUDA out of memory (injected)" in out.error
    assert not engine.healthy and "RuntimeError: CUDA out of memory" in engine.last_error
    assert engine.num_running == 0 and engine.cache.num_free == SLOTS
    assert engine.dcache is None or engine.dcache.num_free == SLOTS
    assert queued.result().token_ids == expected[3]  # the engine still runs; a supervisor decides on restart
    assert engine.idle and engine.cache.num_free == SLOTS and not engine.healthy


# ---------------------------------------------------------------- the server survives
def _http(server, method, path, body=None):
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=30)
    conn.request(method, path, body=None if body is None else json.dumps(body).encode(),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    status, text = resp.status, resp.read().decode()
    conn.close()
    return status, json.loads(text)


def test_server_survives_tiny_temperature_and_a_failing_request(pair, monkeypatch):
    """Issue 19 case 1 over HTTP: temperature 1e-40 used to kill the engine thread (then every answer a 503);
    now it is served greedy, a request whose distribution is NaN gets a 500 alone, and /health stays 200."""
    monkeypatch.setattr(RowSampling, "probs", _poisoned_probs(RowSampling.probs))
    engine, tok = _engine(pair), build_word_tokenizer(128)
    server = make_server(engine, tok, port=0, default_max_tokens=8).start()
    try:
        ids = engine_prompts([5], seed=20)[0]
        text = tok.decode(plain_greedy_ids(pair[0], ids, 8), skip_special_tokens=True)
        for temperature in (0, 1e-40, 1e-38, 0, 1e-40):
            status, body = _http(server, "POST", "/v1/completions", {"prompt": ids, "max_tokens": 8,
                                                                     "temperature": temperature})
            assert status == 200 and body["choices"][0]["text"] == text, body
            assert body["usage"]["completion_tokens"] == 8
        # a request whose distribution is not finite: a 500 for it alone, the server stays healthy
        status, body = _http(server, "POST", "/v1/completions", {"prompt": ids, "max_tokens": 8,
                                                                 "temperature": 0.8, "seed": POISON_SEED})
        assert status == 500 and NON_FINITE in body["error"]["message"]
        status, body = _http(server, "GET", "/health")
        assert status == 200 and body["status"] == "ok"
        status, body = _http(server, "POST", "/v1/completions", {"prompt": ids, "max_tokens": 8, "temperature": 0})
        assert status == 200 and body["choices"][0]["text"] == text
        _assert_clean(engine)  # the engine thread is idle between requests
    finally:
        server.close()
