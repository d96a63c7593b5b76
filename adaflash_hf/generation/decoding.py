"""The speculative decoding loop: draft, verify, accept, for a padded batch of any size.

It runs as a transformers `custom_generate` decoding method, so `generate` does all the usual
preparation (generation config, logits processors, stopping criteria including stop strings,
`max_length`, cache, streamer prompt) and this loop only replaces the token-by-token step.
Each row accepts its own number of tokens per round; finished rows leave the batch.

Lossless by construction: every committed token is the target's greedy choice (or follows the
target's processed distribution via speculative sampling), computed with the same logits
processors, on the same prefix, as plain decoding would use.
"""

import time
from dataclasses import dataclass

import torch
from transformers.generation.logits_process import LogitsProcessorList

from ..modeling import AdaFlashDrafter
from ..speculation.hooks import hooks_for, round_callbacks
from ..speculation.length import LengthPolicy, LengthSettings, RowState
from ..speculation.prompt_ngrams import NgramIndex, PromptNgrams, agree_wide, agree_with_drafts
from ..speculation.rounds import RoundSink, VerifiedRound
from ..speculation.verify import SampledRows, accept_block
from .drafting import AdaFlashCandidateGenerator, DraftBlock
from .fast_path import engine_decoding, takes_engine
from .output import Output, emit_requests, finish
from .processors import process_rows, row_processors, shared_processors
from .stats import GenerationStats


def _check_call(model, drafter, generation_config, input_ids, model_kwargs, round_sink) -> None:
    if not isinstance(drafter, AdaFlashDrafter):
        raise TypeError(f"drafter must be an AdaFlashDrafter, got {type(drafter).__name__}")
    if generation_config.num_beams != 1:
        raise ValueError("speculative decoding with an AdaFlash drafter does not support beam search (num_beams > 1)")
    # num_return_sequences > 1 needs nothing here: generate repeats each prompt's row that many times before this
    # loop runs (sampling only; transformers refuses it for greedy decoding), and rows sample independently.
    if generation_config.output_attentions:
        # Verify forwards attend over draft tokens that may be rejected: plain decoding never
        # computes those attention rows, so there is nothing faithful to return.
        raise ValueError(
            "output_attentions is not supported with an AdaFlash drafter: verify forwards attend over rejected "
            "draft tokens, which plain decoding never sees (output_hidden_states=True is supported)"
        )
    if model.config.is_encoder_decoder:
        raise ValueError("AdaFlash drafters draft for decoder-only targets; this target is encoder-decoder")
    drafter.check_target(model)
    target_param = next(model.parameters())
    draft_param = next(drafter.parameters())
    if draft_param.device != target_param.device or draft_param.dtype != target_param.dtype:
        raise ValueError(
            f"drafter is on {draft_param.device}/{draft_param.dtype} but the target is on "
            f"{target_param.device}/{target_param.dtype}: move it first, drafter.to(target.device, target.dtype)"
        )
    cache = model_kwargs.get("past_key_values")
    if cache is not None and getattr(cache, "is_compileable", False):
        raise ValueError("speculative decoding needs a dynamic cache (it rolls back rejected tokens); got a static one")
    cached = cache.get_seq_length() if cache is not None else 0
    if cached:
        # The drafter drafts from the target's features of the whole prompt, which a pre-filled cache
        # skipped; feeding the prompt again on top of the cache would be silently wrong.
        raise ValueError(
            f"past_key_values already holds {cached} tokens: speculative decoding with an AdaFlash drafter needs "
            "the whole prompt's target features, so it prefills the cache itself. Pass the full prompt and drop "
            "past_key_values (or pass an empty DynamicCache())"
        )
    embeds = model_kwargs.get("inputs_embeds")
    if embeds is not None and embeds.shape[1] != input_ids.shape[1] and round_callbacks(round_sink, drafter)[0] is not None:
        # Rounds and finished requests carry the prompt's token ids (an online adapter learns from them).
        raise ValueError(
            "round_sink (or an online adapter attached to the drafter) needs the prompt's token ids: pass input_ids "
            "along with inputs_embeds, or generate from input_ids"
        )
    mask = model_kwargs.get("attention_mask")
    if mask is not None and mask.dim() == 2 and bool((mask[:, :-1].bool() & ~mask[:, 1:].bool()).any()):
        raise ValueError(
            "attention_mask has padding after real tokens (right-padded, or holes): speculative decoding with an "
            "AdaFlash drafter needs left padding. Pad on the left: tokenizer.padding_side='left'"
        )


@dataclass
class _Batch:
    """State of the rows still decoding (finished rows leave the batch)."""

    index: torch.Tensor  # original row of each active row
    seqs: list[torch.Tensor]  # left-padded prompt + generated tokens, as plain generate sees them
    processors: list  # each row's logits processors (`row_processors`: batch state cut to the row)
    shared: LogitsProcessorList | None  # the processors to call on every row at once (`shared_processors`)
    prompt_len: int
    prompt_mask: torch.Tensor  # real (non-padding) prompt columns
    valid: torch.Tensor  # target cache columns that hold real tokens
    pos: torch.Tensor  # position of each row's bonus token (committed, not yet in the target cache)
    bonus: torch.Tensor
    ctx: torch.Tensor  # target features of verified tokens the drafter has not consumed yet
    ctx_valid: torch.Tensor
    ctx_pos: torch.Tensor
    ngrams: list[NgramIndex] | None = None  # each row's tokens (host) for the prompt n-gram rule; None: rule off
    max_width: int | None = None  # `PromptNgrams.max_width` for greedy rows (sampled rows never widen: None)
    rows: list[RowState] | None = None  # each row's part of the verify-length planner's state

    def drop_finished(self, done: torch.Tensor, cache, generator) -> None:
        keep = (~done).nonzero().squeeze(1)
        self.seqs = [s for s, d in zip(self.seqs, done.tolist()) if not d]
        self.processors = [p for p, d in zip(self.processors, done.tolist()) if not d]
        self.rows = [r for r, d in zip(self.rows, done.tolist()) if not d]
        if self.ngrams is not None:
            self.ngrams = [g for g, d in zip(self.ngrams, done.tolist()) if not d]
        for name in ("index", "prompt_mask", "valid", "pos", "bonus", "ctx", "ctx_valid", "ctx_pos"):
            setattr(self, name, getattr(self, name)[keep])
        cache.batch_select_indices(keep)
        generator.select_rows(keep)

    def advance(self, features: torch.Tensor, accepted: torch.Tensor, next_tokens: torch.Tensor, verified: int, cache,
                drafted: bool = True) -> None:
        """Keep K/V and features of the bonus + accepted drafts; roll back the rest. The kept features are the
        drafter's next context; after a round the drafter did not run in (``drafted`` False: a plain plan), they join
        the context it has yet to read."""
        cols = torch.arange(verified, device=accepted.device)[None, :]
        new_valid = cols <= accepted[:, None]
        keep = int(accepted.max()) + 1
        cache.crop(-(verified - keep))
        self.valid = torch.cat([self.valid, new_valid[:, :keep]], dim=1)
        ctx, ctx_valid, ctx_pos = features[:, :keep], new_valid[:, :keep], self.pos[:, None] + cols[:, :keep]
        if drafted:
            self.ctx, self.ctx_valid, self.ctx_pos = ctx, ctx_valid, ctx_pos
        else:
            self.ctx = torch.cat([self.ctx, ctx], dim=1)
            self.ctx_valid, self.ctx_pos = torch.cat([self.ctx_valid, ctx_valid], 1), torch.cat([self.ctx_pos, ctx_pos], 1)
        self.pos = self.pos + accepted + 1
        self.bonus = next_tokens

    def extend_ngrams(self, draft: torch.Tensor, accepted: list[int], next_tokens: torch.Tensor) -> None:
        """Append each row's committed tokens to its n-gram index's tokens."""
        if self.ngrams is not None:
            for g, row, a, t in zip(self.ngrams, draft.tolist(), accepted, next_tokens.tolist()):
                g.tokens.extend(row[:a] + [t])

    def context_ids(self, i: int) -> torch.Tensor:
        """Row `i`'s tokens before its bonus token, prompt padding removed."""
        seq = self.seqs[i]
        return torch.cat([seq[: self.prompt_len][self.prompt_mask[i]], seq[self.prompt_len : -1]])


class _Timer:
    def __init__(self, sync: bool):
        self.sync = sync

    def __call__(self) -> float:
        if self.sync:
            torch.cuda.synchronize()
        return time.perf_counter()


def adaflash_decoding(
    model,
    input_ids: torch.LongTensor,
    logits_processor=None,
    stopping_criteria=None,
    generation_config=None,
    synced_gpus: bool = False,
    streamer=None,
    drafter: AdaFlashDrafter | None = None,
    length_policy: str | LengthSettings | None = None,
    length_rate: float | None = None,
    length_min: int | None = None,
    return_stats: bool = False,
    round_sink: RoundSink | None = None,
    fast_path: str | bool = "auto",
    prompt_ngrams: int | PromptNgrams | None = None,
    spec_rounds: int = 1,
    **model_kwargs,
):
    """Speculative decoding with an AdaFlash drafter, as a transformers `custom_generate` method.

    With `return_dict_in_generate=True`, `scores`, `logits` and `hidden_states` (with
    `output_hidden_states=True`) come back as plain `generate` returns them: one entry per
    generated token, the first `hidden_states` step holding the prompt positions. Rows of a batch
    that stopped earlier than others hold -inf scores / logits and zero hidden states in the steps
    after their last token (plain generate keeps computing them on padding).

    `fast_path`: on CUDA (`"auto"`) the rounds run on the engine's fused layers, slot caches and CUDA
    graphs when the call allows it, else here with a warning naming why (:mod:`.fast_path`); `True`
    takes the engine off CUDA too, `False` never.

    `length_policy`, `length_rate`, `length_min`: the verify-length settings (or a
    :class:`~adaflash_hf.speculation.length.names.LengthSettings` as `length_policy`); each round's plan and lengths
    come from the same planner as the engine's (:mod:`adaflash_hf.speculation.length.planner`).

    `prompt_ngrams`: the prompt n-gram rule beside the drafter (:mod:`adaflash_hf.speculation.prompt_ngrams`: a row
    verifies prompt lookup's candidate instead of the drafts when its first token equals the first draft), as the
    longest n-gram matched (0 turns it off) or a :class:`~adaflash_hf.speculation.prompt_ngrams.PromptNgrams`; default: 4,
    greedy decoding only (``PromptNgrams(4, sampled=True)`` under sampling too). Off while a round sink (an online
    adapter) is attached: it learns from the drafter's own rounds.

    `spec_rounds`: on the engine (`fast_path`) with `length_policy="fixed"`, queue up to this many rounds on the device
    behind one read (:mod:`adaflash_hf.engine.spec_rounds`: each built from the last one's verdict there; the prompt
    n-gram rule sits the queued rounds out). Outputs are unchanged; 1 (the default) reads once a round.

    Example:
        >>> out = target.generate(ids, custom_generate=adaflash_decoding, drafter=drafter)  # doctest: +SKIP
    """
    _check_call(model, drafter, generation_config, input_ids, model_kwargs, round_sink)
    rows = row_processors(logits_processor, input_ids.shape[0])  # refuses a processor we cannot run, before any work
    ngrams = PromptNgrams.of(prompt_ngrams)
    length = LengthSettings.of(length_policy if isinstance(length_policy, LengthSettings) else None,
                               length_policy=None if isinstance(length_policy, LengthSettings) else length_policy,
                               length_rate=length_rate, length_min=length_min).resolved(drafter)
    _check_spec_rounds(spec_rounds, length, fast_path)
    if takes_engine(fast_path, model, drafter, generation_config, logits_processor, model_kwargs, length):
        return engine_decoding(model, drafter, input_ids, logits_processor, stopping_criteria, generation_config, streamer,
                               length=length, return_stats=return_stats, round_sink=round_sink, prompt_ngrams=ngrams,
                               spec_rounds=spec_rounds, **model_kwargs)
    if spec_rounds > 1:
        raise ValueError(f"spec_rounds={spec_rounds} queues the engine's rounds, and this call runs the eager loop "
                         "(off CUDA pass fast_path=True; a warning above names any other reason)")
    return _draft_verify_loop(model, drafter, input_ids, logits_processor, rows, stopping_criteria, generation_config, streamer,
                              length, return_stats, round_sink, ngrams, model_kwargs)


def _check_spec_rounds(spec_rounds, length: LengthSettings, fast_path) -> None:
    """Refuse a ``spec_rounds`` that is not a positive int, or that cannot apply (not ``fixed``, no engine)."""
    if isinstance(spec_rounds, bool) or not isinstance(spec_rounds, int) or spec_rounds < 1:
        raise ValueError(f"spec_rounds must be an integer >= 1, got {spec_rounds!r}")
    if spec_rounds > 1 and length.policy is not LengthPolicy.FIXED:
        raise ValueError(f"spec_rounds={spec_rounds} queues fixed rounds: pass length_policy='fixed' "
                         f"(this call's is {length.policy.value!r})")
    if spec_rounds > 1 and fast_path is False:
        raise ValueError(f"spec_rounds={spec_rounds} queues the engine's rounds: fast_path=False runs the eager loop")


def _draft_verify_loop(model, drafter, input_ids, logits_processor, rows, stopping_criteria, generation_config, streamer,
                       length, return_stats, round_sink, ngrams, model_kwargs):
    """The eager rounds of :func:`adaflash_decoding` (transformers' modules, a `DynamicCache`)."""
    # An online adapter attached to the drafter (`OnlineAdapter.attach()`) receives every round.
    on_round, on_request = round_callbacks(round_sink, drafter)
    if on_round is not None:
        ngrams = PromptNgrams(0)  # the adapter learns from the drafter's own rounds
    generator = AdaFlashCandidateGenerator.for_target(model, drafter, generation_config, logits_processor, length=length)
    planner = generator.planner
    stats = GenerationStats(block_size=generator.block_size, policy=generator.policy)
    output = Output.for_config(generation_config, stopping_criteria, streamer)
    do_sample, max_length = generation_config.do_sample, generation_config.max_length
    # The drafter's context layers, or every layer when the caller asked for hidden states.
    layers = generator.model_kwargs_overrides["output_hidden_states"]
    clock = _Timer(return_stats and input_ids.device.type == "cuda")
    # An online adapter swaps new weights in only between rounds: it takes this lock exclusively.
    weights_lock = hooks_for(drafter).weights_lock

    t0 = clock()
    batch, cache, done = _prefill(model, drafter, input_ids, rows, shared_processors(logits_processor), model_kwargs, layers,
                                 do_sample, output, ngrams)
    stats.verify_time_s += clock() - t0
    while not bool(done.all()):
        if bool(done.any()):
            batch.drop_finished(done, cache, generator)

        # 1. The planner's plan: a plain round (no drafter), or one block per row in one drafter forward and each
        #    row's verify length (a row taking a prompt n-gram candidate verifies it up to `PromptNgrams.max_width`,
        #    past the block if need be).
        t0 = clock()
        left = [max_length - s.shape[0] for s in batch.seqs]
        for r, n in zip(batch.rows, left):
            r.remaining = n
        budget = torch.tensor([n - 1 for n in left], device=batch.bonus.device)
        plan = planner.plan(batch.rows, sink=on_round is not None)
        with weights_lock:
            block, draft, q = _draft(generator, batch, budget, do_sample, plan)
        draft, q, used, draft_len = _with_ngrams(batch, block, draft, q, budget)
        stats.fallback_rounds += int((~block.finite).sum())
        stats.ngram_rounds += int(used.sum())
        k = draft.shape[1]
        stats.wide_rounds += int(k + 1 > generator.block_size)
        t1 = clock()

        # 2. Verify every row's bonus + drafts in one target forward (rows padded to the longest).
        out, logits, processed = _verify(model, batch, draft, cache, layers)

        # 3. Accept the longest agreeing prefix (greedy) or by the speculative sampling rule (the shared step).
        if do_sample:
            q = q if q is not None else processed[:, :0].softmax(-1)
            res = accept_block(draft, draft_len, sampled=[SampledRows(None, q, processed.softmax(-1), draft_len)])
        else:
            res = accept_block(draft, draft_len, processed.argmax(dim=-1))
        acc = res.num_accepted
        t2 = clock()
        stats.draft_time_s, stats.verify_time_s = stats.draft_time_s + t1 - t0, stats.verify_time_s + t2 - t1

        # 4. Commit tokens (stopping token by token), record the round, roll back rejected K/V.
        if on_round is not None:
            _emit_rounds(on_round, batch, block, draft, logits, acc)
        done = _commit_round(output, batch, draft, res, logits, processed, out.hidden_states)
        for i in range(len(batch.seqs)):  # a row that stops inside the round counts the tokens it emitted, not acc + 1
            stats.record(int(batch.index[i]), int(draft_len[i]) + 1, output.committed[i] - 1)
            planner.observe(batch.rows[i], output.committed[i] - 1, int(draft_len[i]) + 1)
        batch.extend_ngrams(draft, acc.tolist(), res.next_tokens)
        batch.advance(drafter.select_context(out.hidden_states), acc, res.next_tokens, k + 1, cache, drafted=plan.draft)

    if streamer is not None:
        streamer.end()
    if on_request is not None:
        emit_requests(on_request, input_ids, model_kwargs.get("attention_mask"), output)
    return finish(input_ids, output, generation_config, stats, return_stats)


def _verify(model, batch: _Batch, draft: torch.Tensor, cache, layers):
    """The target's forward over every row's bonus + drafts: its output, raw and processed logits."""
    verify_ids = torch.cat([batch.bonus[:, None], draft], dim=1)
    out = model(
        input_ids=verify_ids,
        attention_mask=torch.cat([batch.valid, torch.ones_like(verify_ids, dtype=torch.bool)], dim=1).long(),
        position_ids=batch.pos[:, None] + torch.arange(verify_ids.shape[1], device=verify_ids.device),
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=layers,
    )
    logits = out.logits.float()
    # the rows' sequences only where some processor reads them (no per-row concatenation on the shared path)
    seqs = None if batch.shared is not None else [torch.cat([s, d]) for s, d in zip(batch.seqs, draft)]
    processed = process_rows(batch.processors, batch.shared, seqs, logits)
    return out, logits, processed


def _commit_round(output: Output, batch: _Batch, draft, res, logits, processed, hidden_states) -> torch.Tensor:
    """Commit each row's accepted drafts + next token (with their logits / hidden states when asked for)."""
    acc = res.num_accepted.tolist()
    new = [torch.cat([d[:a], t[None]]) for d, a, t in zip(draft, acc, res.next_tokens)]
    kept = [slice(0, a + 1) for a in acc]
    hidden = _token_hidden(hidden_states, [a + 1 for a in acc]) if output.want_hidden else None
    return output.commit(batch, new, [l[s] for l, s in zip(logits, kept)], [p[s] for p, s in zip(processed, kept)], hidden)


def _emit_rounds(on_round, batch: _Batch, block, draft, target_logits, acc) -> None:
    """Every row's verified round (called before the round's tokens are committed: context excludes them)."""
    for i in range(len(batch.seqs)):
        ratio = block.ratio[i] if block.ratio is not None else None
        on_round(VerifiedRound.from_block(int(batch.index[i]), batch.context_ids(i), batch.bonus[i], draft[i], block.logits[i],
                                          target_logits[i], block.draft_len[i], acc[i], ratio))


def _prefill(model, drafter, input_ids, rows, shared, model_kwargs, layers, do_sample, output: Output, ngrams: PromptNgrams):
    """The target's first token for each row, and the prompts' features as the drafter's first context."""
    # With `inputs_embeds` the prompt is the embeddings (input_ids then holds only the prompt ids the caller
    # also passed, often none: generate returns just the new tokens); the drafter needs only its features.
    embeds = model_kwargs.get("inputs_embeds")
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is None:
        width = (embeds if embeds is not None else input_ids).shape[1]
        attention_mask = torch.ones(input_ids.shape[0], width, dtype=torch.long, device=input_ids.device)
    out = model(
        input_ids=input_ids if embeds is None else None,
        inputs_embeds=embeds,
        attention_mask=attention_mask,
        position_ids=model_kwargs.get("position_ids"),
        past_key_values=model_kwargs.get("past_key_values"),
        use_cache=True,
        output_hidden_states=layers,
        logits_to_keep=1,
    )
    logits = out.logits[:, -1:].float()
    seqs = list(input_ids)
    processed = list(process_rows(rows, shared, seqs, logits))
    first = torch.stack([torch.multinomial(p[0].softmax(-1), 1)[0] if do_sample else p[0].argmax() for p in processed])
    mask = attention_mask.bool()
    batch = _Batch(
        index=torch.arange(input_ids.shape[0], device=input_ids.device),
        seqs=seqs,
        processors=rows,
        shared=shared,
        prompt_len=input_ids.shape[1],
        prompt_mask=mask,
        valid=mask,
        pos=attention_mask.long().sum(dim=1),
        bonus=first,
        ctx=drafter.select_context(out.hidden_states),
        ctx_valid=mask,
        ctx_pos=(attention_mask.long().cumsum(-1) - 1).clamp(min=0),
        rows=[RowState() for _ in range(input_ids.shape[0])],
    )
    if ngrams.applies(greedy=not do_sample):  # each row's prompt ids (those given: none with inputs_embeds alone) and its first token
        given = mask[:, -input_ids.shape[1] :] if input_ids.shape[1] else mask[:, :0]
        batch.ngrams = [ngrams.index(ids[m].tolist() + [int(t)]) for ids, m, t in zip(input_ids, given, first)]
        batch.max_width = None if do_sample else ngrams.max_width
    hidden = [[tuple(h[i] for h in out.hidden_states)] for i in range(input_ids.shape[0])] if output.want_hidden else None
    done = output.commit(batch, [t[None] for t in first], list(logits), processed, hidden)
    return batch, out.past_key_values, done


def _token_hidden(hidden_states, counts: list[int]) -> list[list[tuple]]:
    """Per row, the per-layer `[1, H]` hidden states of each of its `counts[i]` new tokens (verify
    position j made the row's j-th new token, so its states are that generate step's)."""
    return [[tuple(h[i, j : j + 1] for h in hidden_states) for j in range(n)] for i, n in enumerate(counts)]


def _draft(generator: AdaFlashCandidateGenerator, batch: _Batch, budget: torch.Tensor, do_sample: bool, plan):
    """One block per row (capped by ``budget``, the tokens left before ``max_length``; none under a plain ``plan``), its
    drafts ``[b, k]`` for the longest verify ``k``, and (sampling) the processed draft distributions they were drawn
    from."""
    if plan.plain:
        block = DraftBlock.plain(len(batch.seqs), batch.bonus.device)
        return block, block.tokens, None
    block = generator.propose(batch.bonus, batch.pos, batch.ctx, batch.ctx_valid, batch.ctx_pos, budget, rows=batch.rows,
                              whole=plan.whole)
    k = int(block.draft_len.max())
    draft, q = _sample_drafts(generator, batch, block, k) if do_sample and k > 0 else (block.tokens[:, :k], None)
    return block, draft, q


def _with_ngrams(batch: _Batch, block, draft: torch.Tensor, q, budget: torch.Tensor):
    """The prompt n-gram rule on this round's drafts (:func:`~adaflash_hf.speculation.prompt_ngrams.agree_with_drafts`;
    :func:`~adaflash_hf.speculation.prompt_ngrams.agree_wide` for greedy rows under ``max_width``): the drafts to
    verify, their distributions, the rows that took a candidate and each row's verify length - 1."""
    if batch.ngrams is None:
        return draft, q, torch.zeros(draft.shape[0], dtype=torch.bool), block.draft_len
    if batch.max_width is None:
        draft, q, used = agree_with_drafts(draft, [g.candidates(draft.shape[1]) for g in batch.ngrams], q)
        return draft, q, used, block.draft_len
    width = max(draft.shape[1], batch.max_width)
    draft, draft_len, used = agree_wide(draft, block.draft_len, [g.candidates(width) for g in batch.ngrams],
                                        batch.max_width, budget.clamp(min=0))
    return draft, q, used, draft_len


def _sample_drafts(generator: AdaFlashCandidateGenerator, batch: _Batch, block, k):
    """Sample draft tokens from the *processed* draft distribution (needed for lossless sampling)."""
    if batch.shared is not None:  # no processor reads the sequence: every slot of every row at once
        q = process_rows(None, batch.shared, None, block.logits[:, :k].float()).softmax(-1)
        return torch.multinomial(q.flatten(0, 1), 1).view(q.shape[:2]), q
    drawn = [generator.draw(seq, block.logits[i, :k], p) for i, (seq, p) in enumerate(zip(batch.seqs, batch.processors))]
    return torch.stack([tokens for tokens, _ in drawn]), torch.stack([scores.softmax(-1) for _, scores in drawn])
