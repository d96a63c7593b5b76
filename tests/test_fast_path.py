"""CPU tests of the engine's fast start (:mod:`adaflash_hf.engine.warmup`) and of ``generate`` routed
through the engine (:mod:`adaflash_hf.generation.fast_path`).

On CPU the engine runs the same static, padded bucket forwards as its CUDA graphs, eagerly: every bucket
a round uses is recorded (``GraphRunner.replays``), which is what a warmup must have captured.
"""

from __future__ import annotations

import pytest
import torch

from transformers.generation.logits_process import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                                                   TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from adaflash_hf.engine import Engine, layout_args
from adaflash_hf.engine.warmup import workload_buckets
from adaflash_hf.generation import decoding, fast_path
from adaflash_hf.generation.fast_path import _sampling

from generation_helpers import (PAD_ID, CollectingStreamer, char_tokenizer, engine_prompts, make_drafter, make_target,
                                plain_greedy_ids, ragged_prompts)


def _engine(mode, block_size=4, **kw):
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=block_size)
    return target, Engine(target, **layout_args(drafter, mode), max_slots=2, max_len=64, cuda_graphs=True, **kw)


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


# ------------------------------------------------------------------ generate on the engine
@pytest.fixture
def eager_loop_forbidden(monkeypatch):
    """Fails a test whose call runs a round of the eager loop (so the engine route is really taken)."""
    fast_path.clear_engines()

    def no(*a, **k):
        raise AssertionError("the eager loop ran")

    monkeypatch.setattr(decoding, "_verify", no)
    yield
    fast_path.clear_engines()


def _gen(target, drafter, ids, mask, fast, **kw):
    kw = {"do_sample": False, "max_new_tokens": 14, "pad_token_id": PAD_ID, **kw}
    return target.generate(ids, attention_mask=mask, assistant_model=drafter, fast_path=fast, **kw)


@pytest.mark.parametrize("family,batch,policy", [("qwen3", 1, "fixed"), ("llama", 3, "adaptive"), ("qwen3", 4, "fixed")])
def test_engine_route_equals_the_eager_loop_and_plain_greedy(family, batch, policy, eager_loop_forbidden, monkeypatch):
    target = make_target(family)
    drafter = make_drafter(target, block_size=4, use_length_head=policy == "adaptive")
    ids, mask, _ = ragged_prompts(batch, [6, 3, 8, 5], seed=batch)
    plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=14, pad_token_id=PAD_ID)
    fast, stats = _gen(target, drafter, ids, mask, True, length_policy=policy, return_stats=True)
    assert torch.equal(fast, plain)
    assert stats.rounds > 0 and stats.new_tokens == batch * 14 and stats.policy == policy
    monkeypatch.undo()
    assert torch.equal(_gen(target, drafter, ids, mask, False, length_policy=policy), plain)


def test_the_rows_of_one_call_decode_together(eager_loop_forbidden):
    """A batch is one workload: every row is admitted at once and they share rounds (a budget of one
    prompt's prefill admitted them one by one: 40 engine steps here instead of 14)."""
    target = make_target("qwen3", seed=5)
    drafter = make_drafter(target, block_size=4)
    ids, mask, _ = ragged_prompts(6, [60, 58, 60, 56, 60, 59], seed=5)
    out, stats = _gen(target, drafter, ids, mask, True, length_policy="fixed", return_stats=True)
    (cached,) = fast_path._ENGINES.values()
    assert cached.engine.num_steps <= 1.5 * stats.rounds / 6 + 2
    assert torch.equal(out, target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=14, pad_token_id=PAD_ID))


def test_engine_route_stops_and_returns_what_generate_does(eager_loop_forbidden):
    """EOS, a stop string, a streamer and return_dict_in_generate on the engine route == the eager loop."""
    target = make_target("qwen3", seed=3)
    drafter = make_drafter(target, block_size=4)
    ids, mask, rows = ragged_prompts(2, [5, 7], seed=3)
    ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20, pad_token_id=PAD_ID)
    tok, chars = char_tokenizer()
    stop = "".join(chars[t] for t in ref[0, ids.shape[1] + 5 : ids.shape[1] + 7].tolist())  # inside a block
    eos = int(ref[1, ids.shape[1] + 9])
    kw = dict(max_new_tokens=20, eos_token_id=eos, stop_strings=stop, tokenizer=tok, return_dict_in_generate=True)
    fast = _gen(target, drafter, ids, mask, True, **kw)
    plain = target.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=PAD_ID, **kw)
    assert torch.equal(fast.sequences, plain.sequences) and fast.sequences.shape[1] < ids.shape[1] + 20
    streamer = CollectingStreamer()
    one = _gen(target, drafter, ids[:1, -5:], None, True, max_new_tokens=9, streamer=streamer)
    assert [t for put in streamer.puts[1:] for t in put] == one[0, 5:].tolist() and streamer.ends == 1


def test_round_sink_gets_batch_rows_and_finished_requests(eager_loop_forbidden):
    target = make_target("llama", seed=4)
    drafter = make_drafter(target, block_size=4)
    ids, mask, rows = ragged_prompts(2, [4, 6], seed=4)
    rounds, finished = [], []

    class Sink:
        def on_round(self, r):
            rounds.append(r)

        def on_request(self, f):
            finished.append(f)

    out = _gen(target, drafter, ids, mask, True, max_new_tokens=8, round_sink=Sink())
    assert {r.row for r in rounds} == {0, 1}
    for r in rounds:  # context = the row's unpadded prompt + what it had generated before the round's bonus
        real = torch.cat([rows[r.row], out[r.row, ids.shape[1]:]])
        assert torch.equal(r.context_ids, real[: r.context_ids.shape[0]])
    assert [f.row for f in finished] == [0, 1] and all(torch.equal(f.prompt_ids, rows[f.row]) for f in finished)


def test_sampling_warpers_map_to_engine_params_and_others_fall_back_with_a_warning():
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.9)])
    assert _sampling(warpers) == ({"temperature": 0.7, "top_k": 20, "top_p": 0.9}, None)
    assert _sampling(LogitsProcessorList([TopKLogitsWarper(5), TemperatureLogitsWarper(0.5)]))[1] == "logits warpers in another order"
    assert "RepetitionPenaltyLogitsProcessor" in _sampling([RepetitionPenaltyLogitsProcessor(1.2)])[1]
    target = make_target("qwen3", seed=5)
    drafter = make_drafter(target, block_size=4)
    ids = torch.tensor([[5, 9, 2, 7]])
    for kw, reason in (({"repetition_penalty": 1.3}, "RepetitionPenaltyLogitsProcessor"),
                       ({"output_scores": True, "return_dict_in_generate": True}, "output_scores"),
                       ({"output_hidden_states": True, "return_dict_in_generate": True}, "output_hidden_states")):
        with pytest.warns(RuntimeWarning, match=f"eager loop.*{reason}"):
            fast = _gen(target, drafter, ids, None, True, **kw)
        eager = _gen(target, drafter, ids, None, False, **kw)
        assert torch.equal(getattr(fast, "sequences", fast), getattr(eager, "sequences", eager))


def test_sampling_on_the_engine_follows_the_global_seed():
    target = make_target("qwen3", seed=6)
    drafter = make_drafter(target, block_size=4)
    ids = torch.tensor([[5, 9, 2, 7]])
    outs = []
    for _ in range(2):
        torch.manual_seed(11)
        outs.append(_gen(target, drafter, ids, None, True, do_sample=True, temperature=0.8, top_k=30))
    assert torch.equal(outs[0], outs[1]) and outs[0].shape[1] == 4 + 14
    torch.manual_seed(11)  # no warper at all (temperature 1, top_k off) still samples
    plain_sampled = _gen(target, drafter, ids, None, True, do_sample=True, temperature=1.0, top_k=None, max_new_tokens=30)
    assert not torch.equal(plain_sampled, _gen(target, drafter, ids, None, True, max_new_tokens=30))


def test_fast_path_is_validated_and_off_cuda_auto_keeps_the_eager_loop(monkeypatch):
    target = make_target("qwen3", seed=7)
    drafter = make_drafter(target, block_size=4)
    with pytest.raises(ValueError, match="fast_path"):
        _gen(target, drafter, torch.tensor([[1, 2]]), None, "yes")
    monkeypatch.setattr(decoding, "engine_decoding", lambda *a, **k: pytest.fail("engine route on CPU with auto"))
    _gen(target, drafter, torch.tensor([[1, 2]]), None, "auto")


@pytest.mark.parametrize("fast_path_arg,do_sample,refusal,engine", [
    ("auto", True, None, True),  # sampled calls take the engine (it samples every row of a round at once)
    ("auto", False, None, True),
    ("auto", True, "a logits processor the engine cannot apply", False),  # a refusal keeps the eager loop, warned
    (False, True, None, False),  # asked not to
])  # fmt: skip
def test_auto_on_cuda_takes_the_engine_unless_it_refuses(fast_path_arg, do_sample, refusal, engine, monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(fast_path, "fast_path_refusal", lambda *a, **k: refusal)
    on_cuda = SimpleNamespace(parameters=lambda: iter([SimpleNamespace(device=torch.device("cuda"))]))
    config = SimpleNamespace(do_sample=do_sample)
    if refusal is None:
        assert fast_path.takes_engine(fast_path_arg, on_cuda, None, config, None, {}) is engine
    else:
        with pytest.warns(RuntimeWarning, match=refusal):
            assert fast_path.takes_engine(fast_path_arg, on_cuda, None, config, None, {}) is engine


def test_generate_warmup_prepares_the_engine_the_next_call_uses(eager_loop_forbidden):
    target = make_target("qwen3", seed=8)
    drafter = make_drafter(target, block_size=4)
    assert fast_path.warmup(target, drafter, batch_size=2, prompt_len=6, max_new_tokens=10, length_policy="fixed") >= 0
    (cached,) = fast_path._ENGINES.values()
    ids, mask, _ = ragged_prompts(2, [6, 4], seed=8)
    out = _gen(target, drafter, ids, mask, True, max_new_tokens=10, length_policy="fixed")
    assert list(fast_path._ENGINES.values()) == [cached]  # the same engine, not a new one
    assert torch.equal(out, target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=10, pad_token_id=PAD_ID))


def test_an_engine_built_under_inference_mode_serves_outside_it(eager_loop_forbidden):
    """The cached engine outlives the call: built and first used under torch.inference_mode (as the CLI
    does), it must still serve a call outside it, and leave the target's weights updatable in place."""
    target = make_target("qwen3", seed=9)
    drafter = make_drafter(target, block_size=4)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        inside = _gen(target, drafter, ids, None, True, max_new_tokens=8)
    outside = _gen(target, drafter, ids, None, True, max_new_tokens=12)
    assert torch.equal(outside[:, :12], inside) and len(fast_path._ENGINES) == 1
    assert not target.model.layers[0].self_attn.q_proj.weight.is_inference()
    target.load_state_dict(target.state_dict())  # in place: fails on inference tensors


def test_a_lora_target_falls_back_with_the_reason():
    peft = pytest.importorskip("peft")
    base = make_target("qwen3", seed=10)
    drafter = make_drafter(base, block_size=4)
    lora = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    ids = torch.tensor([[5, 9, 2, 7]])
    with pytest.warns(RuntimeWarning, match="eager loop.*not a plain nn.Linear"):
        fast = lora.generate(input_ids=ids, assistant_model=drafter, fast_path=True, do_sample=False, max_new_tokens=8)
    assert torch.equal(fast, lora.generate(input_ids=ids, do_sample=False, max_new_tokens=8))


def test_a_failing_call_leaves_nothing_queued_in_the_cached_engine(eager_loop_forbidden):
    target = make_target("qwen3", seed=12)
    drafter = make_drafter(target, block_size=4)
    ids = torch.tensor([[5, 9, 2, 7], [3, 3, 1, 2]])

    class Exploding(CollectingStreamer):
        def put(self, value):
            super().put(value)
            if len(self.puts) == 3:
                raise KeyboardInterrupt  # not a callback error the engine absorbs: the call is interrupted

    with pytest.raises(KeyboardInterrupt):
        _gen(target, drafter, ids[:1], None, True, streamer=Exploding())
    (cached,) = fast_path._ENGINES.values()
    assert cached.engine.idle
    assert torch.equal(_gen(target, drafter, ids, None, True),
                       target.generate(ids, do_sample=False, max_new_tokens=14, pad_token_id=PAD_ID))


def test_a_bigger_engine_for_the_same_pair_keeps_what_the_traffic_accepted(eager_loop_forbidden):
    """A call that outgrows the cached engine gets a new one, which starts from the old one's record of what the
    traffic's rounds accepted (the cost rule's prior); a new pair starts from nothing (the control)."""
    target = make_target("qwen3", seed=9)
    drafter = make_drafter(target, block_size=4)
    ids, mask, _ = ragged_prompts(1, [6], seed=9)
    _gen(target, drafter, ids, mask, True, length_policy="cost")
    (first,) = fast_path._ENGINES.values()
    seen = first.engine.planner.traffic_seen
    assert seen[1] > 0  # the premise: rounds that verified drafts
    ids, mask, _ = ragged_prompts(1, [300], seed=9)  # past the first engine's max_len
    out = _gen(target, drafter, ids, mask, True, length_policy="cost", max_new_tokens=4)
    plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4, pad_token_id=PAD_ID)
    assert torch.equal(out, plain)
    (second,) = fast_path._ENGINES.values()
    assert second.engine is not first.engine and second.engine.planner.traffic_seen[1] >= seen[1] * 0.999 ** 8
    other = make_drafter(target, block_size=4)
    fast_path.warmup(target, other, batch_size=1, prompt_len=6, max_new_tokens=4, length_policy="cost")
    assert fast_path._ENGINES[next(reversed(fast_path._ENGINES))].engine.planner.traffic_seen == (0.0, 0.0)
