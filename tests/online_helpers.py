"""Shared pieces of the online-adaptation tests (`test_online*.py`, `test_faults_online.py`): a tiny seeded target
(the `pair` fixture, imported by each module) and its real rounds (`tiny_rounds`), real rounds and finished requests
from `generate`, weight snapshots, and whether a drafter still serves plain greedy output."""

from __future__ import annotations

import pytest
import torch
from generation_helpers import PAD_ID, Collect, make_drafter, make_target, ragged_prompts

from adaflash_hf.speculation.rounds import FinishedRequest

SENTINEL = "hf_SENTINELtokenDoNotLeak0123456789"
BLOCK = 8


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    target = make_target(layers=3, seed=1)
    target.requires_grad_(False)
    return target


def fresh_drafter(target, seed=0):
    return make_drafter(target, block_size=BLOCK, num_layers=1, seed=seed)


def prompts(seed=0, n=2, lengths=(5, 9)):
    ids, mask, rows = ragged_prompts(n, list(lengths), seed)
    return ids, mask, rows


def real_rounds(target, drafter, n_tokens=24, seed=0):
    sink = Collect()
    ids, mask, _ = prompts(seed)
    target.generate(ids, attention_mask=mask, assistant_model=drafter, round_sink=sink, do_sample=False,
                    max_new_tokens=n_tokens, pad_token_id=PAD_ID)  # fmt: skip
    return sink.rounds


@pytest.fixture(scope="module")
def tiny_rounds(pair):
    """The tiny target and the rounds of one `generate` with a fresh drafter (two ragged prompts, 24 new tokens)."""
    rounds = real_rounds(pair, fresh_drafter(pair))
    assert len(rounds) >= 6
    return pair, rounds


def serves_exactly(drafter, target) -> bool:
    """``drafter`` (whatever its weights now) still gives exactly ``target``'s plain greedy output."""
    ids, mask, _ = prompts(seed=3, lengths=(4, 7))
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=PAD_ID)
    return torch.equal(target.generate(ids, assistant_model=drafter, **kw), target.generate(ids, **kw))


def round_adapter(target, **kw):
    """An online adapter over a fresh drafter that learns from rounds, two to an update (``kw``: more settings)."""
    from adaflash_hf.online import OnlineAdapter

    return OnlineAdapter(fresh_drafter(target), target, sample_unit="round", samples_per_update=2, epochs=1, lr=1e-3,
                         **kw)


def version_names(root) -> list[str]:
    """The names of the versions published under ``root``, oldest first."""
    from adaflash_hf.online import list_versions

    return [p.name for _, p in list_versions(root)]


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(a, b, prefix=""):
    return all(torch.equal(a[k], b[k]) for k in a if k.startswith(prefix))


def greedy(target, ids, mask, **kw):
    return target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24, pad_token_id=PAD_ID, **kw)


class CollectRequests(Collect):
    def __init__(self):
        super().__init__()
        self.requests: list[FinishedRequest] = []

    def on_request(self, finished):
        self.requests.append(finished)


def real_requests(target, drafter, seeds=(0, 1), n_tokens=24):
    sink = CollectRequests()
    for seed in seeds:
        ids, mask, _ = prompts(seed)
        target.generate(ids, attention_mask=mask, assistant_model=drafter, round_sink=sink, do_sample=False,
                        max_new_tokens=n_tokens, pad_token_id=PAD_ID)  # fmt: skip
    return sink.requests
