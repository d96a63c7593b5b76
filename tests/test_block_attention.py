"""The training blocks' sparse flex-attention rule equals the dense mask (CPU, uncompiled flex)."""

import pytest
import torch

from adaflash_hf import AdaFlashDrafter
from adaflash_hf.training.block_attention import FlexBlockAttention
from adaflash_hf.training.blocks import build_block_inputs
from adaflash_hf.training.model import DrafterTrainingModel
from test_training import MASK, fixed_batch, tiny_pair

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _loss(model, batch, anchors, valid):
    with torch.no_grad():  # flex attention has no CPU backward; examples/reference_pair/flex_training_gpu.py checks the grads
        return model(**batch, anchors=anchors, anchor_valid=valid)


# anchors per row (row 1 is right padded from position 19): valid blocks, an invalid one, a block at the
# first response token and one whose slots run past the end
CASES = [
    ([[8, 12, 20], [8, 15, 0]], [[True, True, True], [True, True, False]]),
    ([[22, 9], [10, 18]], [[True, True], [True, True]]),
]


@pytest.mark.parametrize("anchors,valid", CASES)
def test_flex_block_attention_equals_dense_mask(anchors, valid):
    anchors, valid = torch.tensor(anchors), torch.tensor(valid)
    batch = fixed_batch()
    target, drafter = tiny_pair(block_size=4)
    dense = DrafterTrainingModel(target, drafter, block_attention="dense")
    ref = _loss(dense, batch, anchors, valid)
    flex = DrafterTrainingModel(target, drafter, block_attention="flex")
    got = _loss(flex, batch, anchors, valid)
    for k in ("loss", "ce_loss", "length_loss", "accept_len"):
        torch.testing.assert_close(got[k], ref[k], atol=1e-5, rtol=1e-5)


# context length, anchors per row, valid, block size, tile (small tiles: many of them in a small case)
SPARSITY_CASES = [
    (24, [[8, 12, 20], [8, 15, 0]], [[True, True, True], [True, True, False]], 4, 8),
    (40, [[3, 30, 9, 39, 1], [20, 20, 5, 0, 33]], [[True] * 5, [True, True, True, False, True]], 4, 8),
    (37, [[5, 36, 2], [30, 10, 12]], [[True] * 3, [True] * 3], 6, 16),  # blocks straddle query tiles
]


@pytest.mark.parametrize("context_len,anchors,valid,block_size,tile", SPARSITY_CASES)
def test_block_sparsity_lists_every_tile_with_a_visible_key(context_len, anchors, valid, block_size, tile):
    """Every (query tile, key tile) pair holding a key some query of the tile may see (the dense mask) is listed,
    in ascending order and once; and the listing is sparse where the rule is (it skips tiles). Uncompiled flex
    on the CPU ignores the listing (it applies the mask everywhere), so the forward test cannot see this."""
    from adaflash_hf.training.block_attention import block_sparsity
    from adaflash_hf.training.blocks import block_attention_mask

    anchors, valid = torch.tensor(anchors), torch.tensor(valid)
    dense = block_attention_mask(context_len, anchors, valid, block_size)[:, 0]  # [b, q, kv]
    b, q_len, kv_len = dense.shape
    nq, nkv = -(-q_len // tile), -(-kv_len // tile)
    padded = torch.zeros(b, nq * tile, nkv * tile, dtype=torch.bool)
    padded[:, :q_len, :kv_len] = dense
    visible = padded.view(b, nq, tile, nkv, tile).any(dim=4).any(dim=2)  # [b, nq, nkv]
    num, idx = block_sparsity(context_len, anchors, valid, block_size, tile)
    listed = torch.zeros(b, nq, nkv, dtype=torch.bool)
    for bi in range(b):
        for qi in range(nq):
            tiles = idx[bi, 0, qi, : num[bi, 0, qi]].tolist()
            assert tiles == sorted(set(tiles))
            listed[bi, qi, tiles] = True
    assert (listed | ~visible).all()  # nothing visible is left out
    assert listed.sum() < b * nq * nkv  # and tiles are skipped
    for bi in range(b):  # control: without each query tile's last listed tile (its own blocks' keys), the check fails
        for qi in range(nq):
            listed[bi, qi, idx[bi, 0, qi, num[bi, 0, qi] - 1]] = False
    assert not (listed | ~visible).all()


def test_flex_rule_change_is_seen():
    """Control: the comparison above notices a rule that lets each block see its anchor's own target state."""
    target, drafter = tiny_pair(block_size=4)
    drafter.eval()
    batch = fixed_batch()
    anchors, valid = torch.tensor(CASES[0][0]), torch.tensor(CASES[0][1])
    model = DrafterTrainingModel(target, drafter)
    ctx_pos = torch.arange(batch["input_ids"].shape[1]).expand(2, -1)
    feats = model.target_features(batch["input_ids"], batch["attention_mask"], ctx_pos)

    def hidden(attn_anchors):
        blk, _, pos = build_block_inputs(batch["input_ids"], anchors, valid, 4, MASK)
        with torch.no_grad():
            attn = FlexBlockAttention.build(24, attn_anchors, valid, 4, batch["attention_mask"], compiled=False)
            return drafter(noise_embeds=drafter.embed(blk), context_hidden_states=feats,
                           position_ids=torch.cat([ctx_pos, pos], 1), attention_fn=attn).last_hidden_state

    assert not torch.allclose(hidden(anchors), hidden(anchors + 1), atol=1e-3)


def test_flex_refuses_sliding_layers_unknown_names_and_cpu_training():
    target, _ = tiny_pair()
    sliding = AdaFlashDrafter.from_target(target, num_layers=2, block_size=4, mask_token_id=MASK,
                                          layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    with pytest.raises(ValueError, match="sliding_attention"):
        DrafterTrainingModel(target, sliding, block_attention="flex")
    with pytest.raises(ValueError, match="block_attention"):
        DrafterTrainingModel(target, tiny_pair()[1], block_attention="sparse")
    flex = DrafterTrainingModel(*tiny_pair(block_size=4), block_attention="flex")
    with pytest.raises(ValueError, match="CUDA only"):
        flex(**fixed_batch())


def test_recipe_refuses_flex_off_cuda_before_loading_anything(tmp_path):
    from adaflash_hf.training import train_drafter

    with pytest.raises(SystemExit, match="--block-attention flex trains on CUDA only"):
        train_drafter.main(["--target", str(tmp_path / "missing"), "--out", str(tmp_path / "d"), "--device", "cpu",
                            "--block-attention", "flex"])


@pytest.mark.parametrize("strategy,sampler,mixed", [("group_by_length", "LengthGroupedSampler", range(0, 7)),
                                                     ("random", "RandomSampler", range(9, 33))])
def test_recipe_batches_samples_of_similar_length(tmp_path, strategy, sampler, mixed):
    """The recipe's sampler (transformers' own): group_by_length puts short and long samples in separate batches
    (a few batches mix, where a mega-batch of 16 splits); control: random batches mix about half the time."""
    from adaflash_hf.training.drafter_recipe import DrafterRecipe
    from adaflash_hf.training.train_drafter import _trainer
    from adaflash_hf.training.trainer import DrafterDataCollator
    from test_training import _samples

    samples = [s for i in range(32) for s in _samples(1, T=12 + i % 4, prompt=4) + _samples(1, T=40 + i % 4, prompt=4)]
    r = DrafterRecipe(target=None, out=str(tmp_path), batch_size=2, steps=1, train_sampling_strategy=strategy)
    model = DrafterTrainingModel(*tiny_pair(block_size=4))
    trainer = _trainer(r, model, samples, DrafterDataCollator(pad_token_id=0), tmp_path, torch.device("cpu"))
    torch.manual_seed(0)
    sampler_ = trainer._get_train_sampler()
    order = list(sampler_)
    assert type(sampler_).__name__ == sampler and sorted(order) == list(range(len(samples)))
    short = [len(samples[i]["input_ids"]) < 20 for i in order]
    assert sum(a != b for a, b in zip(short[::2], short[1::2])) in mixed
