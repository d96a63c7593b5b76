"""How our loop calls generate's logits processors (`adaflash_hf.generation.processors`): all rows at once only
when no processor reads the sequence, and then the same scores as the per-row, per-position calls."""

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList, MinPLogitsWarper, NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
)  # fmt: skip

from adaflash_hf.generation.processors import process_rows, shared_processors


class _SubclassedTopP(TopPLogitsWarper):  # a user's subclass may read input_ids: never batched
    pass


CASES = [
    ("none", [], True),
    ("temperature, top-k, top-p", [TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.9)], True),
    ("min-p", [MinPLogitsWarper(0.05)], True),
    ("repetition penalty", [RepetitionPenaltyLogitsProcessor(1.3)], False),
    ("no-repeat n-gram", [TopPLogitsWarper(0.9), NoRepeatNGramLogitsProcessor(2)], False),
    ("subclass", [_SubclassedTopP(0.9)], False),
]


@pytest.mark.parametrize("name,procs,batched", CASES, ids=[c[0] for c in CASES])
def test_rows_at_once_only_when_no_processor_reads_the_sequence(name, procs, batched):
    shared = shared_processors(procs)
    assert (shared is not None) is batched
    torch.manual_seed(0)
    seqs = [torch.randint(0, 50, (n,)) for n in (7, 9, 12)]  # rows of different lengths
    scores = torch.randn(3, 4, 50)  # the last 4 positions of each row
    rows = [LogitsProcessorList(procs) for _ in seqs]
    got = process_rows(rows, shared, seqs, scores)
    per_position = process_rows(rows, None, seqs, scores)
    assert torch.equal(got, per_position)
    if name == "repetition penalty":  # negative control: this one reads the prefix, so one call for all would differ
        flat = LogitsProcessorList(procs)(torch.zeros(12, 1, dtype=torch.long), scores.reshape(12, 50)).view(3, 4, 50)
        assert not torch.equal(flat, per_position)
