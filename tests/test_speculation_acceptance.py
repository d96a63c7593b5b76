"""Acceptance math: greedy prefix rule, Leviathan speculative sampling, speedup model."""

from __future__ import annotations

import math

import pytest
import torch

from adaflash_hf.speculation import acceptance
from adaflash_hf.speculation.acceptance import (
    AcceptResult,
    acceptance_probability,
    expected_accepted_tokens,
    expected_speedup,
    greedy_accept,
    residual_distribution,
    speculative_accept,
)

# --------------------------------------------------------------------------------------------
# Greedy: each case builds drafts from the target's argmax and breaks them at `mismatch[row]`
# (None = no break), so the expected accepted count follows from the construction. Padding
# positions (>= draft_len) are made to *match* the target, so counting them would show.

GREEDY_CASES = [
    # name, k, V, mismatch per row, draft_len per row (None = full)
    ("all_accepted", 4, 7, [None, None], None),
    ("none_accepted", 4, 7, [0, 0], None),
    ("mismatch_mid_block", 5, 7, [2, 3], None),
    ("mismatch_last", 3, 5, [2], None),
    ("ragged_draft_len", 4, 6, [None, None, 1, 3, 0], [4, 2, 3, 1, 0]),
    ("mismatch_only_in_padding", 4, 6, [3, 2], [2, 2]),
    ("empty_draft", 0, 4, [None, None], None),
]


def _greedy_case(k, V, mismatch, draft_len, seed=0):
    g = torch.Generator().manual_seed(seed)
    b = len(mismatch)
    logits = torch.randn(b, k + 1, V, generator=g)
    top = logits.argmax(-1)
    draft = top[:, :k].clone()
    for row, m in enumerate(mismatch):
        if m is not None:
            draft[row, m] = (top[row, m] + 1) % V
    dl = torch.full((b,), k) if draft_len is None else torch.tensor(draft_len)
    expected = torch.tensor([dl[r].item() if m is None else min(m, dl[r].item()) for r, m in enumerate(mismatch)])
    return draft, logits, (None if draft_len is None else dl), expected


@pytest.mark.parametrize("name,k,V,mismatch,draft_len", GREEDY_CASES, ids=[c[0] for c in GREEDY_CASES])
def test_greedy_accept_cases(name, k, V, mismatch, draft_len):
    draft, logits, dl, expected = _greedy_case(k, V, mismatch, draft_len)
    res = greedy_accept(draft, logits, dl)
    assert isinstance(res, AcceptResult)
    assert res.num_accepted.dtype == torch.long and res.next_tokens.dtype == torch.long
    assert torch.equal(res.num_accepted, expected)
    top = logits.argmax(-1)
    assert torch.equal(res.next_tokens, top.gather(1, expected[:, None]).squeeze(1))
    for row in range(draft.shape[0]):  # the accepted prefix really is the target's argmax prefix
        n = int(res.num_accepted[row])
        assert torch.equal(draft[row, :n], top[row, :n])


@pytest.mark.parametrize("name,k,V,mismatch,draft_len", GREEDY_CASES, ids=[c[0] for c in GREEDY_CASES])
def test_speculative_with_one_hot_distributions_equals_greedy(name, k, V, mismatch, draft_len):
    # Temperature -> 0 limit: with one-hot p and q, sampling verification must reduce to greedy.
    draft, logits, dl, _ = _greedy_case(k, V, mismatch, draft_len)
    p = torch.nn.functional.one_hot(logits.argmax(-1), V).double()
    q = torch.nn.functional.one_hot(draft, V).double()
    res = speculative_accept(draft, q, p, dl, generator=torch.Generator().manual_seed(1))
    ref = greedy_accept(draft, logits, dl)
    assert torch.equal(res.num_accepted, ref.num_accepted)
    assert torch.equal(res.next_tokens, ref.next_tokens)


@pytest.mark.parametrize(
    "fn,args,match",
    [
        (greedy_accept, (torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, 5)), r"\[b, k\+1, V\]"),
        (greedy_accept, (torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 4, 5), torch.tensor([1, 4])), "draft_len"),
        (speculative_accept, (torch.zeros(1, 2, dtype=torch.long), torch.rand(1, 3, 5), torch.rand(1, 3, 5)), "draft_probs"),
    ],
)
def test_shape_validation(fn, args, match):
    with pytest.raises(ValueError, match=match):
        fn(*args)


# --------------------------------------------------------------------------------------------
# Residual distribution and acceptance probability.

RESIDUAL_CASES = [("vector", (6,)), ("batch", (4, 6)), ("batch_block", (3, 2, 9))]


@pytest.mark.parametrize("name,shape", RESIDUAL_CASES, ids=[c[0] for c in RESIDUAL_CASES])
def test_residual_distribution(name, shape):
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(shape, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(torch.randn(shape, generator=g, dtype=torch.float64), -1)
    r = residual_distribution(p, q)
    assert r.shape == p.shape
    assert (r >= 0).all()
    torch.testing.assert_close(r.sum(-1), torch.ones(shape[:-1], dtype=torch.float64))
    assert (r[p <= q] == 0).all()  # no mass where the draft already over-covers the target
    diff = (p - q).clamp_min(0)
    torch.testing.assert_close(r * diff.sum(-1, keepdim=True), diff)  # proportional to max(p-q,0)
    # Edge case: p == q leaves no residual mass -> fall back to p itself.
    torch.testing.assert_close(residual_distribution(p, p.clone()), p)


def test_acceptance_probability():
    g = torch.Generator().manual_seed(4)
    p = torch.rand(200, generator=g, dtype=torch.float64)
    q = torch.rand(200, generator=g, dtype=torch.float64)
    a = acceptance_probability(p, q)
    assert ((a >= 0) & (a <= 1)).all()
    torch.testing.assert_close(a, torch.minimum(torch.ones_like(p), p / q))
    # q == 0: keep iff the target gives the token any mass, never NaN.
    a0 = acceptance_probability(torch.tensor([0.3, 0.0]), torch.tensor([0.0, 0.0]))
    assert a0.tolist() == [1.0, 0.0]


# --------------------------------------------------------------------------------------------
# Speculative sampling is lossless. Target and drafter are position-dependent Markov chains over
# a tiny vocabulary (the target at each draft position is conditioned on the drafted prefix, as
# in real verification). N seeded trials run as one batch; the first emitted token and the first
# two tokens jointly must follow the target chain exactly (chi-square test). If a round emits
# only one token, a second round from that token supplies the next one.

V, N_TRIALS = 5, 20_000


def _chi2_critical(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty upper quantile of chi-square(df); z = 3.719 is the 1e-4 normal quantile."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi2(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def _chains(k: int, seed: int = 11):
    g = torch.Generator().manual_seed(seed)
    # T[t][prev] = target distribution of output position t given the previous token; Q likewise
    # for the drafter, deliberately different so that rejections and residuals matter.
    T = torch.softmax(1.2 * torch.randn(k + 2, V, V, generator=g, dtype=torch.float64), -1)
    Q = torch.softmax(1.5 * torch.randn(k + 2, V, V, generator=g, dtype=torch.float64), -1)
    return T, Q


def _round(T, Q, prev, t0, k, draft_len, gen):
    """One draft+verify round from context token `prev` [N] at output position t0."""
    n = prev.shape[0]
    drafts, q_rows, p_rows = [], [], []
    ctx = prev
    for i in range(k):  # k <= 3 steps of a vectorised Markov draft
        q_i = Q[t0 + i][ctx]
        x_i = torch.multinomial(q_i, 1, generator=gen).squeeze(1)
        drafts.append(x_i)
        q_rows.append(q_i)
        p_rows.append(T[t0 + i][ctx])
        ctx = x_i
    p_rows.append(T[t0 + k][ctx])
    draft = torch.stack(drafts, 1) if k else torch.zeros(n, 0, dtype=torch.long)
    q = torch.stack(q_rows, 1) if k else torch.zeros(n, 0, V, dtype=torch.float64)
    res = speculative_accept(draft, q, torch.stack(p_rows, 1), draft_len, generator=gen)
    # first and second emitted tokens of the round (second is -1 if the round emitted only one)
    na, nxt = res.num_accepted, res.next_tokens
    padded = torch.cat([draft, torch.full((n, 2), -1)], 1)
    first = torch.where(na >= 1, padded[:, 0], nxt)
    second = torch.where(na >= 2, padded[:, 1], torch.where(na == 1, nxt, torch.full_like(nxt, -1)))
    return first, second


def _first_two_tokens(k: int, ragged: bool, seed: int = 0):
    T, Q = _chains(k)
    gen = torch.Generator().manual_seed(seed)
    draft_len = torch.randint(0, k + 1, (N_TRIALS,), generator=gen) if ragged else None
    prompt = torch.zeros(N_TRIALS, dtype=torch.long)
    y1, y2 = _round(T, Q, prompt, 0, k, draft_len, gen)
    y2_next_round, _ = _round(T, Q, y1, 1, k, draft_len, gen)
    y2 = torch.where(y2 >= 0, y2, y2_next_round)
    marginal = T[0][0]
    joint = (marginal[:, None] * T[1]).reshape(-1)
    return _chi2(y1, marginal), _chi2(y1 * V + y2, joint)


def _accept_q_over_p(p_x, q_x):  # wrong: inverted ratio
    return torch.minimum(torch.ones_like(p_x), q_x / p_x)


def _residual_is_p(p, q):  # wrong: resample from the target instead of max(p - q, 0)
    return p


SAMPLING_CASES = [
    # name, k, ragged draft_len, patch (module attribute -> replacement), lossless expected
    ("correct_k2", 2, False, None, True),
    ("correct_k3", 3, False, None, True),
    ("correct_k3_ragged", 3, True, None, True),
    ("bug_accept_q_over_p", 3, False, ("acceptance_probability", _accept_q_over_p), False),
    ("bug_residual_from_p", 3, False, ("residual_distribution", _residual_is_p), False),
]


@pytest.mark.parametrize("name,k,ragged,patch,lossless", SAMPLING_CASES, ids=[c[0] for c in SAMPLING_CASES])
def test_speculative_sampling_matches_target(name, k, ragged, patch, lossless, monkeypatch):
    if patch is not None:  # negative controls swap one piece of the real code path
        monkeypatch.setattr(acceptance, *patch)
    chi_first, chi_joint = _first_two_tokens(k, ragged)
    passes = chi_first < _chi2_critical(V - 1) and chi_joint < _chi2_critical(V * V - 1)
    assert passes == lossless, (name, chi_first, chi_joint)


def test_speculative_accept_reproducible_and_respects_draft_len():
    g = torch.Generator().manual_seed(5)
    b, k = 512, 4
    q = torch.softmax(torch.randn(b, k, V, generator=g), -1)
    p = torch.softmax(torch.randn(b, k + 1, V, generator=g), -1)
    draft = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(b, k)
    dl = torch.randint(0, k + 1, (b,), generator=g)
    run = lambda seed: speculative_accept(draft, q, p, dl, generator=torch.Generator().manual_seed(seed))
    a, a_again, other = run(7), run(7), run(8)
    assert torch.equal(a.num_accepted, a_again.num_accepted) and torch.equal(a.next_tokens, a_again.next_tokens)
    assert not (torch.equal(a.num_accepted, other.num_accepted) and torch.equal(a.next_tokens, other.next_tokens))
    assert ((a.num_accepted >= 0) & (a.num_accepted <= dl)).all()
    # p == q: every real draft token is accepted (ratio 1), never a padding one.
    same = speculative_accept(draft, p[:, :k], p, dl, generator=torch.Generator().manual_seed(0))
    assert torch.equal(same.num_accepted, dl)


def test_speculative_accept_bf16_inputs():
    g = torch.Generator().manual_seed(6)
    q = torch.softmax(torch.randn(64, 3, V, generator=g), -1)
    p = torch.softmax(torch.randn(64, 4, V, generator=g), -1)
    draft = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(64, 3)
    res = speculative_accept(draft, q.bfloat16(), p.bfloat16(), generator=g)
    assert ((res.next_tokens >= 0) & (res.next_tokens < V)).all()
    assert ((res.num_accepted >= 0) & (res.num_accepted <= 3)).all()


# --------------------------------------------------------------------------------------------
# Speedup model (SPEC section 3).

SPEEDUP_CASES = [(0.0, 3), (0.3, 1), (0.5, 2), (0.8, 7), (0.95, 15), (1.0, 15), (0.7, 0)]


def _tau_by_enumeration(acc: float, k: int) -> float:
    # E[tau] = sum_n (n + 1) P(n accepted), P(n) = acc^n (1 - acc) for n < k, acc^k for n = k.
    probs = [acc**n * (1 - acc) for n in range(k)] + [acc**k]
    return sum((n + 1) * pn for n, pn in enumerate(probs))


@pytest.mark.parametrize("acc,k", SPEEDUP_CASES)
def test_expected_accepted_tokens(acc, k):
    tau = expected_accepted_tokens(acc, k)
    assert tau == pytest.approx(_tau_by_enumeration(acc, k), rel=1e-12)
    assert 1.0 <= tau <= k + 1
    assert expected_accepted_tokens(min(1.0, acc + 0.01), k) >= tau  # better drafts never hurt
    assert expected_accepted_tokens(acc, k + 1) >= tau  # nor does verifying more (cost aside)


@pytest.mark.parametrize("acc,k", SPEEDUP_CASES)
def test_expected_speedup(acc, k):
    rho = 0.1
    tau = expected_accepted_tokens(acc, k)
    assert expected_speedup(acc, k, rho) == pytest.approx(tau / (rho * k + 1))
    assert expected_speedup(acc, k, rho, draft_forwards=1) == pytest.approx(tau / (rho + 1))
    assert expected_speedup(acc, k, 0.0) == pytest.approx(tau)


def test_expected_tokens_continuous_at_one_and_validated():
    assert expected_accepted_tokens(1.0 - 1e-12, 15) == pytest.approx(16.0, rel=1e-9)
    with pytest.raises(ValueError, match="acc"):
        expected_accepted_tokens(1.5, 3)
    with pytest.raises(ValueError, match="k must be"):
        expected_accepted_tokens(0.5, -1)
    with pytest.raises(ValueError, match="rho"):
        expected_speedup(0.5, 3, -0.1)
