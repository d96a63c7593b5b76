"""The online loop closes a domain gap on CPU: a tiny drafter that never saw a domain gains held-out tau there within
a few updates of serving it, while the same updates on another domain's traffic (the negative control) gain nothing
there.

The fixture target is a bigram model built by hand (its attention and MLP outputs zeroed, its embeddings orthonormal,
its LM head's row of each token the sum of its predecessors' embeddings), so its greedy continuation is a fixed
successor map: on domain A every token leads to token 0
(the continuation settles on it), on domain B the tokens follow one cycle through the whole domain. A drafter learns
domain B's successors only from domain B's traffic; domain A's teaches it to predict token 0."""

from __future__ import annotations

import torch
from generation_helpers import PAD_ID, Collect, make_drafter, make_target

from adaflash_hf.online import OnlineAdapter

DOMAIN_A, DOMAIN_B = (0, 64), (64, 126)  # 126, 127: the pad and mask ids
# OPD on finished requests, as served; a rate chosen on this fixture (3e-2 barely moves it, 1e-3..3e-3 doubles tau).
# No guard or rollback: every update swaps in, so both arms take the same number (their own tests are elsewhere).
SETTINGS = dict(method="opd", sample_unit="request", samples_per_update=8, epochs=4, lr=1e-3, guard_samples=0,
                rollback_rounds=0, warmup_steps=0)


def bigram_target():
    target = make_target(layers=1, seed=1, hidden=128)  # as wide as the vocabulary: orthonormal embeddings
    target.requires_grad_(False)
    succ = torch.zeros(128, dtype=torch.long)  # domain A (and the special ids): on to token 0
    order = DOMAIN_B[0] + torch.randperm(DOMAIN_B[1] - DOMAIN_B[0], generator=torch.Generator().manual_seed(5))
    succ[order] = order.roll(-1)  # domain B: one cycle
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = torch.linalg.qr(torch.randn(128, 128, generator=torch.Generator().manual_seed(6)))[0]
        target.model.embed_tokens.weight.copy_(emb)
        head = torch.zeros_like(target.lm_head.weight)
        head.index_add_(0, succ, emb)  # at token t, succ[t]'s logit is positive and every other one 0
        target.lm_head.weight.copy_(head)
    return target, succ


def domain_prompts(domain, n, seed, length=6):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(*domain, (n, length), generator=g)


def serve(target, drafter, prompts, sink):
    target.generate(prompts, attention_mask=torch.ones_like(prompts), assistant_model=drafter, round_sink=sink,
                    do_sample=False, max_new_tokens=24, pad_token_id=PAD_ID)  # fmt: skip


def tau(target, drafter, prompts) -> float:
    rounds = Collect()
    serve(target, drafter, prompts, rounds)
    return 1 + sum(r.num_accepted for r in rounds.rounds) / len(rounds.rounds)


def online(target, drafter, traffic, updates: int) -> dict:
    adapter = OnlineAdapter(drafter, target, **SETTINGS)
    try:
        for u in range(updates):
            serve(target, drafter, traffic[u * 8 : (u + 1) * 8], adapter)
            assert adapter.wait_for_update(120)
        return adapter.stats
    finally:
        adapter.close()


def test_a_drafter_gains_on_a_domain_it_lacks_by_serving_it_and_not_by_serving_another():
    target, succ = bigram_target()
    test_b = domain_prompts(DOMAIN_B, 8, seed=4)  # held out: the traffic below is other prompts of the domain
    plain = target.generate(test_b, do_sample=False, max_new_tokens=8, pad_token_id=PAD_ID)
    assert torch.equal(plain[:, 6:], succ[plain[:, 5:-1]])  # the fixture: the successor map is the target's greedy
    drafter = make_drafter(target, block_size=8, num_layers=1, seed=0)
    online(target, drafter, domain_prompts(DOMAIN_A, 16, seed=1), updates=2)  # it knows domain A, not B
    start = {k: v.clone() for k, v in drafter.state_dict().items()}
    tau_start = tau(target, drafter, test_b)

    served_b = online(target, drafter, domain_prompts(DOMAIN_B, 32, seed=3), updates=4)
    tau_b = tau(target, drafter, test_b)
    drafter.load_state_dict(start)  # the control: the same start, settings and number of updates on domain A
    served_a = online(target, drafter, domain_prompts(DOMAIN_A, 32, seed=2), updates=4)
    tau_control = tau(target, drafter, test_b)

    assert served_b["updates"] == served_a["updates"] == 4  # every update swapped in, in both arms
    assert tau_b >= tau_start + 0.4, (tau_start, tau_b)  # measured: 1.00 -> 1.88
    assert tau_control <= tau_start + 0.05, (tau_start, tau_control)  # measured: 1.00 -> 1.00
