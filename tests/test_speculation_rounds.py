"""One tau for every method (issue 36): the same 10-token continuation produced by plain decoding,
prompt lookup, the AR assistant and the drafter, each counted through the bench's own path for that
method, against tau worked out by hand under `adaflash_hf.speculation.rounds`' convention:
tau = (new tokens - 1 per sequence) / (target forwards - 1 per sequence)."""

from types import SimpleNamespace

import pytest
import torch

from adaflash_hf.bench.measure import _fill_rounds, _Timings, fill_computed
from adaflash_hf.bench.methods import MethodOutput, run_hf_assisted
from adaflash_hf.bench.prompt_lookup_tau import PromptLookupSettings, as_generation_stats, prompt_lookup_rounds
from adaflash_hf.bench.results import BenchCell
from adaflash_hf.generation.stats import GenerationStats

PROMPT = [1, 2, 3, 4, 9, 1]
CONT = [2, 3, 4, 5, 6, 7, 1, 2, 3, 8]  # the target's greedy continuation: N = 10 new tokens, S = 1 sequence


class _Target(torch.nn.Module):
    """A target seen from outside, as the bench sees transformers' generate: `forwards` target forwards
    that emit CONT (plain decoding: one token each; assisted generation: a verified block each)."""

    def __init__(self, forwards: int):
        super().__init__()
        self.forwards = forwards

    def forward(self, x):
        return x

    def generate(self, input_ids, attention_mask=None, streamer=None, **kwargs):
        for _ in range(self.forwards):
            self(input_ids)
        return torch.cat([input_ids, torch.tensor([CONT])], dim=1)


def _counted_from_forwards(forwards: int) -> BenchCell:
    """hf_assisted's path: run_hf_assisted counts target forwards, measure estimates tau from totals."""
    ctx = SimpleNamespace(target=_Target(forwards), assistant=None, generate_kwargs={})
    t = _Timings()
    t.add(run_hf_assisted(ctx, torch.tensor([PROMPT]), None, None), [CONT], wall=1.0, ttft=None)
    cell = BenchCell(method="hf_assisted", dataset="d", concurrency=1, new_tokens=len(CONT))
    _fill_rounds(cell, t)
    return cell


def _prompt_lookup() -> BenchCell:
    """prompt_lookup_exact's path: rounds computed from the greedy output, as GenerationStats, into a cell.
    With 3 candidates and 2-grams at most (worked by hand from the n-gram rule):
      prefill forward: suffix (1,) first at 0 -> [2 3 4], all accepted + bonus 5   (4 tokens)
      forwards 2-4: suffixes 5, 6, 7 have no earlier match -> no candidates        (1 token each)
      forward 5: suffix (1,) -> [2 3 4], 2 3 accepted, 4 != 8, bonus 8             (3 tokens)
    accepted [3, 0, 0, 0, 2], 5 forwards, 4 rounds: tau = (10 - 1) / 4 = 2.25."""
    settings = PromptLookupSettings(num_tokens=3, max_ngram=2)
    rounds = prompt_lookup_rounds(PROMPT, CONT, max_new_tokens=len(CONT), settings=settings)
    assert rounds.accepted == [3, 0, 0, 0, 2] and rounds.verify_lengths == [4, 1, 1, 1, 4]
    cell = BenchCell(method="prompt_lookup_exact", dataset="d", concurrency=1)
    fill_computed(cell, [CONT], as_generation_stats([rounds], settings))
    return cell


def _drafter() -> BenchCell:
    """The drafter's path: generate's GenerationStats (the prefill's token 2 not recorded), then rounds
    accepting 3, 2, 1 drafts (+1 each: 3 4 5 6 | 7 1 2 | 3 8): tau = (10 - 1) / 3 = 3.0."""
    stats = GenerationStats(block_size=8, policy="fixed", new_tokens=len(CONT))
    for accepted in (3, 2, 1):
        stats.record(0, 8, accepted)
    t = _Timings()
    t.add(MethodOutput(None, stats=stats), [CONT], wall=1.0, ttft=None)
    cell = BenchCell(method="fixed", dataset="d", concurrency=1, new_tokens=len(CONT))
    _fill_rounds(cell, t)
    return cell


# (method, its cell, target forwards in all, tau by hand)
CASES = [
    # plain decoding: 10 forwards, one token each: (10 - 1) / 9 = 1.0
    ("plain", lambda: _counted_from_forwards(10), 10, 1.0),
    # prompt lookup: see _prompt_lookup: (10 - 1) / (5 - 1) = 2.25
    ("prompt_lookup", _prompt_lookup, 5, 2.25),
    # AR assistant: the prefill forward commits 3 (2 candidates + bonus), then 4, 2, 1: (10 - 1) / (4 - 1) = 3.0
    ("hf_assisted", lambda: _counted_from_forwards(4), 4, 3.0),
    # drafter: the prefill's token, then 4, 3, 2: (10 - 1) / (4 - 1) = 3.0
    ("drafter", _drafter, 4, 3.0),
]


@pytest.mark.parametrize("name,make,forwards,tau", CASES, ids=[c[0] for c in CASES])
def test_every_method_counts_tau_alike(name, make, forwards, tau):
    cell = make()
    assert cell.rounds == forwards - 1  # the prefill forward is never a round
    assert cell.tau == pytest.approx(tau)
    assert cell.tau == pytest.approx((len(CONT) - 1) / (forwards - 1))  # the convention, stated once


def test_the_old_prompt_lookup_count_would_fail():
    """Negative control: prompt lookup counted the old way (every forward a round, every token counted,
    N / R = 10 / 5 = 2.0) disagrees with the hand-checked 2.25, so the table above catches it."""
    rounds = prompt_lookup_rounds(PROMPT, CONT, len(CONT), settings=PromptLookupSettings(num_tokens=3, max_ngram=2))
    old = len(CONT) / len(rounds.accepted)
    assert old == 2.0 and old != pytest.approx(_prompt_lookup().tau)
