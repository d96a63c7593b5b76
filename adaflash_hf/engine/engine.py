"""A continuous-batching speculative decoding engine for HF Qwen3 / Llama targets.

One :meth:`Engine.step` is one round for every running request:

1. draft: one drafter forward over all running requests (per-slot drafter context cache), the
   verify lengths ``k_hat_i`` from the length head, as the engine's
   :class:`~adaflash_hf.speculation.length.planner.LengthPlanner` plans them: under ``cost`` chosen together
   against the round's cost (:class:`~adaflash_hf.speculation.length.cost.RoundCost`), under ``adaptive`` the paper's
   floor rule at a fixed rate (``load_scaled_rate`` on request); a round the planner makes plain decodes as ``off``
   does (:mod:`.decode_steps`);
2. admit: queued requests whose prompt fits what is left of the token budget, up to the EMA estimate of how many fit
   (:class:`AdmissionController`, :meth:`.lifecycle.Lifecycle.admit`);
3. one packed target forward over the new prompts (prefill) and every running request's bonus + drafts (verify),
   through the slotted KV cache (:class:`~.target.RoundForward`);
4. accept (greedy or speculative sampling on processed distributions; a request's penalties and grammar change its
   rows first: :mod:`.processed_rows`, :mod:`.grammar`), commit token by token (:mod:`.lifecycle`).

What a round verifies (:func:`round_layout`, from ``length_policy`` as in ``generate``): ``packed``
(``adaptive``: each request its own ``k_hat_i``; ``sum_i k_hat_i`` tokens), ``rectangular``
(``adaptive, rectangular=True``: every request padded to the round's largest ``k_hat``: the cost of a
padded ``[b, max k_hat]`` batch, tokens past a request's own ``k_hat`` are computed but never accepted),
``fixed`` (full block, DFlash) and ``off`` (no drafter: plain decoding, one token per request per step).
The round never sends more than ``token_budget`` tokens: if the drafts do not fit, the longest
verify lengths are trimmed (a shorter verify is always lossless).

On CUDA the decode forward of step 3 (every verify round, every ``off`` step) is a CUDA graph per
(tokens, tokens-per-request) bucket with split-KV attention over the slotted cache (Triton;
flex_attention without it; :class:`~.graphs.DecodeGraphs`); prefill of newly admitted requests stays an eager packed forward
next to it. The drafter step of 1 is one static forward for all running requests too
(:class:`~.drafter.DraftGraphs`, CUDA graphs per bucket). A round reads the device back at most
twice: the verify lengths (length head; not in ``fixed``), then, after the target, accepted counts, next
tokens and the drafts together: the drafts reach the target's input on the device
(:mod:`.round_drafts`). A verify-only round of greedy requests whose rows nothing else reads (no penalty, grammar,
logprobs or round sink) accepts inside the target's replay too (:meth:`.DecodeGraphs.run`'s ``accept``), and the read
is one slice of its output buffer. The drafter's LM head runs only for the draft positions some request verifies: not at
all when every ``k_hat`` is 1 or every request has one token left (the round is then plain
decoding); when the rate alone caps every ``k_hat`` at 1 the drafter layers are skipped
too and only the new context is stored. ``cuda_graphs=False`` keeps the all-eager reference path (SDPA, any shapes).
"""

from __future__ import annotations

import itertools
import warnings
from typing import Callable

import torch

from ..speculation.hooks import hooks_for, round_callbacks
from ..speculation.length import LengthPlanner, LengthPolicy, LengthSettings, RoundCost, round_layout
from ..speculation.prompt_ngrams import PromptNgrams
from ..speculation.rounds import VerifiedRound
from ..speculation.verify import accept_block
from .admission import AdmissionController, fit_token_budget
from .config import EngineConfig
from .decode_steps import PlainDecoder
from .kernels.attention import BLOCK
from .drafter import DraftGraphs, append_context, draft_blocks, head_index, make_drafter_cache
from .round_drafts import OWN_DRAFTS, RoundDrafts, late_bits, take_late_ratios, unpack_drafts, unpack_read
from .kernels.fused import FusedTarget
from .graphs import DecodeGraphs
from .lifecycle import NON_FINITE, Lifecycle
from .grammar import constrain_round
from .processed_rows import penalize_round, round_logprobs
from .requests import EngineOutput, Request, RequestHandle, RequestRejected, StepInfo, check_request
from .round_ngrams import PROBE_LAG, apply_prompt_ngrams, round_candidates, wide_capacity
from .sampled_rows import RoundRandom, sample_drafts, sample_round
from .sampling import SamplingParams
from .spec_rounds import SpecRounds, raw_greedy
from .stats import EngineStats, PhaseTimer
from .target import PackedLayout, RoundForward, check_target_supported, leading_rows, make_target_cache

__all__ = ["Engine", "EngineConfig", "EngineOutput", "RequestHandle", "RequestRejected", "StepInfo"]


def _part(part: str, name: str) -> property:
    """The engine's attribute ``name`` as its part ``part``'s (read and set there)."""
    return property(lambda self: getattr(getattr(self, part), name),
                    lambda self, value: setattr(getattr(self, part), name, value),
                    doc=f"``{part}.{name}``")


class Engine:
    """Continuous-batching speculative decoding over a slotted KV cache, built from one :class:`.config.EngineConfig`.

    Args:
        target: a Qwen3 / Llama ``*ForCausalLM`` (eval mode).
        drafter: an :class:`AdaFlashDrafter` bound to ``target``; ``None``: plain decoding.
        config: the settings (:class:`.config.EngineConfig`; default: every default).
        **overrides: settings by name on top of ``config`` (``Engine(t, d, max_slots=8)`` is
            ``Engine(t, d, EngineConfig.of(None, max_slots=8))``: the same config, built the one way).

    Its parts, each built alone from what it is handed: the :attr:`planner` (verify lengths), the :attr:`lifecycle`
    (queue, running requests, commit / finish / fail / cancel), :attr:`forward` (the round's target forward,
    :class:`~.target.RoundForward`), :attr:`plain` (queued plain greedy steps,
    :mod:`.decode_steps`), the caches and graphs, the counters (:attr:`stats`) and the phase timer profiling switches
    (:attr:`timer`); a :class:`.round_drafts.DraftSource` (``draft_replay``) may stand in for the drafter's ratios and
    drafts. :meth:`_step` is the round that composes them.

    Faults (:mod:`.lifecycle`): a request whose callback raises or whose distribution is not finite ends
    alone with ``finish_reason="error"``; a failed round fails the requests in flight and sets
    :attr:`healthy` to False (:attr:`last_error` says why). ``step()`` itself does not raise for either.

    Example:
        >>> config = EngineConfig(length_policy="adaptive", max_slots=8, max_len=256)
        >>> engine = Engine(target, drafter, config)  # doctest: +SKIP
        >>> [o.token_ids for o in engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=16)]  # doctest: +SKIP
        >>> plain = Engine(target, None, config, length_policy=None, max_slots=4)  # doctest: +SKIP
    """

    def __init__(self, target, drafter=None, config: EngineConfig | None = None, **overrides):
        self.config = config = EngineConfig.of(config, **overrides)
        settings = config.length_settings
        layout = round_layout(drafter, settings.policy, config.rectangular)
        if drafter is None and settings.given:
            raise ValueError(f"{', '.join(settings.given)} need a drafter (without one the engine decodes plainly)")
        settings = settings.resolved(drafter) if drafter is not None else LengthSettings(LengthPolicy.FIXED, 1.0, 1)
        round_cost = config.round_cost
        self.block_size = drafter.config.block_size if drafter is not None else 1
        self.planner = LengthPlanner(settings, self.block_size, round_cost if isinstance(round_cost, RoundCost) else None,
                                     layout)
        check_target_supported(target)
        if drafter is not None:
            drafter.check_target(target)
            if not drafter.is_bound_to(target):
                drafter.bind_target(target)
        self.target, self.drafter, self.layout = target, drafter, layout
        self.max_slots, self.max_len, self.token_budget = config.max_slots, config.max_len, config.token_budget
        self.draft_source = config.draft_replay if config.draft_replay is not None else OWN_DRAFTS
        self.prompt_ngrams = PromptNgrams.of(config.prompt_ngrams)
        self.device = next(target.parameters()).device
        self.random = RoundRandom(self.device)  # unseeded sampled requests' draws (sampled_rows)
        self.stats = EngineStats()
        self.timer = PhaseTimer(self.device, config.profile)
        # The widest verify a request sends: the block, or a prompt n-gram candidate under `max_width` (fixed here:
        # the graphs' buckets follow it), within one tile of the decode attention kernel.
        self.max_q = max(self.block_size, wide_capacity(self.prompt_ngrams, target) + 1) if drafter is not None else self.block_size
        self.hidden_layers = list(drafter.config.target_layer_ids) if drafter is not None else None
        self.cuda_graphs = self.device.type == "cuda" if config.cuda_graphs is None else bool(config.cuda_graphs)
        # several plain steps per read: `off`, and the cost policy's plain stretches (both need the graphs' static path)
        self.decode_steps = self.planner.plain_steps = (  # a plain round the planner chooses runs in such a stretch
            config.decode_steps if self.cuda_graphs and (layout == "off" or self.policy is LengthPolicy.COST) else 1)
        self.fused, self.fusion_note = FusedTarget.build(target) if config.fused_kernels else (None, "fused_kernels=False")
        if config.fused_kernels and self.fused is None:  # asked for and refused: never silently at half speed
            warnings.warn(f"Engine: fused kernels off, the target's layers run through its modules: {self.fusion_note}",
                          RuntimeWarning, stacklevel=2)
        self._build_caches(config.max_slots, config.max_len, config.token_budget)
        per_req = {"off": 1.0, "fixed": float(self.block_size)}.get(layout, max(1.0, self.block_size * settings.rate / 2))
        self.admission = AdmissionController(config.max_slots, config.max_len, config.token_budget, per_req,
                                             beta=config.ema_beta)
        # Verified rounds and finished requests go to `round_sink`, else to the drafter's registered hooks.
        self.on_round, on_request = round_callbacks(config.round_sink, drafter) if drafter is not None else (None, None)
        self.step_hook, self.lifecycle = config.step_hook, Lifecycle(self.cache, self.dcache, on_request)
        self._queue, self._running = self.lifecycle.queue, self.lifecycle.running  # the lifecycle's, read every round
        # a plain stretch's host indexes prompt n-grams until its replays end (decode_steps): CUDA only
        self._ngram_event = (torch.cuda.Event() if self.device.type == "cuda" and self.cuda_graphs and drafter is not None
                             and self.prompt_ngrams.enabled and config.draft_replay is None else None)
        self.plain = PlainDecoder(self.graphs, self.cache, self.lifecycle, self.stats, self.timer, drafter, self.draft_graphs,
                                  self.prompt_ngrams if self._ngram_event is not None else None, self._ngram_event)
        if config.spec_rounds > 1 and layout != "fixed":
            raise ValueError(f"spec_rounds={config.spec_rounds} queues fixed rounds: length_policy='fixed' (this "
                             f"engine's rounds are {layout!r})")
        self.spec = (SpecRounds(self.graphs, self.cache, self.draft_graphs, drafter, self.lifecycle, self.stats, self.planner,
                                config.spec_rounds)  # CUDA graphs' static path, the drafter's own drafts
                     if config.spec_rounds > 1 and self.draft_graphs is not None and self.draft_source.own_drafts else None)
        self._ids = itertools.count()
        self._graph_accept = False  # this round accepts inside the target's replay (_accepts_in_graph)
        if round_cost is None or isinstance(round_cost, str):  # "measured", or the default: cost_cache says
            from .cost_cache import measure_if_asked

            measure_if_asked(self, round_cost)

    # What the parts count and hold, shown as the engine's own attributes (benchmarks, tests, the server's health).
    num_steps = _part("stats", "num_steps")
    forward_tokens = _part("stats", "forward_tokens")
    skipped_drafts = _part("stats", "skipped_drafts")
    host_syncs = _part("stats", "host_syncs")
    whole_rounds = _part("stats", "whole_rounds")
    wide_rounds = _part("stats", "wide_rounds")
    ngram_used = _part("stats", "ngram_used")  # request-rounds that verified a prompt n-gram candidate (device)
    phase_seconds = _part("timer", "seconds")  # with profile on: draft / target / accept / host
    profiled_steps = _part("timer", "steps")
    profile = _part("timer", "enabled")  # settable: time each step's phases from the next step on
    on_request = _part("lifecycle", "on_request")
    healthy = _part("lifecycle", "healthy")  # False after a round failed as a whole (sticky: restart the engine)
    last_error = _part("lifecycle", "last_error")  # that failure, "ExceptionType: message"
    failure = _part("lifecycle", "failure")  # that failure's exception (an AsyncEngine re-raises it)

    @property
    def policy(self) -> LengthPolicy | None:
        """The verify-length policy (``None``: no drafter, plain decoding)."""
        return self.planner.policy if self.drafter is not None else None

    @property
    def round_cost(self) -> RoundCost:
        """What the ``cost`` policy weighs (the planner's; settable, e.g. to :func:`~.warmup.measure_round_cost`'s)."""
        return self.planner.round_cost

    @round_cost.setter
    def round_cost(self, value: RoundCost) -> None:
        self.planner.round_cost = value

    def _build_caches(self, max_slots: int, max_len: int, token_budget: int) -> None:
        """The target's and the drafter's KV caches, and their CUDA graphs where ``cuda_graphs`` is on."""
        if self.cuda_graphs:  # one spare slot row takes the bucket padding; slots are whole flex blocks
            self.cache = make_target_cache(self.target, max_slots, max_len, spare_slots=1, len_multiple=BLOCK)
            self.graphs = DecodeGraphs(self.target, self.cache, self.hidden_layers,
                                       max_tokens=min(token_budget, max_slots * self.max_q), max_q=self.max_q,
                                       use_graphs=self.device.type == "cuda", fused=self.fused,
                                       max_steps=self.decode_steps,
                                       kept_tokens=token_budget)
        else:
            self.cache, self.graphs = make_target_cache(self.target, max_slots, max_len), None
        self.dcache, self.draft_graphs = None, None
        if self.drafter is not None and self.cuda_graphs:
            self.dcache = make_drafter_cache(self.drafter, max_slots, max_len, spare_slots=1, len_multiple=BLOCK)
            self.draft_graphs = DraftGraphs(self.drafter, self.dcache, max_rows=max_slots, max_ctx=token_budget, max_q=self.max_q,
                                            use_graphs=self.device.type == "cuda",
                                            feat_dtype=next(self.target.parameters()).dtype, fused=self.fused)
            if self.graphs is not None:
                self.draft_graphs.chain_source = self.graphs.hidden  # a round's features, for the chained body
            if self.fused is not None and self.draft_graphs.fused is None:  # the target fuses, the drafter cannot
                warnings.warn(f"Engine: the drafter's layers run through its modules: {self.draft_graphs.fusion_note}",
                              RuntimeWarning, stacklevel=3)
        elif self.drafter is not None:
            self.dcache = make_drafter_cache(self.drafter, max_slots, max_len)
        self.forward = RoundForward(self.target, self.cache, self.graphs, self.hidden_layers, self.fused, self.device)

    # ------------------------------------------------------------------ API
    def submit(self, prompt_ids, max_new_tokens: int, sampling: SamplingParams | None = None,
               on_token: Callable[[int], None] | None = None, **sampling_kwargs) -> RequestHandle:
        """Queue a request; raises :class:`RequestRejected` if it can never fit."""
        if self.fused is not None:
            self.fused.check_current()
        if self.draft_graphs is not None:
            self.draft_graphs.check_current()
        prompt = [int(t) for t in (prompt_ids.tolist() if torch.is_tensor(prompt_ids) else prompt_ids)]
        params = sampling if sampling is not None else SamplingParams(**sampling_kwargs)
        check_request(prompt, max_new_tokens, self.max_len, self.token_budget,
                      self.target.get_input_embeddings().weight.shape[0])
        req = Request(next(self._ids), prompt, int(max_new_tokens), params, on_token)
        self._queue.append(req)
        return RequestHandle(self, req)

    def generate(self, prompts, max_new_tokens: int = 32, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int | None = None, eos_token_id=None) -> list[EngineOutput]:
        """Run ``prompts`` (lists of ids) to completion; outputs in prompt order."""
        handles = [self.submit(p, max_new_tokens, SamplingParams(temperature, top_k, top_p,
                                                                  None if seed is None else seed + i, eos_token_id))
                   for i, p in enumerate(prompts)]
        return [h.result() for h in handles]

    def warmup(self, concurrency: int = 1, prompt_lens=()) -> float:
        """Compile and capture now what rounds of up to ``concurrency`` running requests with prompts of
        ``prompt_lens`` tokens need (:mod:`.warmup`), so that the first requests do not pay for it. Needs
        an idle engine; returns the seconds it took. A no-op for graphs off CUDA.

        Example:
            >>> engine.warmup(concurrency=8, prompt_lens=[512])  # doctest: +SKIP
        """
        from .warmup import warmup

        return warmup(self, concurrency, prompt_lens)

    @property
    def wide_width(self) -> int | None:
        """The prompt n-gram rule's ``max_width`` as this engine runs it (``None``: off): at most its ``max_q - 1``."""
        w = self.prompt_ngrams.max_width
        return None if w is None or not self.prompt_ngrams.enabled else min(w, self.max_q - 1)

    def _cancel(self, req: Request) -> None:
        """What a :class:`RequestHandle`'s ``cancel()`` asks (:meth:`.lifecycle.Lifecycle.cancel`)."""
        self.lifecycle.cancel(req)

    num_running = property(lambda self: len(self._running))
    num_queued = property(lambda self: len(self._queue))

    @property
    def idle(self) -> bool:
        return not self._running and not self._queue

    def run_until_idle(self) -> None:
        while self.step():
            pass

    # ------------------------------------------------------------------ the round
    @torch.no_grad()
    def step(self) -> bool:
        """One round for every running request (and prefill for newly admitted ones); False: nothing to do."""
        lifecycle, timer = self.lifecycle, self.timer
        if lifecycle.in_step:
            raise RuntimeError("Engine.step is not reentrant (called from a callback?)")
        lifecycle.in_step = True
        try:
            timer.mark(None)
            try:
                did = self._step()
            except Exception as e:  # noqa: BLE001 - the round failed as a whole (forward, kernel, OOM)
                lifecycle.fail_round(e)
                did = True
            timer.end_step(did)
            return did
        finally:
            lifecycle.in_step = False
            lifecycle.reap()

    def _step(self) -> bool:
        self.lifecycle.reap()
        running = list(self._running)
        if not running and not self._queue:
            return False
        steps = self._greedy_steps(running)
        if steps:
            return self._plain_steps(running, steps)
        self.plain.forget()  # this round's body stores the features plain steps kept
        rounds = self.spec.rounds_for(running, self.on_round is not None) if self.spec is not None else 0
        if rounds > 1:  # fixed rounds queued behind one read (spec_rounds)
            for _ in range(rounds):
                self._announce(len(running) * self.block_size, 0, len(running))
            self.spec.run(running, rounds)
            return True
        stats, mark = self.stats, self.timer.mark

        # 1. Draft and choose verify lengths (the adaptive policy reads them back); the drafts stay on the device.
        drafts = self._draft(running)
        # 2. Admission: the EMA fit, then the hard limits (free slot, budget left).
        admitted = self._admit(running, sum(drafts.q_lens))
        if not running and not admitted:
            return False  # unreachable while submit rejects what never fits; kept as a guard

        # 3. The target: prefill segments, then verify segments (bonus + drafts, copied in on the device), one forward.
        segs = [(r.slot, r.prompt) for r in admitted] + [(r.slot, [r.bonus] + [0] * (q - 1)) for r, q in zip(running, drafts.q_lens)]
        layout = PackedLayout.from_cache(self.cache, [s for s, _ in segs], [len(t) for _, t in segs])
        self._announce(layout.num_tokens, len(admitted), len(running))
        verify_inputs = drafts.verify_inputs([r.params.greedy for r in running], len(admitted), self.device)
        self._graph_accept = self._accepts_in_graph(admitted, running, drafts)
        mark("host")
        logits, hidden = self.forward(segs, layout, len(admitted), verify_inputs, accept=self._graph_accept)
        drafted = verify_inputs[1] if verify_inputs is not None else None
        penalize_round(logits, len(admitted), running, drafts.q_lens, drafted)  # before anything reads the rows
        constrain_round(logits, admitted, running, drafts.q_lens, drafted)
        stats.forward_tokens.append(layout.num_tokens)
        stats.num_steps += 1
        mark("target")

        # 4. Accept on the device (the shared verify step; greedy decode-only rounds: inside the target's replay), then
        # the round's one read.
        read, vlogits, scored = self._accept_and_read(logits, layout, admitted, running, drafts, verify_inputs)
        stats.host_syncs += 1
        mark("accept")

        # 5. Commit: prefills' first tokens, then each verify's accepted drafts + the target's next token.
        self._commit_round(admitted, running, drafts, read, vlogits, hidden, layout.offsets, scored)
        return True

    def _greedy_steps(self, running) -> int:
        """Plain greedy steps before the next read (0: a normal round), until the longest request ends or a slot fills."""
        if self.graphs is None or not running or self._queue or not raw_greedy(running):
            return 0
        most = min(self.decode_steps, self.cache.max_len - max(self.cache.length(r.slot) for r in running))
        if self.drafter is not None:
            return self.planner.plain_stretch(running, most, sink=self.on_round is not None)
        return min(most, max(r.remaining for r in running))

    def _plain_steps(self, running, steps: int) -> bool:
        """``steps`` plain greedy steps of ``running`` behind one read (:class:`.decode_steps.PlainDecoder`)."""
        n = len(running)
        self._announce(n, 0, n)
        self.admission.observe(1.0, sum(len(r.prompt) + r.max_new for r in running) / n)
        self.plain.run(running, steps)
        return True

    def _accept_and_read(self, logits, layout: PackedLayout, admitted, running, drafts: RoundDrafts, verify_inputs):
        """Accept on the device, then the round's one read (first tokens, accepted, next tokens, fault flags, verified
        draft lengths, drafts: :meth:`_commit_round`'s ``read``), the verify logits a round sink is given (else
        ``None``) and the logprobs of the requests that asked (:class:`.processed_rows.RoundLogprobs`, unread; ``None``)."""
        if self._graph_accept:
            verdict, bins = self.graphs.verdict_rows(layout.num_tokens), self.graphs.requests
            bits = late_bits(drafts)
            host = self._read_and_chain(torch.cat([verdict, *bits]) if bits else verdict, running, admitted, drafts,
                                        verdict[: len(running)], verdict[bins : bins + len(running)])
            host = take_late_ratios(self.planner, running, drafts, host)
            return ([], [], *self.graphs.read_verdict(host, drafts.q_lens)), None, None
        drafted = verify_inputs[1] if verify_inputs is not None else None
        first, accepted, next_tokens, bad, dl, vlogits = self._accept(logits, admitted, running, drafts, verify_inputs)
        scored = round_logprobs(logits, admitted, running, drafts.q_lens, drafted, first, accepted, next_tokens)
        packed = torch.cat([first, accepted, next_tokens, bad.long(), dl, drafts.tokens.flatten(), *late_bits(drafts)])
        packed = take_late_ratios(self.planner, running, drafts, self._read_and_chain(packed, running, admitted, drafts,
                                                                                     accepted, next_tokens))
        read = unpack_read(packed, len(admitted), len(running), drafts.tokens.shape[1])
        return read, vlogits, scored

    def _accepts_in_graph(self, admitted, running, drafts: RoundDrafts) -> bool:
        """Whether this round's acceptance runs inside the target's decode replay (:meth:`.DecodeGraphs.run`'s
        ``accept``): a verify-only round of greedy requests whose rows nothing changes or reads but the acceptance
        (no penalty, grammar or logprobs; no round sink)."""
        return (self.graphs is not None and not admitted and bool(running) and self.on_round is None
                and drafts.sampled is None
                and raw_greedy(running))

    def _read_and_chain(self, packed: torch.Tensor, running, admitted, drafts: RoundDrafts, accepted, next_tokens) -> list[int]:
        """The round's one device read. When the round verified drafts (any layout) and admitted nothing, the next
        round's drafter body is queued first, behind the copy (:meth:`.DraftGraphs.run_chain`): the device drafts while
        the host waits for the copy and commits, and the next round takes that body if it drafts for the same requests.
        A round of bonus tokens only chains nothing: under ``cost`` the next round is likely plain too (no body)."""
        if not (self.draft_graphs is not None and self.draft_graphs.chain_source is not None and self.layout != "off"
                and running and not admitted and self.on_round is None and self.draft_source.own_drafts
                and max(drafts.q_lens) > 1):
            return packed.tolist()
        copied = None
        if packed.is_cuda:  # a pinned, non-blocking copy: the host waits for it alone, not for the body behind it
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        with hooks_for(self.drafter).weights_lock:
            self.draft_graphs.run_chain([r.slot for r in running], accepted, next_tokens, drafts.q_lens)
        if copied is None:
            return packed.tolist()
        copied.synchronize()
        return host.tolist()

    def _announce(self, num_tokens: int, num_prefill: int, num_verify: int) -> None:
        """Tell ``step_hook`` what the next target forward carries (never more than the token budget)."""
        if self.step_hook is not None:
            self.step_hook(StepInfo(num_tokens, self.token_budget, num_prefill, num_verify,
                                    self.max_slots - self.cache.num_free, self.max_slots, self.admission.n_hat))
        assert num_tokens <= self.token_budget

    def _commit_round(self, admitted, running, drafts: RoundDrafts, read: tuple, vlogits, hidden, offs, scored) -> None:
        """Advance the target cache over what was accepted, hand the new features to the drafter, emit each verified
        round, commit tokens; fail (alone) each request whose fault flag is set. ``read``: host lists of the prefills'
        first tokens and fault flags, then the verifies' accepted counts, next tokens, fault flags, verified draft
        lengths and drafts (a list per request); ``scored``: the asking requests' logprobs (id -> rows), or ``None``."""
        first, bad_first, accepted, next_tokens, bad, dl, rows = read
        scored = scored.read() if scored is not None else {}
        commit, fail, advance, observe = self.lifecycle.commit, self.lifecycle.fail, self.cache.advance, self.planner.observe
        base = len(admitted)
        ctx = None if hidden is None else leading_rows(  # the drafter's context: prompts, accepted rows + bonus
            hidden, offs, [offs[j + 1] - offs[j] for j in range(base)] + [a + 1 for a in accepted])
        for j, r in enumerate(admitted):  # the prompt's features become the drafter's first context
            if bad_first[j]:
                fail(r, NON_FINITE)
                continue
            advance(r.slot, len(r.prompt))
            if ctx is not None:
                r.pending_ctx = ctx[j]
            commit(r, [first[j]], logprobs=scored.get(r.id))
        for i, (r, a) in enumerate(zip(running, accepted)):
            if bad[i]:
                fail(r, NON_FINITE)
                continue
            if self.on_round is not None:
                self._emit_round(r, drafts, rows[i], vlogits, i, dl[i], a)
            advance(r.slot, a + 1)
            if ctx is not None:
                r.pending_ctx = ctx[base + i]
            emitted = commit(r, rows[i][:a] + [next_tokens[i]], verify_len=dl[i] + 1, logprobs=scored.get(r.id))
            if emitted:  # what the round says of the request's acceptance (a failed commit says nothing)
                observe(r, emitted - 1, dl[i] + 1)

    def _draft(self, running) -> RoundDrafts:
        """Drafts and verify lengths for ``running`` (trimmed to the token budget); sampled requests draw
        their drafts from their processed draft distributions, all at once (:func:`.sampled_rows.sample_drafts`)."""
        n = len(running)
        finite = draft_logits = offsets = ratio = None
        self._late = False  # set by _propose: this round's ratios come with its one read (a whole-block plan)
        if n and self.drafter is not None:
            draft, finite, draft_logits, offsets, ratio, draft_len = self._propose(running)
        else:
            draft = torch.zeros(n, max(self.block_size - 1, 0), dtype=torch.long, device=self.device)
            draft_len = torch.zeros(n, dtype=torch.long)
        self.timer.mark("draft")
        cands = None
        if n and self.drafter is not None and self.prompt_ngrams.enabled and self.on_round is None and self.draft_source.own_drafts:
            # a probe amid plain decoding (the last drafted ratios said plain) does not stall on indexing: the plain
            # stretches index while the device runs
            behind = PROBE_LAG if self._ngram_event is not None and self.planner.drafted_plain else None
            cands, lens = round_candidates(self.prompt_ngrams, running, draft_len.tolist(), self.wide_width, behind)
            wide = torch.tensor(lens)  # the verify lengths the candidates may take (the drafts' own without max_width)
        else:
            wide = draft_len
        caps = fit_token_budget(wide, self.token_budget, rectangular=self.layout == "rectangular")
        draft_len = torch.minimum(draft_len, caps)
        dl_host, caps = draft_len.tolist(), caps.tolist()
        q_lens = [max(caps) + 1] * n if self.layout == "rectangular" and n else [c + 1 for c in caps]
        self.stats.wide_rounds += int(n > 0 and max(q_lens) > self.block_size)
        drafts = RoundDrafts(draft, finite, draft_len, q_lens, draft_logits, offsets, ratio,
                             late_ratio=self._late and ratio is not None)
        drafts.sampled = sample_drafts(running, drafts, dl_host, self.random)
        if cands is not None:
            used = apply_prompt_ngrams(running, drafts, cands, self.wide_width, caps)
            if used is not None:
                self.stats.ngram_used = self.stats.ngram_used.to(used.device) + used
        return drafts

    def _admit(self, running, verify_tokens: int) -> list[Request]:
        """Queued requests that fit next to ``running`` this round: the EMA fit, then the hard limits."""
        n = len(running)
        if n:
            self.admission.observe(verify_tokens / n, sum(len(r.prompt) + r.max_new for r in running) / n)
        return self.lifecycle.admit(n, self.admission.limit, self.token_budget - verify_tokens)

    def _accept(self, logits, admitted, running, drafts: RoundDrafts, verify_inputs):
        """Prefill first tokens, accepted counts, next tokens and per-request fault flags (prefills, then
        verifies: a logit or processed distribution that is not finite) on the device, and the verify logits
        ``[n, kmax + 1, V]`` a round sink is given (else ``None``); also the draft lengths verified."""
        top = logits.argmax(dim=-1)  # [prefill + verify tokens]: greedy needs nothing else
        finite = torch.isfinite(logits).all(dim=-1)  # a NaN row fails its request, not the round
        na = len(admitted)
        first, bad = top[:na].clone(), ~finite[:na]
        if running:
            vidx, draft_dev, dl_dev, _ = verify_inputs
            bad = torch.cat([bad, ~finite[vidx].all(dim=-1)])
        sampled = sample_round(logits, admitted, running, drafts, self.random, first, bad)  # in place: first, bad
        if not running:
            return first, top.new_zeros(0), top.new_zeros(0), bad, top.new_zeros(0), None
        res = accept_block(draft_dev, dl_dev, top[vidx], [sampled] if sampled is not None else [])
        vlogits = logits[vidx].float() if self.on_round is not None else None
        return first, res.num_accepted, res.next_tokens, bad, dl_dev, vlogits

    def _propose(self, running):
        """One drafter forward for all running requests: drafts ``[n, B-1]`` and ``finite [n]`` (device), the
        drafted positions' raw logits packed ``[P, V]`` with each request's ``offsets``, ratios (device; finite,
        logits and offsets ``None`` when nothing is drafted), draft lengths ``[n]`` (host). The body runs first
        (the length head needs it), the verify lengths are read back, then the LM head runs on the positions each
        request verifies (the longest draft's width for all in the rectangular layout), and not at all when every
        ``k_hat`` is 1. When the planner's plan is plain (:meth:`.LengthPlanner.drafts`), the body is skipped too:
        context only. Sets ``_late`` when the round verifies whole blocks chosen before its ratios (read at its end)."""
        d, stats, source = self.drafter, self.stats, self.draft_source
        B = self.block_size
        n = len(running)
        sink = self.on_round is not None
        skip, late = not self.planner.drafts(running, sink), False  # the plan's first half; its second while the body runs
        slots, ctx = [r.slot for r in running], [r.pending_ctx for r in running]
        bonus = None if skip else [r.bonus for r in running]
        hidden = ratio = None
        with hooks_for(d).weights_lock:
            if self.draft_graphs is not None:
                ratio = self.draft_graphs.run_body(slots, ctx, bonus)
            elif skip:
                append_context(d, self.dcache, slots, ctx)
            else:
                hidden = draft_blocks(d, self.dcache, slots, torch.tensor(bonus, device=self.device), ctx)
                ratio = d.predict_accept_ratio(hidden).float() if d.length_head is not None else None
            for r in running:
                r.pending_ctx = None
            draft_len = torch.zeros(n, dtype=torch.long)
            if not skip:
                adaptive = self.layout != "fixed" and ratio is not None
                # whole blocks on the last ratios (this round's read with the round's one read), decided as the body runs
                self._late = late = adaptive and self.planner.whole_blocks(running, sink)
                remaining = torch.tensor([r.remaining for r in running])
                if adaptive:
                    ratio = source.ratios(running, ratio, B)
                k_hat = self.planner.lengths(running, ratio if adaptive and not late else None)  # read 1 when adaptive
                stats.host_syncs += int(adaptive and not late)
                stats.whole_rounds += int(late)
                draft_len = torch.minimum(k_hat - 1, remaining - 1).clamp(min=0)
            width = int(draft_len.max()) if n else 0
            if width == 0:  # nothing to verify: no draft logits (the LM head is most of a drafter step)
                stats.skipped_drafts += 1
                return torch.zeros(n, B - 1, dtype=torch.long, device=self.device), None, None, None, ratio, draft_len
            counts = [width] * n if self.layout == "rectangular" else draft_len.tolist()
            if self.draft_graphs is not None:
                out = self.draft_graphs.run_head(counts)
                tokens, logits, finite, offsets = out.tokens, out.logits, out.finite, out.offsets
            else:
                idx = head_index(counts, B).to(self.device)
                logits = d.compute_logits(hidden.reshape(n * B, -1)[idx]).float()
                finite = torch.isfinite(logits).all(dim=-1)
                tokens = torch.nan_to_num(logits).argmax(dim=-1)
                offsets = [0, *itertools.accumulate(counts)]
        draft, finite_rows = unpack_drafts(tokens, finite, counts, B - 1)  # on the device: nothing is read here
        return source.drafts(running, draft, B), finite_rows, logits, offsets, ratio, draft_len

    def _emit_round(self, r: Request, drafts: RoundDrafts, row: list[int], vlogits: torch.Tensor, i: int, draft_len: int,
                    accepted: int) -> None:
        ratio = drafts.ratio[i] if drafts.ratio is not None else None
        # copies: the drafter's static draft-logits buffer is reused next round
        self.on_round(VerifiedRound.from_block(r.id, torch.tensor(r.prompt + r.tokens[:-1]), r.bonus, torch.tensor(row),
                                               drafts.row_logits(i, vlogits), vlogits[i], draft_len, accepted, ratio))
