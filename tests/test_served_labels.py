"""The length head learns from real verification online (issue 18, item 1): a request sample carries its
served rounds (anchor, accepted, verify length), and the request objective trains the head on exactly
those counts, greedy or sampled; offline training keeps its teacher-forced labels."""

from __future__ import annotations

import pytest
import torch

from adaflash_hf.bench.replay import DraftReplay, PerPositionTrace
from adaflash_hf.engine import Engine, layout_args
from adaflash_hf.online import OnlineAdapter, OnlineConfig
from adaflash_hf.online.worker import ShadowTrainer, served_blocks
from adaflash_hf.training.losses import length_head_loss

from generation_helpers import engine_prompts, make_drafter, make_target, plain_greedy_ids

B = 8
MAX_NEW = 18


@pytest.fixture(scope="module")
def served_pair():
    target = make_target("qwen3", seed=5)
    target.requires_grad_(False)
    prompts = engine_prompts([6, 11, 8], seed=9)
    refs = {tuple(p): plain_greedy_ids(target, p, MAX_NEW) for p in prompts}
    return target, prompts, refs


def _expected_served(prompt_len: int, out) -> list[list[int]]:
    """(anchor, accepted, verify length) per round: the bonus token sits after the prompt, the prefill's
    token and every earlier round's accepted drafts + target token."""
    rows, pos = [], prompt_len
    for a, v in zip(out.accepted, out.verify_lengths):
        rows.append([pos, a, v])
        pos += a + 1
    return rows


@pytest.mark.parametrize("mode,sampled", [("fixed", False), ("packed", False), ("fixed", True)])
def test_request_samples_carry_the_served_rounds(served_pair, mode, sampled):
    target, prompts, refs = served_pair
    drafter = make_drafter(target, block_size=B)
    adapter = OnlineAdapter(drafter, target, samples_per_update=1000, epochs=1)
    try:
        # greedy: the replay makes rounds accept 0..B-1 drafts; sampled: the random drafter's real acceptance
        replay = None if sampled else DraftReplay(refs, PerPositionTrace([0.9, 0.8, 0.6, 0.5, 0.3, 0.2, 0.1]))
        eng = Engine(target, **layout_args(drafter, mode), max_slots=3, max_len=48, token_budget=64, round_sink=adapter,
                     draft_replay=replay)
        outs = eng.generate(prompts, max_new_tokens=MAX_NEW, **({"temperature": 1.0, "seed": 3} if sampled else {}))
        samples = adapter.buffer.take(len(adapter.buffer))
    finally:
        adapter.close()
    assert len(samples) == len(prompts)
    by_ids = {tuple(s.input_ids.tolist()): s for s in samples}
    for p, o in zip(prompts, outs):
        s = by_ids[tuple(p + o.token_ids)]
        assert s.served.tolist() == _expected_served(len(p), o)
    if not sampled:
        assert max(a for o in outs for a in o.accepted) >= 3  # labels span real, non-trivial acceptance


def test_head_is_trained_on_served_counts_not_on_its_own_simulation(served_pair):
    target, prompts, refs = served_pair
    drafter = make_drafter(target, block_size=B)
    worker = ShadowTrainer(drafter, target, OnlineConfig())
    adapter = OnlineAdapter(drafter, target, samples_per_update=1000, epochs=1)
    try:
        eng = Engine(target, drafter, length_policy="fixed", max_slots=3, max_len=48, token_budget=64, round_sink=adapter,
                     draft_replay=DraftReplay(refs, PerPositionTrace([0.95, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4])))
        eng.generate(prompts, max_new_tokens=MAX_NEW)
        samples = adapter.buffer.take(len(adapter.buffer))
    finally:
        adapter.close()
    preds = []
    hook = drafter.length_head.register_forward_hook(lambda m, a, out: preds.append(out.detach()))
    try:
        with torch.no_grad():
            served = worker.request_model(drafter)(**worker.request_batch(samples, "cpu"))
            plain = [s.served for s in samples]
            for s in samples:
                s.served = None
            simulated = worker.request_model(drafter)(**worker.request_batch(samples, "cpu"))
            for s, r in zip(samples, plain):
                s.served = r
    finally:
        hook.remove()
    blocks = served_blocks(samples, max_anchors=512)
    valid = blocks["anchor_valid"]
    expected = length_head_loss(preds[0].reshape(valid.shape)[valid], blocks["served_accepted"][valid], B,
                                verify_len=blocks["served_verify_len"][valid])
    torch.testing.assert_close(served["length_loss"], expected)
    # the random drafter's own drafts match ~nothing: its simulated labels are ~0, the served ones are not
    assert float(blocks["served_accepted"][valid].float().mean()) > 1.0
    assert float(served["length_loss"]) != pytest.approx(float(simulated["length_loss"]))


def test_served_blocks_keep_rounds_with_a_next_token_and_cap_them():
    from adaflash_hf.online.buffer import RequestSample
    from adaflash_hf.speculation.rounds import FinishedRequest

    fin = FinishedRequest(0, torch.arange(4), torch.arange(6))  # 10 tokens
    s = RequestSample.from_request(fin, served=[(4, 1, 3), (6, 2, 3), (9, 0, 1)])  # the last has no next token
    b = served_blocks([s], max_anchors=8)
    assert b["anchors"][b["anchor_valid"]].tolist() == [4, 6]
    assert b["served_accepted"][b["anchor_valid"]].tolist() == [1, 2]
    capped = served_blocks([s], max_anchors=1)
    assert capped["anchors"].shape == (1, 1) and capped["anchor_valid"].all()


def test_served_labels_need_anchors():
    target = make_target("qwen3", seed=5)
    drafter = make_drafter(target, block_size=B)
    worker = ShadowTrainer(drafter, target, OnlineConfig())
    ids = torch.arange(12)[None]
    with pytest.raises(ValueError, match="served_accepted needs anchors"):
        worker.request_model(drafter)(input_ids=ids, served_accepted=torch.zeros(1, 2, dtype=torch.long))


def test_head_error_on_served_rounds_falls_after_an_update(served_pair):
    target, prompts, refs = served_pair
    drafter = make_drafter(target, block_size=B)
    trace = PerPositionTrace([1.0] * 4 + [0.0] * 3)  # every round accepts 4 drafts: label 5 / B
    adapter = OnlineAdapter(drafter, target, samples_per_update=len(prompts), epochs=4, batch_size=1, head_lr=3e-3, lr=1e-5)
    try:
        for _ in range(2):  # served rounds before the update, then rounds the update never saw
            eng = Engine(target, drafter, length_policy="fixed", max_slots=3, max_len=48, token_budget=64, round_sink=adapter,
                         draft_replay=DraftReplay(refs, trace))
            assert [o.token_ids for o in eng.generate(prompts, max_new_tokens=MAX_NEW)] == [refs[tuple(p)] for p in prompts]
            assert adapter.wait_for_update(60)
        hist = adapter.stats["history"][0]
    finally:
        adapter.close()
    assert hist["head_mae_before"] is not None and hist["head_mae_after"] is not None
    assert hist["head_mae_after"] < 0.5 * hist["head_mae_before"], hist
