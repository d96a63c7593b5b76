"""Drafting one block per row: the drafter side of a speculative round, batched.

`AdaFlashCandidateGenerator` is transformers' `DFlashTokenCandidateGenerator` (same `DFlashCache`,
noise ids, hidden-state overrides and logits processors) with a verify-length planner on top (the engine's:
`adaflash_hf.speculation.length.planner.LengthPlanner`). It serves two loops: ours asks the planner for each round's
plan and calls `propose` for a whole padded batch when it drafts; transformers' batch-1 `_assisted_decoding` calls
`get_candidates` (through `speculation_type="adaflash"`), which drafts every round (that loop hands the drafter only
the last verify's features, so a round without the drafter would lose context) and asks the planner for the lengths.

The drafter keeps K/V of verified context only; each round it appends the fused features of the
newly verified tokens, drafts one block in one forward, asks the length policy how many slots to
verify, and discards the block's K/V.
"""

from dataclasses import dataclass

import torch
from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

from ..modeling import AdaFlashDrafter
from ..speculation.length import LengthPlanner, LengthPolicy, LengthSettings, RowState


@dataclass
class DraftBlock:
    """A drafted block for every active row.

    `tokens[i, :draft_len[i]]` are proposed; `logits` are the raw draft logits of slots 1..B-1;
    `ratio` is the length head's estimate (None without a head); `finite` is False for rows whose
    draft logits were NaN/inf (they verify no draft: a plain decoding step).
    """

    tokens: torch.Tensor
    logits: torch.Tensor
    draft_len: torch.Tensor
    ratio: torch.Tensor | None
    finite: torch.Tensor

    @classmethod
    def plain(cls, rows: int, device) -> "DraftBlock":
        """A round that drafts nothing (the planner's plain plan): no draft slot, every row verifies its bonus token."""
        return cls(torch.zeros(rows, 0, dtype=torch.long, device=device), torch.zeros(rows, 0, 0, device=device),
                   torch.zeros(rows, dtype=torch.long, device=device), None, torch.ones(rows, dtype=torch.bool, device=device))


class AdaFlashCandidateGenerator(DFlashTokenCandidateGenerator):
    """Proposes up to `block_size - 1` draft tokens per row from one drafter forward.

    Args:
        assistant_model, main_model_input_embeddings, main_model_output_embeddings,
            generation_config, logits_processor: as for `DFlashTokenCandidateGenerator`
            (`for_target` fills them in from a target).
        length: the verify-length settings (`LengthSettings`, or a policy name): `cost` (length head, the batch's
            lengths weighed against the default `RoundCost`; the default when the drafter has a trained head),
            `adaptive` (length head, the paper's floor rule), `fixed` (full block, classic DFlash) or `expected_gain`
            (per-position: the draft's own top-1 probability stands in for each slot's conditional acceptance, and the
            prefix with most expected tokens per verify cost wins, at `verify_token_cost` per token (a verify token's cost
            relative to the round's fixed cost).
        length_policy, length_rate, length_min: the same settings as generate's loose keywords (override `length`).

    Example:
        >>> gen = AdaFlashCandidateGenerator.for_target(target, drafter, GenerationConfig(max_length=64),
        ...                                             length_policy="fixed")  # doctest: +SKIP
        >>> gen.policy, gen.model_kwargs_overrides  # doctest: +SKIP
        ('fixed', {'output_hidden_states': [2]})
    """

    def __init__(
        self,
        assistant_model: AdaFlashDrafter,
        main_model_input_embeddings,
        main_model_output_embeddings,
        generation_config,
        logits_processor=None,
        length: LengthSettings | str | None = None,
        length_policy: str | None = None,
        length_rate: float | None = None,
        length_min: int | None = None,
        **kwargs,
    ):
        settings = LengthSettings.of(length, length_policy=length_policy, length_rate=length_rate,
                                     length_min=length_min).resolved(assistant_model)
        super().__init__(assistant_model, main_model_input_embeddings, main_model_output_embeddings, generation_config, logits_processor)
        self.planner = LengthPlanner(settings, assistant_model.config.block_size)
        self.policy = settings.policy.value
        self._rows = [RowState()]  # get_candidates' one row
        self.cache_valid: torch.Tensor | None = None
        if generation_config.return_dict_in_generate and generation_config.output_hidden_states:
            # The caller wants every layer back: capture them all; `select_context` picks ours from the full tuple.
            self.model_kwargs_overrides = {"output_hidden_states": True}

    @classmethod
    def for_target(cls, target, drafter: AdaFlashDrafter, generation_config, logits_processor=None, **options):
        """The generator for decoding `target` with `drafter` (options: the `__init__` keywords)."""
        return cls(drafter, target.get_input_embeddings(), target.get_output_embeddings(), generation_config, logits_processor, **options)

    def select_rows(self, keep: torch.Tensor) -> None:
        """Drop finished rows (`keep`: indices of the rows that stay)."""
        if self.cache.get_seq_length() > 0:
            self.cache.batch_select_indices(keep)
        if self.cache_valid is not None:
            self.cache_valid = self.cache_valid[keep]

    @torch.no_grad()
    def propose(self, bonus: torch.Tensor, bonus_pos: torch.Tensor, ctx: torch.Tensor, ctx_valid: torch.Tensor,
                ctx_pos: torch.Tensor, budget: torch.Tensor, rows=None, whole: bool = False) -> DraftBlock:
        """Draft a block after `bonus` (`[b]`, at positions `bonus_pos`) given new context features.

        `ctx` (`[b, m, K*H]`) are the target features of the tokens verified since the last drafting call,
        at positions `ctx_pos`; `ctx_valid` marks real columns (rows verified different counts).
        `budget` caps each row's draft length (e.g. tokens left before `max_length`). `rows`: the planner's rows
        (`RowState`, `remaining` set; default: one row per bonus token, `budget + 1` left); `whole`: the round's
        plan verifies whole blocks without reading the ratios first (they are kept for the next plan).
        """
        b, B = bonus.shape[0], self.block_size
        d = self.assistant_model
        block_pos = bonus_pos[:, None] + torch.arange(B, device=bonus.device)
        past_valid = self.cache_valid if self.cache_valid is not None else ctx_valid[:, :0]
        key_mask = torch.cat([past_valid, ctx_valid, torch.ones_like(ctx_valid[:, :1]).expand(b, B)], dim=1)
        # `d.draft_block` embeds with `d.embed`, not the parent's `_get_noise_embeds`: drafters are trained on it.
        hidden = d.draft_block(bonus, ctx, torch.cat([ctx_pos, block_pos], dim=1), key_mask.long(), self.cache)
        # Keep context K/V only; the block is drafted afresh next round.
        self.cache.crop(-B)
        self.cache_valid = torch.cat([past_valid, ctx_valid], dim=1)

        logits = d.compute_logits(hidden[:, 1:]).float()
        finite = torch.isfinite(logits).all(dim=-1).all(dim=-1)
        ratio = d.predict_accept_ratio(hidden) if d.length_head is not None else None
        if rows is None:
            rows = [RowState(remaining=int(left) + 1) for left in budget.tolist()]
        if whole:
            k_hat = self.planner.lengths(rows, None)
            self.planner.note_ratios(rows, ratio)
        else:
            gain = self.planner.policy is LengthPolicy.EXPECTED_GAIN
            k_hat = self.planner.lengths(rows, ratio, draft_logits=logits if gain else None)
        k_hat = k_hat.to(logits.device)
        draft_len = torch.minimum(k_hat - 1, budget.clamp(min=0))
        draft_len = torch.where(finite, draft_len, torch.zeros_like(draft_len))
        tokens = torch.nan_to_num(logits).argmax(dim=-1)
        return DraftBlock(tokens=tokens, logits=logits, draft_len=draft_len, ratio=ratio, finite=finite)

    def draw(self, prefix: torch.Tensor, logits: torch.Tensor, processors) -> tuple[torch.Tensor, torch.Tensor]:
        """Pick draft tokens slot by slot from the *processed* draft logits, as the parent does.

        `prefix` (`[t]`) is the row's sequence before the drafts, `logits` (`[k, V]`) the raw draft
        logits, `processors` the row's logits processors (batch 1: `self.logits_processor`). Returns
        the `k` tokens (sampled when `do_sample`, else argmax) and their processed scores: the draft
        distribution lossless speculative sampling needs.

        Example:
            >>> tokens, scores = gen.draw(seq, block.logits[0, :3], gen.logits_processor)  # doctest: +SKIP
        """
        scores = logits.float().clone()
        tokens = prefix.new_empty(0)
        for j in range(scores.shape[0]):
            if processors:  # each slot on its own prefix, as plain decoding would process it
                scores[j] = processors(torch.cat([prefix, tokens])[None], scores[j][None])[0]
            pick = torch.multinomial(scores[j].softmax(-1), 1) if self.do_sample else scores[j].argmax()[None]
            tokens = torch.cat([tokens, pick])
        return tokens, scores

    @torch.no_grad()
    def get_candidates(self, input_ids, model_kwargs, model_outputs, is_first_iteration, n_last_matches, **kwargs):
        """One round of transformers' (batch-1) `_assisted_decoding`: the parent's round, but it
        proposes only `k_hat - 1` drafts from the length policy, and none when the draft logits are
        not finite (that round is a plain decoding step).

        Example:
            >>> target.generate(ids, assistant_model=drafter, speculation_type="adaflash")  # doctest: +SKIP
        """
        if is_first_iteration:  # the target's prefill runs first; its features seed the drafter
            return input_ids, None
        budget = self.main_model_max_length - input_ids.shape[1] - 1
        if budget <= 0:
            return input_ids, None
        # New context: the prompt after the prefill, else the bonus + accepted drafts of the last verify.
        n_ctx = input_ids.shape[1] - 1 if self.is_main_model_prefill else n_last_matches + 1
        self.is_main_model_prefill = False
        positions, mask = model_kwargs["position_ids"], model_kwargs.get("attention_mask")
        ctx_pos = positions[:, -n_ctx - 1 : -1]
        ctx_valid = mask[:, -n_ctx - 1 : -1].bool() if mask is not None else torch.ones_like(ctx_pos, dtype=torch.bool)
        ctx = self.assistant_model.select_context(model_outputs.hidden_states)[:, :n_ctx].to(self.device)
        self._rows[0].remaining = budget + 1
        block = self.propose(input_ids[:, -1], positions[:, -1], ctx, ctx_valid, ctx_pos,
                             torch.tensor([budget], device=input_ids.device), rows=self._rows)
        k = int(block.draft_len[0])
        if k == 0:
            return input_ids, None
        tokens, scores = self.draw(input_ids[0], block.logits[0, :k], self.logits_processor)
        return torch.cat([input_ids, tokens[None]], dim=1), scores[None]
