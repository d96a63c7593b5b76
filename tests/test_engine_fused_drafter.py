"""The drafter's layers on the target's fused kernels (DraftGraphs(fused=...)): the same drafts as through its
modules, the engine's outputs equal to plain greedy, and every reason not to fuse named."""

from __future__ import annotations

import pytest
import torch

from adaflash_hf.engine import Engine, layout_args
from adaflash_hf.engine.drafter import make_drafter_cache
from adaflash_hf.engine.kernels.fused import FusedTarget
from adaflash_hf.engine.drafter import DraftGraphs
from adaflash_hf.engine.kernels.attention import BLOCK

from generation_helpers import engine_prompts, make_drafter, make_target, plain_greedy_ids

# (target family, drafter layers, attention bias): the layer loop's first / middle / last layer, biases fused too
PAIRS = [("qwen3", 2, False), ("llama", 3, False), ("qwen3", 2, True)]


def _pair(family, layers, bias):
    target = make_target(family)
    return target, make_drafter(target, block_size=8, num_layers=layers, attention_bias=bias, use_length_head=True)


@pytest.mark.parametrize("family,layers,bias", PAIRS)
def test_fused_drafter_drafts_what_its_modules_draft(family, layers, bias):
    """Two rounds over ragged contexts and slots out of order: block logits, tokens, ratios, stored context K/V
    and slot lengths of the fused runner equal the modules' runner's exactly (float32, CPU: same ops, same order)."""
    target, drafter = _pair(family, layers, bias)
    fused = FusedTarget(target, compile=False)
    caches = [make_drafter_cache(drafter, 8, 64, spare_slots=1, len_multiple=BLOCK) for _ in range(2)]
    slots = [3, 0, 2]
    for c in caches:
        for s in sorted(slots):
            c.alloc(s)
    runners = [DraftGraphs(drafter, caches[0], max_rows=4, max_ctx=64),
               DraftGraphs(drafter, caches[1], max_rows=4, max_ctx=64, fused=fused)]
    assert runners[0].fused is None and runners[1].fused is fused and runners[1].fusion_note == ""
    g = torch.Generator().manual_seed(7)
    KH = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    for lens in ([9, 1, 4], [2, 5, 1]):
        ctx = [torch.randn(n, KH, generator=g) for n in lens]
        bonus = torch.randint(0, 120, (len(slots),), generator=g).tolist()
        ref, out = (r.run(slots, ctx, bonus) for r in runners)
        assert torch.equal(out.logits, ref.logits) and torch.equal(out.tokens, ref.tokens)
        assert torch.equal(out.ratio, ref.ratio) and bool(out.finite.all())
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
    assert [caches[1].length(s) for s in slots] == [11, 6, 5]


@pytest.mark.parametrize("mode", ["fixed", "packed"])
def test_engine_with_fused_drafter_equals_plain_greedy(mode):
    target, drafter = _pair("qwen3", 2, False)
    prompts = engine_prompts([5, 9, 3], seed=4)
    refs = [plain_greedy_ids(target, p, 14) for p in prompts]
    unfused = Engine(target, **layout_args(drafter, mode), max_slots=4, max_len=64, cuda_graphs=True, fused_kernels=False)
    eng = Engine(target, **layout_args(drafter, mode), max_slots=4, max_len=64, cuda_graphs=True)
    assert eng.draft_graphs.fused is eng.fused is not None
    outs, base = eng.generate(prompts, max_new_tokens=14), unfused.generate(prompts, max_new_tokens=14)
    assert [o.token_ids for o in outs] == refs == [o.token_ids for o in base]
    assert [o.accepted for o in outs] == [o.accepted for o in base]  # the same drafts, round for round


def test_drafter_fusion_refused_with_the_reason():
    target, drafter = _pair("qwen3", 2, False)
    handle = drafter.layers[1].mlp.register_forward_hook(lambda m, i, o: o)
    with pytest.warns(RuntimeWarning, match="drafter's layers run through its modules: layer 1: .*hooks"):
        eng = Engine(target, **layout_args(drafter, "fixed"), max_slots=2, max_len=64, cuda_graphs=True)
    assert eng.fused is not None and eng.draft_graphs.fused is None
    prompt = engine_prompts([6], seed=2)[0]
    assert eng.generate([prompt], max_new_tokens=8)[0].token_ids == plain_greedy_ids(target, prompt, 8)
    handle.remove()
    other = make_drafter(target, block_size=8, num_layers=1, head_dim=4)  # the target's head_dim is 8
    assert "head_dim" in DraftGraphs(other, make_drafter_cache(other, 2, 32, spare_slots=1), 2, 32,
                                     fused=FusedTarget(target, compile=False)).fusion_note
    changed = make_drafter(target, block_size=8, num_layers=1)
    changed.norm.__class__ = type("ScaledNorm", (type(changed.norm),), {"forward": lambda self, x: 2 * x})
    assert "not the stock RMSNorm" in DraftGraphs(changed, make_drafter_cache(changed, 2, 32, spare_slots=1), 2, 32,
                                                  fused=FusedTarget(target, compile=False)).fusion_note


@pytest.mark.parametrize("layer,module", [(0, "self_attn.q_proj"), (1, "mlp.gate_proj")])
def test_replaced_drafter_weights_are_refused_not_silently_used(layer, module):
    target, drafter = _pair("qwen3", 2, False)
    eng = Engine(target, **layout_args(drafter, "fixed"), max_slots=2, max_len=64, cuda_graphs=True)
    linear = drafter.layers[layer].get_submodule(module)
    linear.weight = torch.nn.Parameter(linear.weight.detach().clone())
    with pytest.raises(RuntimeError, match="drafter's weights were replaced"):
        eng.submit(engine_prompts([4], seed=1)[0], max_new_tokens=4)


def test_weights_copied_in_place_reach_the_fused_drafter():
    """The online adapter swaps versions with ``copy_`` into the serving drafter's tensors: the fused weights
    (whose views the parameters are) must carry the new version into the next draft."""
    target, drafter = _pair("qwen3", 2, False)
    other = make_drafter(target, block_size=8, num_layers=2, seed=5, use_length_head=True)
    caches = [make_drafter_cache(d, 2, 32, spare_slots=1, len_multiple=BLOCK) for d in (drafter, other)]
    runners = [DraftGraphs(drafter, caches[0], 2, 32, fused=FusedTarget(target, compile=False)),
               DraftGraphs(other, caches[1], 2, 32)]
    ctx = [torch.randn(3, len(drafter.config.target_layer_ids) * drafter.config.hidden_size, generator=torch.Generator().manual_seed(1))]
    for c in caches:
        c.alloc(0)
    before = runners[0].run([0], ctx, [7]).logits.clone()
    with torch.no_grad():
        new = other.state_dict()
        for name, t in drafter.state_dict().items():
            t.copy_(new[name])
    caches[0].rollback(0, 0)
    after, ref = (r.run([0], ctx, [7]).logits for r in runners)
    assert torch.equal(after, ref) and not torch.equal(before, ref)
