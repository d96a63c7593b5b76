"""Helpers for the generation tests: tiny targets, drafters, an oracle drafter, a char tokenizer.

Kept apart from `conftest.py` so the generation tests do not depend on fixtures other files own.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import weakref

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.generation.streamers import BaseStreamer

from adaflash_hf import AdaFlashDrafter

VOCAB = 128
MASK_ID = VOCAB - 1  # drafter mask token
PAD_ID = VOCAB - 2  # generate's pad token (batched prompts, finished rows)


def make_target(family: str = "qwen3", seed: int = 0, vocab: int = VOCAB, hidden: int = 32, layers: int = 3,
                attn: str = "sdpa", **overrides):
    """A seeded, randomly initialised tiny Qwen3 / Llama causal LM in eval mode (no EOS, no BOS)."""
    fields = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        attn_implementation=attn,
    )
    fields.update(overrides)
    torch.manual_seed(seed)
    cls, cfg = (Qwen3ForCausalLM, Qwen3Config) if family == "qwen3" else (LlamaForCausalLM, LlamaConfig)
    model = cls(cfg(**fields)).eval()
    model.generation_config.pad_token_id = None
    model.generation_config.eos_token_id = None
    return model


def make_drafter(target, block_size: int = 8, num_layers: int = 1, seed: int = 0, cls=AdaFlashDrafter, **kw):
    """A seeded random drafter bound to `target` (mask token = last vocabulary id)."""
    vocab = target.get_input_embeddings().weight.shape[0]
    torch.manual_seed(seed)
    return cls.from_target(target, num_layers=num_layers, block_size=block_size, mask_token_id=vocab - 1, **kw).eval()


@contextlib.contextmanager
def kept_length_head(drafter):
    """The drafter's length head as it was, restored on leaving the block (tests force it to say something)."""
    saved = {k: v.detach().clone() for k, v in drafter.length_head.out.state_dict().items()}
    try:
        yield
    finally:
        drafter.length_head.out.load_state_dict(saved)


def force_length_head(drafter, ratio_high: bool) -> None:
    """Make the length head predict ~1 (`ratio_high`) or ~0 whatever the block."""
    with torch.no_grad():
        drafter.length_head.out.weight.zero_()
        drafter.length_head.out.bias.fill_(20.0 if ratio_high else -20.0)


def ragged_prompts(batch: int, lengths: list[int], seed: int, vocab: int = VOCAB):
    """Left-padded `input_ids` / `attention_mask` plus the unpadded rows (tokens avoid pad and mask ids)."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, vocab - 2, (lengths[i % len(lengths)],), generator=g) for i in range(batch)]
    width = max(r.shape[0] for r in rows)
    ids = torch.full((batch, width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((batch, width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - r.shape[0]:] = r
        mask[i, width - r.shape[0]:] = 1
    return ids, mask, rows


def unpad(sequences: torch.Tensor, attention_mask: torch.Tensor) -> list[torch.Tensor]:
    """Each row's real tokens: prompt without left padding, then everything generated."""
    p = attention_mask.shape[1]
    return [torch.cat([sequences[i, :p][attention_mask[i].bool()], sequences[i, p:]]) for i in range(sequences.shape[0])]


class FlatDrafter(AdaFlashDrafter):
    """A drafter with a fixed, deliberately wrong draft distribution `q` at every slot (not `p`): set `q_logits`."""

    q_logits: torch.Tensor

    def compute_logits(self, hidden_states):
        raw = super().compute_logits(hidden_states)
        return raw * 0.0 + self.q_logits.to(raw.dtype)


class OracleDrafter(AdaFlashDrafter):
    """A drafter that knows the answer: slot j of a block drafted after the bonus at position `t`
    puts (almost) all mass on token `t + j` of that row's reference sequence.

    Rows are followed through the batch as finished rows leave it (the batch keeps row order; a row
    is matched by its bonus token and position). Slots beyond `correct_slots` (1-based) are
    deliberately wrong, which pins the number of accepted drafts per round exactly.
    """

    def set_reference(self, references: list[torch.Tensor], correct_slots: int | None = None) -> "OracleDrafter":
        self._refs = [r.tolist() for r in references]
        self._correct = correct_slots
        self._active = list(range(len(self._refs)))
        return self

    def embed(self, input_ids):
        if input_ids.dim() == 2:
            self._oracle_bonus = input_ids[:, 0].tolist()
        return super().embed(input_ids)

    def forward(self, noise_embeds, context_hidden_states=None, position_ids=None, **kwargs):
        out = super().forward(noise_embeds, context_hidden_states=context_hidden_states, position_ids=position_ids, **kwargs)
        self._oracle_pos = position_ids[:, -noise_embeds.shape[1]:].tolist()
        return out

    def _matches(self, r: int, bonus: int, pos: int) -> bool:
        return len(self._refs[r]) > pos and self._refs[r][pos] == bonus

    def _assign_rows(self, b: int) -> list[int | None]:
        """Original row of each batch row: identity for a full batch, else an order-preserving match."""
        bonus, pos = self._oracle_bonus, [p[0] for p in self._oracle_pos]
        if b == len(self._refs):
            self._active = list(range(b))
        elif b < len(self._active):
            kept, j = [], 0
            for t, p in zip(bonus, pos):
                while j < len(self._active) and not self._matches(self._active[j], t, p):
                    j += 1
                if j == len(self._active):  # lost track (the output diverged): identify row by row
                    kept = [next((r for r in range(len(self._refs)) if self._matches(r, t, p)), None) for t, p in zip(bonus, pos)]
                    break
                kept.append(self._active[j])
                j += 1
            self._active = kept
        return self._active

    def compute_logits(self, hidden_states):
        raw = super().compute_logits(hidden_states)
        b, slots, vocab = raw.shape
        logits = torch.full((b, slots, vocab), -10.0, dtype=raw.dtype, device=raw.device)
        for i, r in enumerate(self._assign_rows(b)):
            ref, pos = (self._refs[r] if r is not None else []), self._oracle_pos[i]
            for j in range(1, slots + 1):
                tok = ref[pos[j]] if pos[j] < len(ref) else 0
                if self._correct is not None and j > self._correct:
                    tok = (tok + 1) % (vocab - 2)  # a token the target did not choose
                logits[i, j - 1, tok] = 10.0
        return logits


def make_oracle(target, references, block_size: int = 8, correct_slots: int | None = None, **kw) -> OracleDrafter:
    return make_drafter(target, block_size=block_size, cls=OracleDrafter, **kw).set_reference(references, correct_slots)


def char_tokenizer(vocab: int = VOCAB):
    """A `PreTrainedTokenizerFast` whose `vocab` tokens are single distinct characters (for stop strings)."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    chars = [chr(ord("a") + i) for i in range(26)] + [chr(ord("A") + i) for i in range(26)]
    chars += [chr(ord("0") + i) for i in range(10)] + [chr(0x3B1 + i) for i in range(25)]  # Greek
    chars += [chr(0x430 + i) for i in range(vocab - len(chars))]  # Cyrillic
    assert len(set(chars)) == vocab
    tok = Tokenizer(WordLevel(vocab={c: i for i, c in enumerate(chars)}, unk_token=chars[0]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()  # tokens back to text without separators
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=chars[0]), chars


class CollectingStreamer(BaseStreamer):
    """Records every `put` (as a flat list of ints per call) and counts `end` calls."""

    def __init__(self):
        self.puts: list[list[int]] = []
        self.ends = 0

    def put(self, value):
        self.puts.append(value.reshape(-1).tolist())

    def end(self):
        self.ends += 1


class Collect:
    """A round sink that keeps every verified round (``generate(..., round_sink=Collect())``)."""

    def __init__(self):
        self.rounds: list = []

    def on_round(self, verified):
        self.rounds.append(verified)


def engine_prompts(lengths: list[int], seed: int, vocab: int = 126) -> list[list[int]]:
    """Random prompts (token id lists) of the given lengths, for the engine tests."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def plain_greedy_ids(target, prompt: list[int], n: int, **kw) -> list[int]:
    """The `n` tokens plain greedy `generate` appends to `prompt` (the engine's reference); `kw`: more of
    `generate`'s arguments (`eos_token_id=None`: no stop)."""
    with torch.inference_mode():
        out = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, **kw)
    return out[0, len(prompt):].tolist()


def plain_greedy_once(target, prompt: list[int], n: int, **kw) -> list[int]:
    """:func:`plain_greedy_ids` computed once per prompt, length and arguments for a module-scoped ``target`` that no
    test changes (the reference pair): :func:`once_per_model`."""
    return once_per_model(target, (tuple(prompt), n, tuple(sorted(kw.items()))), lambda: plain_greedy_ids(target, prompt, n, **kw))


_ONCE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {key: value}


def once_per_model(model, key, compute):
    """``compute()`` the first time it is asked for this ``model`` object and ``key``, a copy of that value after
    (forgotten with the model): the plain greedy references of a module-scoped model that no test changes (the
    reference pair), computed once per prompt and length instead of once per test or parameter."""
    cache = _ONCE.setdefault(model, {})
    if key not in cache:
        cache[key] = compute()
    return copy.deepcopy(cache[key])


def prefilled_cache(target, prompts: list[list[int]], num_slots: int, max_len: int):
    """A target cache (one spare padding row) with each prompt prefilled into its own slot by the eager
    forward: ``(cache, slots)``."""
    from adaflash_hf.engine.target import PackedLayout, make_target_cache, target_forward

    cache = make_target_cache(target, num_slots, max_len, spare_slots=1)
    slots = [cache.alloc() for _ in prompts]
    lay = PackedLayout.from_cache(cache, slots, [len(p) for p in prompts])
    target_forward(target, cache, torch.tensor(sum(prompts, [])), lay.token_slots(), lay.positions(), lay)
    for s, p in zip(slots, prompts):
        cache.advance(s, len(p))
    return cache, slots


def delay_drafting_rounds(engine, seconds: float) -> None:
    """Make every round of ``engine`` that verifies drafts spend ``seconds`` more on the host (at its commit)."""
    import time

    real = engine._commit_round

    def slow(admitted, running, drafts, *rest):
        if running and max(drafts.q_lens) > 1:
            time.sleep(seconds)
        return real(admitted, running, drafts, *rest)

    engine._commit_round = slow


def wrap_round_forward(engine, wrapper) -> None:
    """Route ``engine``'s round target forward (:class:`adaflash_hf.engine.target.RoundForward`) through
    ``wrapper(forward, segs, layout, num_prefill, verify_inputs, **kw)``, which calls ``forward`` itself (or not)."""
    engine.forward = functools.partial(wrapper, engine.forward)
