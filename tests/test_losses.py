"""Losses: OPD (SPEC worked example, reference formula, gradients), forward KL, block CE, length
head, position weights; masking and bf16 robustness shared across all of them."""

from __future__ import annotations

import math

import pytest
import torch

from adaflash_hf.training.losses import (
    block_ce_loss,
    default_gamma,
    forward_kl_loss,
    length_head_loss,
    length_mask,
    opd_loss,
    position_weights,
)

# --------------------------------------------------------------------------------------------
# SPEC section 4 worked example (the only hard-coded numbers: they are the SPEC's).

Q_EX = torch.tensor([[[0.55, 0.30, 0.10, 0.05]]]).log()
P_EX = torch.tensor([[[0.80, 0.15, 0.04, 0.01]]]).log()

WORKED_EXAMPLE = [
    # name, kwargs, SPEC value (3 decimals)
    ("l_hard", dict(alpha=1.0), 0.598),
    ("l_rkl_unclipped", dict(alpha=0.0, clip=None), 0.174),
    ("l_opd_unclipped", dict(clip=None), 0.513),
    ("l_rkl_clip", dict(alpha=0.0, clip=0.01), -0.176),
    ("l_opd_clipped_default", dict(), 0.443),
]


@pytest.mark.parametrize("name,kwargs,value", WORKED_EXAMPLE, ids=[c[0] for c in WORKED_EXAMPLE])
def test_spec_worked_example(name, kwargs, value):
    assert opd_loss(Q_EX, P_EX, **kwargs).item() == pytest.approx(value, abs=5e-4)


# --------------------------------------------------------------------------------------------
# Straightforward reference formulas, one position at a time, in float64.


def _ref_opd(d, t, alpha, clip, T, w, clip_mode, mask):
    b, k, _ = d.shape
    w = torch.ones(b, k, dtype=d.dtype) if w is None else w.to(d.dtype).expand(b, k)
    mask = torch.ones(b, k, dtype=torch.bool) if mask is None else mask
    hard, rkl, weights = [], [], []
    for i in range(b):
        for j in range(k):
            if not mask[i, j]:
                continue
            q = torch.softmax(d[i, j] / T, -1)
            p = torch.softmax(t[i, j] / T, -1)
            terms = q * torch.log(q / p)
            if clip is not None and clip_mode == "entry":
                terms = torch.minimum(terms, torch.tensor(clip, dtype=d.dtype))
            hard.append(-torch.log_softmax(d[i, j], -1)[t[i, j].argmax()])
            rkl.append(terms.sum())
            weights.append(w[i, j])
    hard, rkl, weights = torch.stack(hard), torch.stack(rkl), torch.stack(weights)
    l_hard = (weights * hard).sum() / weights.sum()
    if clip is not None and clip_mode == "token":
        l_rkl = torch.minimum(weights / weights.sum() * rkl, torch.tensor(clip, dtype=d.dtype)).sum()
    else:
        l_rkl = (weights * rkl).sum() / weights.sum()
    return alpha * l_hard + (1 - alpha) * T**2 * l_rkl


B, K, VOC = 3, 5, 11
MASK = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
W = position_weights(K, gamma=2.0)

OPD_CASES = [
    # name, kwargs
    ("defaults", dict()),
    ("unclipped", dict(clip=None)),
    ("tight_clip_masked", dict(clip=0.002, mask=MASK)),
    ("temperature_weights", dict(temperature=2.0, position_weights=W, mask=MASK)),
    ("pure_rkl", dict(alpha=0.0, clip=0.05)),
    ("token_clip", dict(clip_mode="token", clip=0.02)),
    ("token_clip_weights_mask", dict(clip_mode="token", clip=0.05, position_weights=W, mask=MASK, temperature=0.7)),
]


def _logits(seed, dtype=torch.float64, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    d = (scale * torch.randn(B, K, VOC, generator=g, dtype=torch.float64)).to(dtype)
    t = (scale * torch.randn(B, K, VOC, generator=g, dtype=torch.float64)).to(dtype)
    return d, t


@pytest.mark.parametrize("name,kwargs", OPD_CASES, ids=[c[0] for c in OPD_CASES])
def test_opd_matches_reference_value_and_gradient(name, kwargs):
    d, t = _logits(0)
    full = dict(alpha=0.8, clip=0.01, temperature=1.0, position_weights=None, clip_mode="entry", mask=None)
    full |= kwargs
    d1 = d.clone().requires_grad_(True)
    loss = opd_loss(d1, t, **kwargs)
    loss.backward()
    d2 = d.clone().requires_grad_(True)
    ref = _ref_opd(d2, t, full["alpha"], full["clip"], full["temperature"], full["position_weights"],
                   full["clip_mode"], full["mask"])
    ref.backward()
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(d1.grad, d2.grad)


def test_opd_clip_changes_loss_and_modes_differ():
    # guards against a clip that silently does nothing (every other check would still pass)
    d, t = _logits(1)
    losses = {mode: opd_loss(d, t, alpha=0.0, clip=0.01, clip_mode=mode).item() for mode in ("entry", "token")}
    unclipped = opd_loss(d, t, alpha=0.0, clip=None).item()
    assert losses["entry"] < unclipped and losses["token"] < unclipped
    assert losses["entry"] != pytest.approx(losses["token"])


GRADCHECK_CASES = [
    ("opd_unclipped", lambda d, t: opd_loss(d, t, clip=None, mask=MASK[:, :2])),
    ("opd_entry_clip", lambda d, t: opd_loss(d, t, clip=0.01, position_weights=W[:2], temperature=1.3)),
    ("opd_token_clip", lambda d, t: opd_loss(d, t, clip=0.02, clip_mode="token", mask=MASK[:, :2])),
    ("forward_kl", lambda d, t: forward_kl_loss(d, t, temperature=2.0, mask=MASK[:, :2])),
    ("block_ce", lambda d, t: block_ce_loss(d, t.argmax(-1), weights=W[:2], mask=MASK[:, :2])),
]


@pytest.mark.parametrize("name,fn", GRADCHECK_CASES, ids=[c[0] for c in GRADCHECK_CASES])
def test_gradcheck_float64(name, fn):
    # fp64 inputs stay fp64 inside the losses, so finite differences can check the analytic
    # gradient. Random inputs sit away from the clip's kink with probability 1.
    d, t = _logits(2, scale=1.0)
    d = d[:, :2].clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: fn(x, t[:, :2]), (d,))


def test_opd_does_not_backprop_into_target():
    d, t = _logits(3)
    t = t.clone().requires_grad_(True)
    opd_loss(d.requires_grad_(True), t).backward()
    assert t.grad is None


# --------------------------------------------------------------------------------------------
# Forward KL, block CE, length head against their reference formulas.


def test_forward_kl_matches_reference():
    d, t = _logits(4)
    for T, mask in [(1.0, None), (2.0, MASK)]:
        got = forward_kl_loss(d, t, temperature=T, mask=mask)
        lq, lp = torch.log_softmax(d / T, -1), torch.log_softmax(t / T, -1)
        per_pos = (lp.exp() * (lp - lq)).sum(-1)
        m = torch.ones(B, K, dtype=torch.bool) if mask is None else mask
        torch.testing.assert_close(got.double(), T**2 * per_pos[m].mean(), rtol=1e-5, atol=1e-6)
    assert forward_kl_loss(d, d).abs().item() < 1e-6
    assert forward_kl_loss(d, t).item() > 0


def test_block_ce_matches_reference():
    d, _ = _logits(5)
    g = torch.Generator().manual_seed(5)
    labels = torch.randint(0, VOC, (B, K), generator=g)
    labels[0, 1] = -100
    got = block_ce_loss(d, labels, weights=W, mask=MASK)
    keep = MASK & (labels != -100)
    ce = torch.nn.functional.cross_entropy(d.reshape(-1, VOC), labels.reshape(-1).clamp_min(0), reduction="none")
    w = W.double().expand(B, K)[keep]
    torch.testing.assert_close(got.double(), (ce.reshape(B, K)[keep] * w).sum() / w.sum(), rtol=1e-5, atol=1e-6)


def test_length_head_loss():
    bs = 16
    acc = torch.tensor([0, 3, 15, 7])
    label = (acc.double() + 1) / bs
    assert length_head_loss(label.clone(), acc, bs).item() == pytest.approx(0.0, abs=1e-12)
    pred = torch.tensor([0.2, 0.9, 0.5, 0.5], dtype=torch.float64, requires_grad=True)
    loss = length_head_loss(pred[:, None], acc, bs)
    assert loss.item() == pytest.approx(((pred.detach() - label) ** 2).mean().item())
    loss.backward()
    torch.testing.assert_close(pred.grad, 2 * (pred.detach() - label) / 4)
    m = torch.tensor([True, False, True, False])
    masked = length_head_loss(pred, acc, bs, mask=m)
    assert masked.item() == pytest.approx(((pred.detach() - label)[m] ** 2).mean().item())


# --------------------------------------------------------------------------------------------
# Shared robustness checks over every position-level loss.

LOSSES = [
    ("opd_entry", lambda d, t, m: opd_loss(d, t, mask=m)),
    ("opd_token", lambda d, t, m: opd_loss(d, t, clip_mode="token", mask=m, position_weights=W)),
    ("opd_temperature", lambda d, t, m: opd_loss(d, t, temperature=2.0, clip=None, mask=m)),
    ("forward_kl", lambda d, t, m: forward_kl_loss(d, t, temperature=1.5, mask=m)),
    ("block_ce", lambda d, t, m: block_ce_loss(d, t.argmax(-1), weights=W, mask=m)),
]


@pytest.mark.parametrize("name,fn", LOSSES, ids=[c[0] for c in LOSSES])
def test_masked_positions_are_ignored(name, fn):
    d, t = _logits(6, dtype=torch.float32)
    d = d.requires_grad_(True)
    base = fn(d, t, MASK)
    base.backward()
    # garbage (huge values, NaN) at masked positions must not reach the value or the gradient
    d2, t2 = d.detach().clone(), t.clone()
    d2[~MASK] = torch.randn_like(d2[~MASK]) * 100
    d2[0, 3, 0] = float("nan")
    t2[~MASK] = torch.randn_like(t2[~MASK]) * 100
    d2.requires_grad_(True)
    other = fn(d2, t2, MASK)
    other.backward()
    assert other.item() == base.item()
    assert (d2.grad[~MASK] == 0).all() and torch.equal(d2.grad[MASK], d.grad[MASK])
    # and the mask is doing something: unmasking changes the value
    assert fn(d.detach(), t, None).item() != base.item()
    # an all-masked batch is a zero loss that can still be backpropagated
    empty = fn(d.detach().clone().requires_grad_(True), t, torch.zeros_like(MASK))
    assert empty.item() == 0.0
    empty.backward()


@pytest.mark.parametrize("name,fn", LOSSES, ids=[c[0] for c in LOSSES])
def test_bf16_logits_close_to_fp32(name, fn):
    d, t = _logits(7, dtype=torch.float32, scale=8.0)  # large logits stress the softmax
    # same values in both precisions: with fp32 softmaxes inside, the results agree to fp32 rounding
    d, t = d.bfloat16().float(), t.bfloat16().float()
    ref = fn(d, t, MASK)
    db = d.bfloat16().requires_grad_(True)
    got = fn(db, t.bfloat16(), MASK)
    got.backward()
    assert torch.isfinite(got) and torch.isfinite(db.grad.float()).all()
    assert got.float().item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("name,fn", LOSSES, ids=[c[0] for c in LOSSES])
def test_processed_logits_with_minus_inf_stay_finite(name, fn):
    # top-k / top-p processed logits carry -inf (target, and the draft where it was processed
    # the same way); losses and gradients must stay finite
    d, t = _logits(8, dtype=torch.float32)
    topk = t.topk(3, dim=-1).indices
    t = torch.full_like(t, float("-inf")).scatter(-1, topk, t.gather(-1, topk))
    d[:, ::2] = torch.where(torch.isinf(t[:, ::2]), float("-inf"), d[:, ::2])
    d = d.requires_grad_(True)
    loss = fn(d, t, MASK)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(d.grad).all()


# --------------------------------------------------------------------------------------------
# Position weights, gamma, masks, validation.


@pytest.mark.parametrize("block_len,gamma", [(15, 7.0), (9, 5.0), (7, 4.0), (1, 0.5)])
def test_position_weights(block_len, gamma):
    w = position_weights(block_len, gamma)
    assert w.shape == (block_len,) and w[0].item() == 1.0
    for i in range(1, block_len + 1):  # i = 1..block_len, SPEC's exp(-(i-1)/gamma)
        assert w[i - 1].item() == pytest.approx(math.exp(-(i - 1) / gamma), rel=1e-6)
    assert (w[1:] < w[:-1]).all()


def test_default_gamma():
    assert [default_gamma(b) for b in (16, 10, 8)] == [7, 5, 4]  # SPEC section 5
    gammas = [default_gamma(b) for b in range(1, 65)]
    assert all(later > earlier for earlier, later in zip(gammas, gammas[1:]))
    steps = [later - earlier for earlier, later in zip(gammas, gammas[1:])]
    assert max(steps) <= 0.5  # no jumps between neighbouring block sizes
    with pytest.raises(ValueError, match="block_size"):
        default_gamma(0)


def test_length_mask():
    lengths = torch.tensor([0, 2, 5])
    m = length_mask(lengths, 5)
    assert m.dtype == torch.bool and m.shape == (3, 5)
    assert m.sum(1).tolist() == lengths.tolist()
    assert all(m[i, : lengths[i]].all() for i in range(3))  # a prefix, not any positions


@pytest.mark.parametrize(
    "fn,kwargs,match",
    [
        (opd_loss, dict(clip_mode="row"), "clip_mode"),
        (opd_loss, dict(alpha=1.5), "alpha"),
        (opd_loss, dict(temperature=0.0), "temperature"),
        (forward_kl_loss, dict(temperature=-1.0), "temperature"),
    ],
)
def test_loss_validation(fn, kwargs, match):
    d, t = _logits(9)
    with pytest.raises(ValueError, match=match):
        fn(d, t, **kwargs)
    with pytest.raises(ValueError, match="shape"):
        fn(d, t[:, :2])


# Censored length labels: a round that accepted everything it verified only bounds acceptance from below.
CENSOR_CASES = [
    # (pred, accepted, verify_len, B, expect_zero)
    (0.9, 1, 2, 16, True),  # all verified accepted, cut short: predicting more is not an error
    (0.05, 1, 2, 16, False),  # predicting less than the lower bound is
    (0.9, 1, 4, 16, False),  # a rejection was seen: the label is exact, over-prediction is an error
    (0.9, 15, 16, 16, False),  # full block: exact (the label cannot be exceeded)
]


@pytest.mark.parametrize("pred,acc,vl,B,expect_zero", CENSOR_CASES)
def test_length_head_loss_censored_labels(pred, acc, vl, B, expect_zero):
    loss = length_head_loss(torch.tensor([pred]), torch.tensor([acc]), B, verify_len=torch.tensor([vl]))
    uncensored = length_head_loss(torch.tensor([pred]), torch.tensor([acc]), B)
    if expect_zero:
        assert loss.item() == 0.0 and uncensored.item() > 0.0
    else:
        assert loss.item() == pytest.approx(uncensored.item())
