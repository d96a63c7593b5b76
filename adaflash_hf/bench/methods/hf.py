"""transformers' own decoding paths: plain generate (dynamic and static cache), assisted generation
with a small autoregressive assistant, prompt-lookup decoding and the native DFlash path."""

from __future__ import annotations

from .base import MethodOutput


def run_plain(ctx, input_ids, attention_mask, streamer):
    return ctx.target.generate(input_ids, attention_mask=attention_mask, streamer=streamer, **ctx.generate_kwargs)


def run_plain_static(ctx, input_ids, attention_mask, streamer):
    kw = dict(ctx.generate_kwargs, cache_implementation="static")
    if ctx.device.type == "cuda":
        from transformers import CompileConfig

        kw["compile_config"] = CompileConfig()
    return ctx.target.generate(input_ids, attention_mask=attention_mask, streamer=streamer, **kw)


def _counting_target_forwards(ctx, input_ids, attention_mask, streamer, **kw) -> MethodOutput:
    """Generate with an assistant, counting target forwards: every one after the prefill is a verify round."""
    calls = []
    handle = ctx.target.register_forward_hook(lambda *_: calls.append(1))
    try:
        out = ctx.target.generate(input_ids, attention_mask=attention_mask, streamer=streamer, **kw, **ctx.generate_kwargs)
    finally:
        handle.remove()
    return MethodOutput(out, rounds=max(len(calls) - 1, 0))


def run_hf_assisted(ctx, input_ids, attention_mask, streamer):
    return _counting_target_forwards(ctx, input_ids, attention_mask, streamer, assistant_model=ctx.assistant)


def prompt_lookup_settings(ctx):
    """The knobs `generate` gives prompt lookup: ours, and the target's ``max_matching_ngram_size``
    (transformers' `_get_candidate_generator` reads it the same way: unset means 2)."""
    from ..prompt_lookup_tau import PromptLookupSettings

    max_ngram = getattr(ctx.target.generation_config, "max_matching_ngram_size", None) or 2
    return PromptLookupSettings(num_tokens=ctx.prompt_lookup_num_tokens, max_ngram=max_ngram)


class _RoundRecorder:
    """A streamer in front of the bench's: `_assisted_decoding` puts the prompt, then once per round
    the tokens that round committed, so each later put's size is one round's accepted count + 1."""

    def __init__(self, inner):
        self.inner, self.sizes = inner, []

    def put(self, value):
        self.sizes.append(int(value.numel()))
        if self.inner is not None:
            self.inner.put(value)

    def end(self):
        if self.inner is not None:
            self.inner.end()


def recorded_prompt_lookup(target, input_ids, attention_mask, num_tokens, streamer=None, **generate_kwargs):
    """Batch-1 ``target.generate(..., prompt_lookup_num_tokens=num_tokens)`` and the rounds it ran:
    ``(sequences, PromptLookupRounds)``, accepted counts from what each round streamed, verify lengths
    from the length of each target forward's input (the first one's holds the prompt too).

    Example:
        >>> out, rounds = recorded_prompt_lookup(target, ids, None, 10, max_new_tokens=64)  # doctest: +SKIP
        >>> rounds.tau, rounds.verify_lengths[:3]  # doctest: +SKIP
    """
    from ..prompt_lookup_tau import PromptLookupRounds

    if input_ids.shape[0] != 1:
        raise ValueError(f"prompt lookup decodes one sequence at a time, got a batch of {input_ids.shape[0]}")
    lengths = []
    handle = target.register_forward_hook(lambda m, args, kwargs, out: lengths.append(kwargs["input_ids"].shape[1]),
                                          with_kwargs=True)  # fmt: skip
    recorder = _RoundRecorder(streamer)
    try:
        out = target.generate(input_ids, attention_mask=attention_mask, streamer=recorder,
                              prompt_lookup_num_tokens=num_tokens, **generate_kwargs)  # fmt: skip
    finally:
        handle.remove()
    if lengths:
        lengths[0] += 1 - input_ids.shape[1]  # the prefill forward: the prompt, then its candidates
    rounds = PromptLookupRounds(accepted=[n - 1 for n in recorder.sizes[1:]], verify_lengths=lengths)
    if len(rounds.accepted) != len(lengths):
        raise RuntimeError(f"prompt lookup streamed {len(rounds.accepted)} rounds but ran {len(lengths)} target forwards")
    return out, rounds


def _settings_dict(settings) -> dict:
    return {"num_tokens": settings.num_tokens, "max_ngram": settings.max_ngram}


def _timed_prompt_lookup(ctx, input_ids, attention_mask, streamer, settings) -> MethodOutput:
    """Batch-1 prompt lookup at `settings` (the n-gram size passed to `generate` as ``max_matching_ngram_size``)."""
    from ..prompt_lookup_tau import as_generation_stats

    out, rounds = recorded_prompt_lookup(
        ctx.target, input_ids, attention_mask, settings.num_tokens, streamer,
        max_matching_ngram_size=settings.max_ngram, **ctx.generate_kwargs,
    )  # fmt: skip
    return MethodOutput(out, stats=as_generation_stats([rounds], settings), settings=_settings_dict(settings))


def run_prompt_lookup(ctx, input_ids, attention_mask, streamer):
    return _timed_prompt_lookup(ctx, input_ids, attention_mask, streamer, prompt_lookup_settings(ctx))


def run_prompt_lookup_tuned(ctx, input_ids, attention_mask, streamer):
    """``prompt_lookup_tuned``: transformers' prompt lookup at the set's setting chosen on validation."""
    return _timed_prompt_lookup(ctx, input_ids, attention_mask, streamer, ctx.prompt_lookup_tuned)


# Generation-config fields whose logits processors can forbid a candidate token depending on the sequence (or
# sampling warpers not modelled): prompt lookup then drops it (`get_candidates`), which the computation does not model.
_FORBIDDING = ("no_repeat_ngram_size", "bad_words_ids", "suppress_tokens", "begin_suppress_tokens", "sequence_bias")
_UNMODELLED_WARPERS = {"min_p": None, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0}


def forbidden_candidates(target, generate_kwargs) -> frozenset:
    """The token ids transformers' prompt lookup never proposes under these sampling settings: those its top-k /
    top-p warpers set to -inf on all-ones logits (candidate_generator.py:1107-1124), computed with the same
    warpers on the target's device, since the tie order of the sort decides which. Empty under greedy decoding.

    Example:
        >>> len(forbidden_candidates(target, dict(do_sample=True, top_p=0.95)))  # about 5% of the vocabulary  # doctest: +SKIP
    """
    import torch
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    def knob(name):  # generate's argument, else the target's generation config
        return generate_kwargs[name] if name in generate_kwargs else getattr(target.generation_config, name, None)

    if not knob("do_sample"):
        return frozenset()
    warpers = []
    if knob("top_k"):  # utils.py's `_get_logits_processor` order: top-k before top-p
        warpers.append(TopKLogitsWarper(top_k=knob("top_k"), min_tokens_to_keep=1))
    if knob("top_p") is not None and knob("top_p") < 1.0:
        warpers.append(TopPLogitsWarper(top_p=knob("top_p"), min_tokens_to_keep=1))
    vocab = target.config.get_text_config().vocab_size
    logits = torch.ones((1, vocab), device=target.device, dtype=torch.float32)
    ids = torch.zeros((1, 1), device=target.device, dtype=torch.long)
    for w in warpers:
        logits = w(ids, logits)
    dead = (logits == -float("inf")) | (logits == torch.finfo(logits.dtype).min)
    return frozenset(torch.nonzero(dead[0]).flatten().tolist())


def needs_plain_rows(ctx, concurrency):
    """`Method.skip` of the computed prompt-lookup methods: skipped only where a processor can forbid a candidate.

    Their rounds are a function of the output tokens, greedy or sampled: transformers' assisted loop keeps a
    prompt-lookup candidate iff it equals the token the target picks there (argmax, or a sample of the processed
    distribution: `_assisted_decoding`'s "Case 2", no candidate logits), so the output is distributed as plain's
    and the rounds follow from it. Under sampling plain's rows are then a draw of the same distribution, not the
    very sample prompt lookup would have drawn (tests/test_prompt_lookup_tau.py checks the function on real
    sampled runs)."""
    config = ctx.target.generation_config
    set_ = [f for f in _FORBIDDING if getattr(config, f, None)]
    if ctx.generate_kwargs.get("do_sample"):
        set_ += [f for f, off in _UNMODELLED_WARPERS.items() if getattr(config, f, off) not in (off, None)]
    if set_:
        return f"the target's generation config sets {', '.join(set_)}: forbidden candidates are not modelled"
    return None


def prompt_lookup_from_plain(ctx, prompts, rows, max_new_tokens, eos_ids):
    """``prompt_lookup_exact``: prompt lookup's rounds on every prompt, computed from plain's `rows`."""
    from ..prompt_lookup_tau import as_generation_stats, prompt_lookup_rounds

    settings, forbidden = prompt_lookup_settings(ctx), forbidden_candidates(ctx.target, ctx.generate_kwargs)
    rounds = [prompt_lookup_rounds(p, r, max_new_tokens, eos_ids, settings, forbidden) for p, r in zip(prompts, rows)]
    return MethodOutput(None, stats=as_generation_stats(rounds, settings), settings=_settings_dict(settings))


def prompt_lookup_grid_from_plain(ctx, prompts, rows, max_new_tokens, eos_ids):
    """``prompt_lookup_grid``: every grid point computed from plain's `rows`; the cell's figures are
    the setting chosen on validation (``ctx.prompt_lookup_tuned``), else the best on these prompts."""
    from ..prompt_lookup_grid import best_setting, grid_record, grid_rounds

    forbidden = forbidden_candidates(ctx.target, ctx.generate_kwargs)
    stats = grid_rounds(prompts, rows, max_new_tokens, eos_ids, forbidden=forbidden)
    chosen, on = ctx.prompt_lookup_tuned, "validation (--prompt-lookup-choice)"
    if chosen is None:
        chosen, on = best_setting(stats), "these prompts"
    if chosen not in stats:  # a validation file from another grid: compute its point too
        stats.update(grid_rounds(prompts, rows, max_new_tokens, eos_ids, grid=(chosen,), forbidden=forbidden))
    return MethodOutput(None, stats=stats[chosen], settings=grid_record(stats, chosen, on))


def run_dflash_native(ctx, input_ids, attention_mask, streamer):
    return _counting_target_forwards(
        ctx, input_ids, attention_mask, streamer, assistant_model=ctx.drafter, speculation_type="dflash"
    )
