"""``generate(assistant_model=drafter)`` through the engine: fused layers, slot caches, CUDA graphs.

:func:`~.decoding.adaflash_decoding` runs every round through the HF modules with a dynamic cache. On
CUDA the same call is sent here instead (``fast_path="auto"``, the default): each row becomes one
request of an :class:`~adaflash_hf.engine.Engine` built once per target, drafter and length policy (and
rebuilt larger when a call does not fit it). What generate prepared is kept: the stopping criteria
(``max_length`` and EOS become the engine's own limits; stop strings and any other criterion are checked
token by token, and a row stops exactly where plain decoding would), temperature / top-k / top-p
sampling, the streamer, ``return_dict_in_generate``, ``return_stats`` and the round sink (rounds carry
the batch row, as the eager loop's do).

What the engine cannot do (per-token scores, logits or hidden states, another logits processor, the
``expected_gain`` policy, a pre-filled cache, ``inputs_embeds``, layers the engine cannot drive as they are: adapters,
hooks, another architecture) goes to the eager loop with one warning naming the reason
(:func:`fast_path_refusal`). Off CUDA ``"auto"`` keeps the eager loop without a warning (the documented
default); ``fast_path=True`` takes the engine there too (eager kernels: the CPU tests' route),
``False`` never does.

Sampled calls take the engine too, at any number of rows: it samples every request of a round at once
(:mod:`adaflash_hf.engine.sampled_rows`).

Engines are kept in a small module-level cache (the last :data:`MAX_ENGINES`), never on the target.

Example:
    >>> out = target.generate(ids, assistant_model=drafter, max_new_tokens=64)  # doctest: +SKIP
    >>> out = target.generate(ids, assistant_model=drafter, fast_path=False)  # the eager loop  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import threading
import time
import warnings
import weakref
from collections import OrderedDict

import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

from ..speculation.hooks import round_callbacks
from ..speculation.length import LengthPolicy, LengthSettings
from ..speculation.prompt_ngrams import PromptNgrams

__all__ = ["FAST_PATH_CHOICES", "MAX_ENGINES", "clear_engines", "engine_decoding", "fast_path_refusal", "takes_engine", "warmup"]

FAST_PATH_CHOICES = ("auto", True, False)
MAX_ENGINES = 2  # engines kept alive (each holds its KV caches and graphs)
MAX_BUDGET = 16384  # tokens per forward at most: a larger batch of long prompts prefills over several rounds
_ENGINES: "OrderedDict[tuple, _Cached]" = OrderedDict()
_LOCK = threading.Lock()


@dataclasses.dataclass
class _Cached:
    target: weakref.ref
    drafter: weakref.ref
    engine: object
    lock: threading.Lock


def clear_engines() -> None:
    """Drop every cached engine (their caches and graphs are freed with them)."""
    with _LOCK:
        _ENGINES.clear()


def _sampling(logits_processor) -> tuple[dict, str | None]:
    """The engine's ``SamplingParams`` fields for generate's processors, or why they have none."""
    fields, order = {}, {TemperatureLogitsWarper: 0, TopKLogitsWarper: 1, TopPLogitsWarper: 2}
    last = -1
    for p in logits_processor or []:
        rank = order.get(type(p))
        if rank is None or rank <= last:
            return {}, f"logits processor {type(p).__name__}" if rank is None else "logits warpers in another order"
        last = rank
        if isinstance(p, TemperatureLogitsWarper):
            fields["temperature"] = float(p.temperature)
        elif isinstance(p, TopKLogitsWarper):
            fields["top_k"] = int(p.top_k)
        elif p.min_tokens_to_keep != 1:
            return {}, "top_p with min_tokens_to_keep > 1"
        else:
            fields["top_p"] = float(p.top_p)
    return fields, None



def fast_path_refusal(model, drafter, generation_config, logits_processor, model_kwargs, length=None) -> str | None:
    """Why this generate call cannot run through the engine (``None``: it can); ``length``: the call's
    :class:`~adaflash_hf.speculation.length.names.LengthSettings` (or a policy name)."""
    from ..engine.kernels.stock_layers import unsupported_layers
    from ..engine.target import check_target_supported

    cfg = generation_config
    for flag in ("output_scores", "output_logits", "output_hidden_states"):
        if getattr(cfg, flag, False) and (flag == "output_hidden_states" or cfg.return_dict_in_generate):
            return f"{flag}=True (the engine returns tokens only)"
    _, why = _sampling(logits_processor)
    if why is not None:
        return why
    if LengthSettings.of(length).resolved(drafter).policy is LengthPolicy.EXPECTED_GAIN:
        return "length_policy='expected_gain'"
    cache = model_kwargs.get("past_key_values")
    if cache is not None and cache.get_seq_length():
        return "a pre-filled past_key_values"
    if model_kwargs.get("inputs_embeds") is not None:
        return "inputs_embeds (the engine prefills token ids)"
    try:
        check_target_supported(model)
    except ValueError as exc:
        return str(exc)
    return unsupported_layers(model)


def takes_engine(fast_path, model, drafter, generation_config, logits_processor, model_kwargs, length=None) -> bool:
    """Whether :func:`~.decoding.adaflash_decoding` should run this call on the engine (see the
    module docstring); a call the engine cannot take warns once, naming the reason."""
    if not (isinstance(fast_path, bool) or fast_path == "auto"):
        raise ValueError(f"fast_path must be 'auto', True or False, got {fast_path!r}")
    if fast_path is False or (fast_path == "auto" and next(model.parameters()).device.type != "cuda"):
        return False
    why = fast_path_refusal(model, drafter, generation_config, logits_processor, model_kwargs, length)
    if why is not None:
        warnings.warn(f"generate(assistant_model=<AdaFlash drafter>) runs the eager loop, not the engine: {why}",
                      RuntimeWarning, stacklevel=4)
        return False
    return True


def _token_budget(prompt_lens: list[int], block: int, width: int | None = None) -> int:
    """Tokens one engine forward may take: every row's prompt and a block per row (a verify of ``width + 1`` under the
    prompt n-gram rule's ``max_width``, if wider), up to ``MAX_BUDGET``.
    A generate call is one batch: a budget of one prompt would admit its rows one prefill at a time
    (each prefill fills the forward, and the admission EMA then holds the others back for rounds)."""
    q = max(block, (width or 0) + 1)
    return min(sum(prompt_lens) + len(prompt_lens) * q, max(MAX_BUDGET, max(prompt_lens) + q))


def _engine_for(model, drafter, length: LengthSettings, rows: int, max_len: int, budget: int,
                width: int | None = None, spec_rounds: int = 1) -> _Cached:
    """The cached engine for these models and verify-length settings (resolved) if it fits the call, else a new one
    (replacing it); ``width``: the prompt n-gram rule's ``max_width`` the engine must take (its graphs' widest verify);
    ``spec_rounds``: its :class:`~adaflash_hf.engine.EngineConfig`'s."""
    from ..engine import Engine, EngineConfig

    def pow2(n: int, floor: int) -> int:
        return max(floor, 1 << max(0, n - 1).bit_length())

    p = next(model.parameters())
    key = (id(model), id(drafter), length, p.device, p.dtype, width, spec_rounds)
    with _LOCK:
        hit = _ENGINES.get(key)
        if hit is not None and (hit.target() is not model or hit.drafter() is not drafter):
            hit = None  # ids reused by new objects
        if hit is not None:
            e = hit.engine
            if e.max_slots >= rows and e.max_len >= max_len and e.token_budget >= budget and e.healthy:
                _ENGINES.move_to_end(key)
                return hit
        with torch.inference_mode(False):  # see engine_decoding: the engine is reused outside this call's mode
            config = EngineConfig(length_policy=length, max_slots=pow2(rows, 1), max_len=pow2(max_len, 256),
                                  token_budget=pow2(budget, 64), cuda_graphs=True,  # off CUDA: the same static bucket forwards, eagerly
                                  prompt_ngrams=PromptNgrams(max_width=width), spec_rounds=spec_rounds)
            engine = Engine(model, drafter, config)
        if hit is not None:  # a bigger engine for the same pair: it keeps what the traffic's rounds accepted (a fresh
            # one guesses each request's next round from its last head ratio, which says little: on Spec-Bench
            # summarization's test prompts at batch 1 the 3 calls that made one cost the set 0.32 of its tau)
            engine.planner.traffic_seen = hit.engine.planner.traffic_seen
        hit = _ENGINES[key] = _Cached(weakref.ref(model), weakref.ref(drafter), engine, threading.Lock())
        while len(_ENGINES) > MAX_ENGINES:
            _ENGINES.popitem(last=False)
        return hit


def warmup(target, drafter, batch_size: int = 1, prompt_len: int = 512, max_new_tokens: int = 128,
           length_policy: str | None = None, length_rate=None, length_min=None, prompt_ngrams=None,
           spec_rounds: int = 1) -> float:
    """Build (or find) the engine that ``generate(assistant_model=drafter)`` will use for batches of up to
    ``batch_size`` prompts of ``prompt_len`` tokens and capture the graphs it needs
    (:meth:`~adaflash_hf.engine.Engine.warmup`); returns the seconds it took. ``prompt_ngrams``, ``spec_rounds``:
    the call's, as generate takes them (``max_width`` sets the widest verify).

    Example:
        >>> warmup(target, drafter, batch_size=1, prompt_len=512, max_new_tokens=128)  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    length = LengthSettings.of(length_policy, length_rate=length_rate, length_min=length_min).resolved(drafter)
    block = drafter.config.block_size
    if not drafter.is_bound_to(target):
        drafter.bind_target(target)
    width = _wide(PromptNgrams.of(prompt_ngrams), do_sample=False)
    cached = _engine_for(target, drafter, length, batch_size, prompt_len + max_new_tokens + block,
                         _token_budget([prompt_len] * batch_size, block, width), width, spec_rounds)
    with cached.lock, torch.inference_mode(False), torch.no_grad():
        cached.engine.warmup(concurrency=min(batch_size, cached.engine.max_slots), prompt_lens=[prompt_len])
    return time.perf_counter() - t0


def _wide(ngrams: PromptNgrams, do_sample: bool) -> int | None:
    """The ``max_width`` an engine needs for calls with ``ngrams`` (sampled rows never widen)."""
    return ngrams.max_width if ngrams.applies(greedy=not do_sample) else None


def _split_criteria(stopping_criteria):
    """``(max_length or None, eos ids, the other criteria)``: the first two the engine applies itself."""
    max_length, eos, rest = None, [], StoppingCriteriaList()
    for c in stopping_criteria or []:
        if isinstance(c, MaxLengthCriteria):
            max_length = c.max_length if max_length is None else min(max_length, c.max_length)
        elif isinstance(c, EosTokenCriteria):
            eos += [int(t) for t in c.eos_token_id.flatten().tolist()]
        else:
            rest.append(c)
    return max_length, tuple(eos), rest


def engine_decoding(model, drafter, input_ids, logits_processor, stopping_criteria, generation_config, streamer, *,
                    length=None, return_stats=False, round_sink=None, prompt_ngrams=None, spec_rounds=1, **model_kwargs):
    """The body of :func:`~.decoding.adaflash_decoding` on the engine (after :func:`fast_path_refusal` said
    it can): same arguments (``length``: the verify-length settings), same return value."""
    from ..engine import SamplingParams
    from .output import Output, emit_requests, finish
    from .stats import GenerationStats

    mask = model_kwargs.get("attention_mask")
    width = input_ids.shape[1]
    prompts = [row[m.bool()].tolist() if mask is not None else row.tolist()
               for row, m in zip(input_ids, mask if mask is not None else input_ids)]
    max_length, eos, rest = _split_criteria(stopping_criteria)
    max_new = (max_length if max_length is not None else generation_config.max_length) - width
    fields, _ = _sampling(logits_processor)
    if generation_config.do_sample:
        fields.setdefault("temperature", 1.0)  # sampling with no temperature warper is temperature 1, not greedy
    length = LengthSettings.of(length).resolved(drafter)
    block = drafter.config.block_size
    ngrams = PromptNgrams.of(prompt_ngrams)
    width = _wide(ngrams, generation_config.do_sample)
    cached = _engine_for(model, drafter, length, len(prompts), max(map(len, prompts)) + max_new + block,
                         _token_budget(list(map(len, prompts)), block, width), width, spec_rounds)
    engine = cached.engine
    stats = GenerationStats(block_size=block, policy=length.policy.value)
    output = Output.for_config(generation_config, stopping_criteria, streamer)
    on_round, on_request = round_callbacks(round_sink, drafter)
    # The cached engine outlives this call: its caches and lazily made buffers must be normal tensors even
    # when generate runs under torch.inference_mode (in-place updates of inference tensors fail outside it).
    with cached.lock, torch.inference_mode(False), torch.no_grad():
        saved = engine.on_round, engine.on_request, engine.prompt_ngrams
        engine.prompt_ngrams, used_before, wide_before = ngrams, int(engine.ngram_used), engine.wide_rounds
        row_of: dict[int, int] = {}
        engine.on_round = None if on_round is None else (lambda r: on_round(dataclasses.replace(r, row=row_of[r.row])))
        engine.on_request = None
        try:
            handles = []
            for i, prompt in enumerate(prompts):
                seed = int(torch.randint(0, 2**62, (1,))) if fields.get("temperature") else None  # the global RNG, as generate
                params = SamplingParams(seed=seed, eos_token_id=eos or None, **fields)
                holder: list = []
                handle = engine.submit(prompt, max_new, params,
                                       on_token=_token_sink(input_ids[i].tolist(), rest, streamer, holder))
                holder.append(handle)
                row_of[handle.request_id] = i
                handles.append(handle)
            outs = [h.result() for h in handles]
        except BaseException:
            for h in handles:  # nothing of a failed or interrupted call stays queued in the cached engine
                h.cancel()
            raise
        finally:
            stats.ngram_rounds = int(engine.ngram_used) - used_before
            stats.wide_rounds = engine.wide_rounds - wide_before
            engine.on_round, engine.on_request, engine.prompt_ngrams = saved
    for i, o in enumerate(outs):
        if o.finish_reason == "error":
            raise RuntimeError(f"row {i} failed in the engine: {o.error}")
        output.finished[i] = torch.cat([input_ids[i], torch.tensor(o.token_ids, dtype=input_ids.dtype, device=input_ids.device)])
        for a, v in zip(o.accepted, o.verify_lengths):
            stats.record(i, v, a)
    # draft_time_s / verify_time_s stay 0: splitting an engine round needs device syncs (EngineConfig(profile=True))
    if streamer is not None:
        streamer.end()
    if on_request is not None:
        emit_requests(on_request, input_ids, mask, output)
    return finish(input_ids, output, generation_config, stats, return_stats)


def _token_sink(seq: list[int], criteria, streamer, handle: list):
    """The engine's per-token callback for one row: stream the token, and end the request right after it
    when a stopping criterion the engine does not apply itself says so (``handle[0]``: the row's request);
    ``None`` if there is nothing to do per token."""
    if not len(criteria) and streamer is None:
        return None
    seq = list(seq)

    def on_token(tok: int) -> None:
        seq.append(tok)
        if streamer is not None:
            streamer.put(torch.tensor([tok]))
        if len(criteria) and bool(criteria(torch.tensor([seq]), None)[0]):
            handle[0].cancel()  # inside a round: the request ends after this token, as plain decoding stops

    return on_token
