"""Training-mode and inference-mode drafting agree: same sequence, same anchor -> same draft logits.

Training (`DrafterTrainingModel`): a block at anchor `a` sees the target features of positions
`< a`, slot 0 holds token `a`, slots 1.. hold the mask token, all blocks of a sequence in one
forward under the block attention mask. Inference (`AdaFlashCandidateGenerator.propose`, driven
by `adaflash_decoding`): the drafter's KV cache accumulates the features of the verified tokens
round by round (the prompt after the prefill, then bonus + accepted drafts), the block is drafted
after the bonus token at position `a`, then the block's K/V is cropped.

If the two ever disagree (an off-by-one in which features are appended after a verify round, a
position shift, a block K/V left in the cache), the offline acceptance proxy stops measuring what
decoding does. The negative controls check that the comparison is sensitive to exactly those
mistakes: a context shifted by one position must give different logits.
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_drafter, build_tiny_target, target_context
from transformers import GenerationConfig

from adaflash_hf.generation import AdaFlashCandidateGenerator
from adaflash_hf.training.trainer import DrafterTrainingModel

BLOCK = 6
SEQ_LEN = 26
ATOL = 1e-4


@pytest.fixture(scope="module")
def pair():
    target = build_tiny_target("qwen3", seed=1)
    drafter = build_drafter(target, num_layers=2, block_size=BLOCK, seed=2)
    return target, drafter


@pytest.fixture(scope="module")
def seq(pair):
    vocab = pair[1].config.vocab_size
    return torch.randint(0, vocab - 1, (1, SEQ_LEN), generator=torch.Generator().manual_seed(5))


def training_draft_logits(target, drafter, seq: torch.Tensor, anchors: list[int]) -> torch.Tensor:
    """`[n, B-1, V]` draft logits of slots 1..B-1 at each anchor, from `DrafterTrainingModel.forward`
    (captured at the drafter's output, the tensor the training loss and the proxy read)."""
    model = DrafterTrainingModel(target, drafter, length_head_weight=0.0).eval()
    captured = {}
    hook = drafter.register_forward_hook(lambda m, i, o: captured.__setitem__("h", o.last_hidden_state))
    try:
        with torch.no_grad():
            model(input_ids=seq, anchors=torch.tensor([anchors]))
    finally:
        hook.remove()
    h = captured["h"].view(len(anchors), BLOCK, -1)
    return drafter.compute_logits(h[:, 1:]).float()


def inference_draft_logits(target, drafter, seq: torch.Tensor, chunks: list[int], shift: int = 0) -> torch.Tensor:
    """`[B-1, V]` draft logits of `propose` after feeding the context features in `chunks` rounds
    (first the prompt, then bonus + accepted drafts of each verify), as `adaflash_decoding` does.
    The block sits at anchor `sum(chunks)`; `shift` moves the features fed against their positions
    (negative control)."""
    gen = AdaFlashCandidateGenerator.for_target(target, drafter, GenerationConfig(max_length=64), length_policy="fixed")
    feats = target_context(drafter, target, seq)  # teacher-forced target features, [1, T, K*H]
    if shift:  # position p gets the features of position p + shift (clamped at the ends)
        feats = feats[:, (torch.arange(feats.shape[1]) + shift).clamp(0, feats.shape[1] - 1)]
    start, block = 0, None
    for n in chunks:
        ctx, ctx_pos = feats[:, start : start + n], torch.arange(start, start + n)[None]
        anchor = start + n
        block = gen.propose(
            seq[:, anchor],
            torch.tensor([anchor]),
            ctx,
            torch.ones_like(ctx_pos, dtype=torch.bool),
            ctx_pos,
            torch.tensor([BLOCK - 1]),
        )
        start = anchor
    return block.logits[0]


# (context chunks per round): prefill of the prompt, then 1 + accepted tokens per verify round.
SCHEDULES = [
    pytest.param([4], id="prefill-only"),
    pytest.param([4, 1, 1, 1], id="nothing-accepted"),
    pytest.param([3, 4, 2, 6], id="mixed-acceptance"),
    pytest.param([1, BLOCK, BLOCK], id="full-blocks-accepted"),
    pytest.param([7, 5, 1, 3, 2], id="long"),
]


@pytest.mark.parametrize("chunks", SCHEDULES)
def test_propose_equals_training_forward(pair, seq, chunks):
    target, drafter = pair
    anchor = sum(chunks)
    want = training_draft_logits(target, drafter, seq, [anchor])[0]
    got = inference_draft_logits(target, drafter, seq, chunks)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("chunks", SCHEDULES)
@pytest.mark.parametrize("shift", [1, -1])
def test_shifted_context_changes_the_draft(pair, seq, chunks, shift):
    """Negative control: features one position late (the anchor's own state leaks in) or early
    must change the logits, so the equality above can fail."""
    target, drafter = pair
    want = training_draft_logits(target, drafter, seq, [sum(chunks)])[0]
    got = inference_draft_logits(target, drafter, seq, chunks, shift=shift)
    assert (got - want).abs().max() > 100 * ATOL


def test_training_anchor_sees_only_earlier_positions(pair, seq):
    """Negative control on the training side: the same block at a neighbouring anchor differs."""
    target, drafter = pair
    a = 10
    want = inference_draft_logits(target, drafter, seq, [a])
    near = training_draft_logits(target, drafter, seq, [a - 1, a, a + 1])
    torch.testing.assert_close(near[1], want, atol=ATOL, rtol=1e-4)
    assert (near[0] - want).abs().max() > 100 * ATOL and (near[2] - want).abs().max() > 100 * ATOL


def test_generate_rounds_match_training_forward(pair):
    """End to end: every round of `generate(assistant_model=drafter)` drafts, after a context of
    exactly `anchor` tokens, the logits the training forward gives at that anchor."""
    target, drafter = pair
    prompt = torch.randint(0, drafter.config.vocab_size - 1, (1, 7), generator=torch.Generator().manual_seed(9))

    class Sink:
        def __init__(self):
            self.rounds = []

        def on_round(self, r):
            self.rounds.append(r)

    sink = Sink()
    with torch.no_grad():
        out, stats = target.generate(prompt, assistant_model=drafter, length_policy="fixed", do_sample=False,
                                     max_new_tokens=18, return_stats=True, round_sink=sink, pad_token_id=0)
        plain = target.generate(prompt, do_sample=False, max_new_tokens=18, pad_token_id=0)
    assert torch.equal(out, plain)
    assert len(sink.rounds) == stats.rounds > 1
    anchors = [len(r.context_ids) for r in sink.rounds]  # no padding: context length == bonus position
    expected, pos = [], prompt.shape[1]
    for acc in stats.accepted:
        expected.append(pos)
        pos += acc + 1
    assert anchors == expected
    for r, a in zip(sink.rounds, anchors):
        assert int(out[0, a]) == r.bonus_token
    want = training_draft_logits(target, drafter, out, anchors)
    for i, r in enumerate(sink.rounds):
        k = r.verify_len - 1
        torch.testing.assert_close(r.draft_logits, want[i, :k], atol=ATOL, rtol=1e-4)
