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
from contextlib import nullcontext

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..modeling import AdaFlashDrafter
from .acceptance import greedy_accept, speculative_accept
from .drafting import AdaFlashCandidateGenerator
from .stats import GenerationStats, RoundSink, VerifiedRound


def _check_call(model, drafter, generation_config, model_kwargs) -> None:
    if not isinstance(drafter, AdaFlashDrafter):
        raise TypeError(f"drafter must be an AdaFlashDrafter, got {type(drafter).__name__}")
    if generation_config.num_beams != 1:
        raise ValueError("speculative decoding with an AdaFlash drafter does not support beam search (num_beams > 1)")
    if generation_config.num_return_sequences != 1:
        raise ValueError("speculative decoding with an AdaFlash drafter does not support num_return_sequences > 1")
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise ValueError("output_attentions / output_hidden_states are not supported with an AdaFlash drafter")
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


def _process(logits_processor, seq: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Apply the processors position by position, each on its own prefix (as plain decoding does)."""
    if not len(logits_processor):
        return scores
    out = scores.clone()
    n = scores.shape[0]
    base = seq.shape[0] - n + 1
    for j in range(n):
        out[j] = logits_processor(seq[None, : base + j], scores[j][None])[0]
    return out


class _Rows:
    """Per-row decoding state of the active (unfinished) rows."""

    def __init__(self, input_ids, attention_mask):
        b, p = input_ids.shape
        self.index = torch.arange(b, device=input_ids.device)  # original row of each active row
        self.seqs = [input_ids[i] for i in range(b)]  # padded prompt + generated, as plain generate sees it
        self.prompt_len = p
        self.prompt_mask = attention_mask.bool()  # real (non-padding) prompt columns
        self.valid = attention_mask.bool()  # target cache columns that hold real tokens
        self.pos = attention_mask.long().sum(dim=1)  # position of each row's next input token

    def select(self, keep: torch.Tensor) -> None:
        self.index, self.valid, self.pos = self.index[keep], self.valid[keep], self.pos[keep]
        self.prompt_mask = self.prompt_mask[keep]


def adaflash_decoding(
    model,
    input_ids: torch.LongTensor,
    logits_processor=None,
    stopping_criteria=None,
    generation_config=None,
    synced_gpus: bool = False,
    streamer=None,
    drafter: AdaFlashDrafter | None = None,
    length_policy: str | None = None,
    length_rate: float | None = None,
    length_min: int | None = None,
    return_stats: bool = False,
    round_sink: RoundSink | None = None,
    **model_kwargs,
):
    """Speculative decoding with an AdaFlash drafter, as a transformers `custom_generate` method.

    Example:
        >>> out = target.generate(ids, custom_generate=adaflash_decoding, drafter=drafter)  # doctest: +SKIP
    """
    _check_call(model, drafter, generation_config, model_kwargs)
    if round_sink is None:
        # An online adapter attached to the drafter (`OnlineAdapter.attach()`) receives every round.
        round_sink = getattr(drafter, "_round_sink", None)
    cfg = drafter.config
    if length_policy is None:
        length_policy = "adaptive" if (cfg.use_length_head and cfg.length_head_trained) else "fixed"
    generator = AdaFlashCandidateGenerator(
        drafter,
        length_policy,
        cfg.length_rate if length_rate is None else length_rate,
        cfg.length_min if length_min is None else length_min,
    )
    stats = GenerationStats(block_size=cfg.block_size, policy=length_policy)
    do_sample = generation_config.do_sample
    pad = generation_config.pad_token_id if generation_config.pad_token_id is not None else 0
    max_length = generation_config.max_length
    layers = [i + 1 for i in cfg.target_layer_ids]
    want_scores = generation_config.return_dict_in_generate and generation_config.output_scores
    want_logits = generation_config.return_dict_in_generate and generation_config.output_logits
    sync = return_stats and input_ids.device.type == "cuda"

    def clock():
        if sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    b = input_ids.shape[0]
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    cache = model_kwargs.get("past_key_values")
    rows = _Rows(input_ids, attention_mask)
    finished_seqs: dict[int, torch.Tensor] = {}
    scores = [[] for _ in range(b)]
    raw = [[] for _ in range(b)]

    # Prefill: the target's first token, and the prompt's features as the drafter's first context.
    t0 = clock()
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=model_kwargs.get("position_ids"),
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=layers,
        logits_to_keep=1,
    )
    cache = out.past_key_values
    ctx, ctx_valid = drafter.select_context(out.hidden_states), rows.valid
    ctx_pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    first_logits = out.logits[:, -1].float()
    stats.verify_time_s += clock() - t0
    next_tokens = []
    for i in range(b):
        s = _process(logits_processor, rows.seqs[i], first_logits[i : i + 1])
        tok = torch.multinomial(s.softmax(-1), 1)[0, 0] if do_sample else s[0].argmax()
        next_tokens.append(tok)
    bonus = torch.stack(next_tokens)
    done = _commit(rows, [bonus[i : i + 1] for i in range(b)], [first_logits[i : i + 1] for i in range(b)], logits_processor, stopping_criteria, scores, raw, want_scores, want_logits, finished_seqs, streamer, pad)

    while True:
        keep = (~done).nonzero().squeeze(1)
        if keep.numel() == 0:
            break
        if keep.numel() < len(done):
            rows.select(keep)
            rows.seqs = [s for s, d in zip(rows.seqs, done.tolist()) if not d]
            bonus, ctx, ctx_valid, ctx_pos = bonus[keep], ctx[keep], ctx_valid[keep], ctx_pos[keep]
            cache.batch_select_indices(keep)
            generator.select_rows(keep)
        n = len(rows.seqs)

        # 1. Draft one block per row; the policy picks each row's verify length.
        t0 = clock()
        budget = torch.tensor([max_length - s.shape[0] - 1 for s in rows.seqs], device=bonus.device)
        # An online adapter swaps new weights in only between rounds: it takes this lock exclusively.
        with getattr(drafter, "_weights_lock", None) or nullcontext():
            block = generator.propose(bonus, rows.pos, ctx, ctx_valid, ctx_pos, budget)
        stats.fallback_rounds += int((~block.finite).sum())
        k = int(block.draft_len.max())
        draft = block.tokens[:, :k]
        q = None
        if do_sample and k > 0:
            draft, q = _sample_drafts(rows.seqs, block, k, logits_processor)
        t1 = clock()
        stats.draft_time_s += t1 - t0

        # 2. Verify every row's bonus + drafts in one target forward (rows padded to the longest).
        verify_ids = torch.cat([bonus[:, None], draft], dim=1)
        key_mask = torch.cat([rows.valid, torch.ones_like(verify_ids, dtype=torch.bool)], dim=1)
        out = model(
            input_ids=verify_ids,
            attention_mask=key_mask.long(),
            position_ids=rows.pos[:, None] + torch.arange(k + 1, device=bonus.device),
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=layers,
        )
        target_logits = out.logits.float()
        processed = torch.stack(
            [_process(logits_processor, torch.cat([rows.seqs[i], draft[i]]), target_logits[i]) for i in range(n)]
        ) if len(logits_processor) else target_logits

        # 3. Accept the longest agreeing prefix (greedy) or by the speculative sampling rule.
        if do_sample and k > 0:
            res = speculative_accept(draft, q, processed.softmax(-1), block.draft_len)
        elif do_sample:
            res = speculative_accept(draft, processed[:, :0].softmax(-1), processed.softmax(-1), block.draft_len)
        else:
            res = greedy_accept(draft, processed, block.draft_len)
        acc = res.num_accepted
        stats.verify_time_s += clock() - t1

        # 4. Commit tokens (stopping criteria checked token by token), roll back rejected K/V.
        for i in range(n):
            stats.record(int(rows.index[i]), int(block.draft_len[i]) + 1, int(acc[i]))
            if round_sink is not None:
                round_sink.on_round(_verified_round(rows, i, bonus, block, draft, target_logits, acc))
        new = [torch.cat([draft[i, : acc[i]], res.next_tokens[i : i + 1]]) for i in range(n)]
        done = _commit(rows, new, [target_logits[i, : acc[i] + 1] for i in range(n)], logits_processor, stopping_criteria, scores, raw, want_scores, want_logits, finished_seqs, streamer, pad, processed=[processed[i, : acc[i] + 1] for i in range(n)])
        cols = torch.arange(k + 1, device=bonus.device)[None, :]
        new_valid = cols <= acc[:, None]
        keep_cols = int(acc.max()) + 1
        cache.crop(-(k + 1 - keep_cols))
        rows.valid = torch.cat([rows.valid, new_valid[:, :keep_cols]], dim=1)
        ctx = drafter.select_context(out.hidden_states)[:, :keep_cols]
        ctx_valid = new_valid[:, :keep_cols]
        ctx_pos = rows.pos[:, None] + cols[:, :keep_cols]
        rows.pos = rows.pos + acc + 1
        bonus = res.next_tokens

    if streamer is not None:
        streamer.end()
    return _finish(input_ids, finished_seqs, scores, raw, pad, generation_config, stats, return_stats)


def _sample_drafts(seqs, block, k, logits_processor):
    """Sample draft tokens from the *processed* draft distribution (needed for lossless sampling)."""
    tokens, probs = [], []
    for i, seq in enumerate(seqs):
        row_tokens, row_probs = [], []
        for j in range(k):
            scores = logits_processor(torch.cat([seq, *row_tokens])[None], block.logits[i, j][None].clone())[0] if len(logits_processor) else block.logits[i, j]
            p = scores.softmax(-1)
            row_probs.append(p)
            row_tokens.append(torch.multinomial(p, 1))
        tokens.append(torch.cat(row_tokens))
        probs.append(torch.stack(row_probs))
    return torch.stack(tokens), torch.stack(probs)


def _commit(rows, new_tokens, logits, logits_processor, stopping_criteria, scores, raw, want_scores, want_logits, finished, streamer, pad, processed=None):
    """Append each row's new tokens one by one, stopping exactly where plain decoding would."""
    done = []
    for i, toks in enumerate(new_tokens):
        orig = int(rows.index[i])
        stop = False
        for j, tok in enumerate(toks):
            rows.seqs[i] = torch.cat([rows.seqs[i], tok[None]])
            if want_scores:
                scores[orig].append(processed[i][j] if processed is not None else _process(logits_processor, rows.seqs[i][:-1], logits[i][j : j + 1])[0])
            if want_logits:
                raw[orig].append(logits[i][j])
            if streamer is not None:
                streamer.put(tok[None].cpu())
            if bool(stopping_criteria(rows.seqs[i][None], None)[0]):
                stop = True
                break
        if stop:
            finished[orig] = rows.seqs[i]
        done.append(stop)
    return torch.tensor(done, device=rows.valid.device)


def _verified_round(rows, i, bonus, block, draft, target_logits, acc) -> VerifiedRound:
    verify_len = int(block.draft_len[i]) + 1
    return VerifiedRound(
        row=int(rows.index[i]),
        # Called before this round's tokens are committed; prompt padding removed (as documented).
        context_ids=torch.cat([rows.seqs[i][: rows.prompt_len][rows.prompt_mask[i]], rows.seqs[i][rows.prompt_len : -1]]),
        bonus_token=int(bonus[i]),
        draft_tokens=draft[i, : verify_len - 1].clone(),  # the tokens verified (sampled ones when sampling)
        draft_logits=block.logits[i, : verify_len - 1].clone(),
        target_logits=target_logits[i, :verify_len].clone(),
        verify_len=verify_len,
        num_accepted=int(acc[i]),
        predicted_ratio=float(block.ratio[i]) if block.ratio is not None else None,
    )


def _finish(input_ids, finished, scores, raw, pad, generation_config, stats, return_stats):
    b, p = input_ids.shape
    seqs = [finished[i] for i in range(b)]
    width = max(s.shape[0] for s in seqs)
    sequences = torch.full((b, width), pad, dtype=input_ids.dtype, device=input_ids.device)
    for i, s in enumerate(seqs):
        sequences[i, : s.shape[0]] = s
    stats.new_tokens = sum(s.shape[0] - p for s in seqs)
    result = sequences
    if generation_config.return_dict_in_generate:
        steps = width - p

        def stack(per_row):
            if not any(per_row):
                return None
            v = per_row[0][0].shape[-1] if per_row[0] else next(r for r in per_row if r)[0].shape[-1]
            filler = torch.full((v,), float("-inf"), device=input_ids.device)
            return tuple(torch.stack([r[t] if t < len(r) else filler for r in per_row]) for t in range(steps))

        result = GenerateDecoderOnlyOutput(sequences=sequences, scores=stack(scores), logits=stack(raw))
    return (result, stats) if return_stats else result
