"""CPU tests of the engine's fast start (:mod:`adaflash_hf.engine.warmup`) and of ``generate`` routed
through the engine (:mod:`adaflash_hf.generation.fast_path`).

On CPU the engine runs the same static, padded bucket forwards as its CUDA graphs, eagerly: every bucket
a round uses is recorded (``GraphRunner.replays``), which is what a warmup must have captured.
"""

from __future__ import annotations

import pytest
import torch

from adaflash_hf.engine import Engine
from adaflash_hf.engine.warmup import workload_buckets

from generation_helpers import engine_prompts, make_drafter, make_target, plain_greedy_ids


def _engine(mode, block_size=4, **kw):
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=block_size) if mode != "off" else None
    return target, Engine(target, drafter, verify_mode=mode, max_slots=2, max_len=64, cuda_graphs=True, **kw)


@pytest.mark.parametrize("mode", ["packed", "rectangular", "fixed", "off"])
def test_warmup_covers_every_bucket_the_workload_uses(mode):
    target, eng = _engine(mode)
    prompts = engine_prompts([7, 7], seed=5)
    planned = workload_buckets(eng, concurrency=2, prompt_lens=[7])
    assert eng.warmup(concurrency=2, prompt_lens=[7]) >= 0.0
    assert eng.num_steps == 0 and eng.forward_tokens == []  # the warm-up's own requests are not counted
    for runner in (eng.graphs, eng.draft_graphs):
        if runner is not None:
            runner.replays.clear()
    out = eng.generate(prompts, max_new_tokens=20)
    assert [o.token_ids for o in out] == [plain_greedy_ids(target, p, 20) for p in prompts]
    used = set(eng.graphs.replays)
    assert used and used <= planned["target"], used - planned["target"]
    if eng.draft_graphs is not None:
        drafted = set(eng.draft_graphs.replays)
        assert drafted and drafted <= planned["drafter"], drafted - planned["drafter"]


def test_warmup_refuses_a_busy_engine_and_bad_workloads():
    _, eng = _engine("fixed")
    with pytest.raises(ValueError, match="concurrency"):
        eng.warmup(concurrency=3)
    with pytest.raises(ValueError, match="prompt lengths"):
        eng.warmup(prompt_lens=[64])
    eng.submit([1, 2, 3], 4)
    with pytest.raises(RuntimeError, match="idle"):
        eng.warmup()
