"""Seeded sampling is reproducible under load (issue 19): a request with ``seed`` gives the same tokens alone
or batched with others, whatever the verify mode and however the token budget cuts its rounds; each token
is still an exact sample of the target's distribution."""

from __future__ import annotations

import asyncio

import openai
import pytest
import torch
from conftest import build_word_tokenizer

from adaflash_hf.engine import Engine, SamplingParams
from adaflash_hf.engine.sampling import position_keyed_samples
from adaflash_hf.serve.server import make_server
from adaflash_hf.speculation.length.names import layout_args

from generation_helpers import engine_prompts, make_drafter, make_target

SEEDED = SamplingParams(temperature=0.9, top_k=40, seed=1234)


@pytest.fixture(scope="module")
def pair():
    target = make_target("qwen3", seed=4)
    return target, make_drafter(target, block_size=6, seed=4)


def test_position_keyed_samples_are_exact_and_keyed():
    p = torch.tensor([0.05, 0.1, 0.15, 0.2, 0.5])
    rows = position_keyed_samples(p.expand(6000, 5).clone(), seed=3, start=0)  # one row per output position
    assert torch.equal(rows.sum(dim=-1), torch.ones(6000))  # one-hot
    tv = 0.5 * (rows.mean(dim=0) - p).abs().sum().item()
    assert tv < 0.03, tv
    sharp = p**2 / (p**2).sum()  # negative control: samples of another distribution fail the same bound
    wrong = position_keyed_samples(sharp.expand(6000, 5).clone(), seed=3, start=0)
    assert 0.5 * (wrong.mean(dim=0) - p).abs().sum().item() > 0.03
    again = position_keyed_samples(p.expand(10, 5).clone(), seed=3, start=100)
    assert torch.equal(again, rows[100:110])  # a row depends on (seed, position) only, not on the call's cut
    other = position_keyed_samples(p.expand(10, 5).clone(), seed=4, start=100)
    assert not torch.equal(other, again)
    bad = torch.tensor([[float("nan")] * 5, [0.2] * 5])
    out = position_keyed_samples(bad, seed=3, start=0)
    assert torch.isnan(out[0]).all() and out[1].sum() == 1  # left for checked_probs to flag


@pytest.mark.parametrize("mode,budget,others", [
    ("packed", 20, 7), ("packed", 64, 5), ("rectangular", 24, 7),
])  # fmt: skip
def test_seeded_request_gives_the_same_tokens_alone_and_under_load(pair, mode, budget, others):
    target, drafter = pair
    prompt, *rest = engine_prompts([5, 3, 7, 4, 6, 2, 5, 3], seed=30)

    def run(n_others: int) -> list[int]:
        engine = Engine(target, **layout_args(drafter, mode), max_slots=8, max_len=64, token_budget=budget)
        load = [engine.submit(p, 12, SamplingParams(temperature=1.0, seed=i)) for i, p in enumerate(rest[:n_others])]
        mine = engine.submit(prompt, 12, SEEDED)
        load += [engine.submit(p, 12, SamplingParams(temperature=0.7)) for p in rest[n_others:][:2]]
        engine.run_until_idle()
        assert all(h.result().finish_reason == "length" for h in load)
        return mine.result().token_ids

    alone = run(0)
    assert len(alone) == 12 and run(others) == alone


def test_seeded_request_over_http_alone_and_among_concurrent_requests(pair):
    target, drafter = pair
    engine = Engine(target, drafter, length_policy="adaptive", max_slots=8, max_len=64, token_budget=40)
    server = make_server(engine, build_word_tokenizer(128), port=0, model_name="tiny").start()
    try:
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)

        async def ask(prompt: str, seed: int | None) -> str:
            out = await aclient.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0.9,
                                                   seed=seed)
            return out.choices[0].text

        async def scenario():
            alone = await ask("w3 w9 w27", 77)
            crowd = await asyncio.gather(ask("w3 w9 w27", 77), *(ask(f"w{i} w{i + 1}", None) for i in range(4, 10)))
            await aclient.close()
            return alone, crowd[0]

        alone, loaded = asyncio.run(scenario())
        assert alone and loaded == alone
    finally:
        server.close()
