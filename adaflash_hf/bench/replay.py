"""Acceptance replay: the engine's real cost under a known acceptance trace.

Random weights accept nothing, so speculative throughput of a large target is measured by replay:
the target and the drafter run every forward and kernel of every round, but each request's drafted
tokens are made to agree with the target's own greedy continuation (precomputed by plain decoding)
for exactly the number of positions a trace says, followed by a token that is certainly wrong. The
target's real verification then accepts ``min(L, k_hat - 1)`` drafts (``L`` the trace's accepted count
of that round, ``k_hat`` the verify length), and the output still equals plain greedy decoding.
The length head's decision is replayed from the same trace: the head's predicted ratio of the trace's
round replaces the live head's, so the engine verifies what the recorded head would have verified.

Results measured this way are *replay*, never a model's result: they say what the engine costs under
that acceptance, not what any drafter achieves.

Traces:

- :class:`PerPositionTrace`: the probability that draft slot ``j`` is accepted, per slot (e.g. the
  paper's DFlash on Qwen3-8B, :func:`paper_dflash_trace`); the head's ratio is the oracle
  ``(L + 1) / B`` or, given a recorded trace, a recorded head's ratio for a round of the same ``L``;
- :class:`RecordedTrace`: rounds a real pair ran in ``fixed`` mode (whole block verified, so the
  accepted counts are not cut by a verify length), each with its length head's ratio
  (:meth:`RecordedTrace.record`).

Every trace carries the :class:`ReplayPolicy` its ratios are meant for (the recording drafter's length
policy, rate, minimum and block size; a shipped head calibrated for rate 2.0 replayed at rate 1.0 would
verify half of what it verifies in use). :meth:`ReplayPolicy.apply` sets it on the replaying engine.

Example:
    >>> from adaflash_hf.engine import Engine, EngineConfig
    >>> refs = {tuple(p): Engine(target).generate([p], 64)[0].token_ids
    ...         for p in prompts}  # doctest: +SKIP
    >>> trace = paper_dflash_trace()
    >>> replay = DraftReplay(refs, trace)  # doctest: +SKIP
    >>> engine = Engine(target, drafter, EngineConfig(length_policy="adaptive", draft_replay=replay))  # doctest: +SKIP
    >>> trace.policy.apply(engine)  # doctest: +SKIP
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, replace

import torch

from ..engine.graphs import to_device
from ..speculation.rounds import mean_tokens_per_round

__all__ = ["DraftReplay", "PerPositionTrace", "RecordedTrace", "ReplayPolicy", "TraceRound", "paper_dflash_trace"]

# The paper's DFlash acceptance per draft slot on Qwen3-8B is given at its ends only (slot 1 0.89,
# slot 15 0.13). A geometric fall between them gives tau 7.06, the paper's own mean acceptance
# length (7.09); a linear one would give 8.65.
PAPER_DFLASH_ENDS = (0.89, 0.13)


@dataclass(frozen=True)
class TraceRound:
    """One round of a trace: drafts the target accepts when the whole block is verified, and the
    length head's predicted acceptance ratio for that block."""

    accepted: int
    ratio: float


@dataclass(frozen=True)
class ReplayPolicy:
    """The verify-length settings a trace's head ratios are meant for: the policy the recording drafter runs
    by default (``length_policy``, a :data:`adaflash_hf.speculation.length.names.POLICY_NAMES` name), its length rate and
    minimum, and its block size (a ratio is a fraction of it).

    Example:
        >>> ReplayPolicy("adaptive", length_rate=2.0, length_min=1, block_size=16).length_rate
        2.0
    """

    length_policy: str
    length_rate: float
    length_min: int
    block_size: int

    def __post_init__(self):
        from ..speculation.length.names import POLICY_NAMES

        if self.length_policy not in POLICY_NAMES:
            raise ValueError(f"unknown length_policy {self.length_policy!r}: choose one of {', '.join(POLICY_NAMES)}")
        if not (math.isfinite(self.length_rate) and self.length_rate > 0):
            raise ValueError(f"length_rate must be a finite number > 0, got {self.length_rate}")
        if self.block_size < 2 or not 1 <= self.length_min <= self.block_size:
            raise ValueError(f"need block_size >= 2 and 1 <= length_min <= block_size, got {self.block_size}, "
                             f"{self.length_min}")

    @classmethod
    def from_drafter(cls, drafter) -> "ReplayPolicy":
        """What ``drafter`` runs when no policy is asked for (its config's default policy, rate and minimum)."""
        from ..speculation.length.names import default_policy

        cfg = drafter.config
        return cls(default_policy(cfg).value, float(getattr(cfg, "length_rate", 1.0)), int(getattr(cfg, "length_min", 1)),
                   int(cfg.block_size))

    @classmethod
    def oracle(cls, block_size: int) -> "ReplayPolicy":
        """The settings of an oracle head's ratio ``(L + 1) / B``: rate 1.0 verifies exactly ``L + 1``."""
        return cls("adaptive", 1.0, 1, block_size)

    def apply(self, engine) -> None:
        """Make ``engine`` (a replaying :class:`adaflash_hf.engine.Engine`) verify as this policy's drafter would:
        its length rate and minimum. Raises ``ValueError`` when the engine's block size differs (the ratios
        would mean other lengths)."""
        if engine.drafter is None:
            return  # plain decoding verifies nothing
        if engine.block_size != self.block_size:
            raise ValueError(f"the trace was recorded at block size {self.block_size}, the engine drafts "
                             f"{engine.block_size}: its head ratios would mean other verify lengths")
        engine.planner.settings = replace(engine.planner.settings, rate=self.length_rate, min_len=self.length_min)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "ReplayPolicy":
        missing = [k for k in ("length_policy", "length_rate", "length_min", "block_size") if k not in data]
        if missing:
            raise ValueError(f"a trace's policy needs {', '.join(missing)} (the recording drafter's settings)")
        return cls(str(data["length_policy"]), float(data["length_rate"]), int(data["length_min"]), int(data["block_size"]))


class RecordedTrace:
    """Rounds recorded from a real drafter / target pair: each round's accepted drafts (whole block
    verified) and its length head's ratio, with the :class:`ReplayPolicy` of the drafter that recorded them.
    ``draw`` picks a recorded round at random; ``stream`` replays one request's rounds in the order its recorded
    requests had them (``sequences``: how many consecutive rounds of ``rounds`` each recorded request holds), so a
    replayed request keeps what a real one has: an acceptance level of its own, which the engine's guess before
    drafting (each request's rounds' mean acceptance, shrunk toward the traffic's) relies on. Random draws keep none
    of it (the worst case for that guess).

    Example:
        >>> t = RecordedTrace([TraceRound(3, 0.25), TraceRound(0, 0.1)], ReplayPolicy("adaptive", 2.0, 1, 16), "demo")
        >>> t.tau, t.policy.length_rate
        (2.5, 2.0)
    """

    def __init__(self, rounds: list[TraceRound], policy: ReplayPolicy, name: str = "recorded",
                 sequences: list[int] | None = None):
        if not rounds:
            raise ValueError("a recorded trace needs at least one round")
        if not isinstance(policy, ReplayPolicy):
            raise ValueError(f"a recorded trace needs the ReplayPolicy of its drafter, got {policy!r}")
        if any(not 0 <= r.accepted < policy.block_size for r in rounds):
            raise ValueError(f"accepted counts must lie in [0, block_size - 1 = {policy.block_size - 1}]")
        if sequences is not None and (sum(sequences) != len(rounds) or any(n < 1 for n in sequences)):
            raise ValueError(f"sequences must be positive run lengths adding up to the {len(rounds)} rounds, "
                             f"got {sequences}")
        self.rounds, self.policy, self.name = list(rounds), policy, name
        self.sequences = None if sequences is None else [int(n) for n in sequences]
        self._by_accepted: dict[int, list[float]] = {}
        for r in self.rounds:
            self._by_accepted.setdefault(r.accepted, []).append(r.ratio)

    @property
    def tau(self) -> float:
        """Tokens per round when every block is verified whole (accepted drafts + the target's own)."""
        return mean_tokens_per_round([r.accepted for r in self.rounds])

    def draw(self, rng: random.Random, block_size: int) -> TraceRound:
        r = self.rounds[rng.randrange(len(self.rounds))]
        return TraceRound(min(r.accepted, block_size - 1), r.ratio)

    def stream(self, rng: random.Random, block_size: int):
        """One replayed request's rounds: a recorded request's, in order, from its first, then another's when it
        runs out (random draws for a trace recorded without ``sequences``)."""
        if self.sequences is None:
            while True:
                yield self.draw(rng, block_size)
        starts = [0]
        for n in self.sequences:
            starts.append(starts[-1] + n)
        while True:
            i = rng.randrange(len(self.sequences))
            for r in self.rounds[starts[i]: starts[i + 1]]:
                yield TraceRound(min(r.accepted, block_size - 1), r.ratio)

    def ratio_for(self, accepted: int, rng: random.Random) -> float:
        """A recorded head's ratio for a round that accepted ``accepted`` drafts (the nearest count
        recorded when none accepted exactly that many)."""
        near = min(self._by_accepted, key=lambda a: (abs(a - accepted), a))
        ratios = self._by_accepted[near]
        return ratios[rng.randrange(len(ratios))]

    def to_json(self) -> dict:
        out = {"name": self.name, "policy": self.policy.to_json(), "rounds": [[r.accepted, r.ratio] for r in self.rounds]}
        return out if self.sequences is None else {**out, "sequences": self.sequences}

    @classmethod
    def from_json(cls, data: dict) -> "RecordedTrace":
        """The trace :meth:`to_json` wrote; raises ``ValueError`` without its ``policy`` (a trace saved before
        traces carried one: its ratios' rate is unknown)."""
        if "policy" not in data:
            raise ValueError("the trace has no 'policy' (the recording drafter's length policy, rate, minimum and "
                             "block size): record it again")
        return cls([TraceRound(int(a), float(q)) for a, q in data["rounds"]], ReplayPolicy.from_json(data["policy"]),
                   data.get("name", "recorded"), data.get("sequences"))

    @classmethod
    def record(cls, target, drafter, prompts: list[list[int]], max_new_tokens: int, name: str = "recorded",
               eos_token_id=None, **engine_kwargs) -> "RecordedTrace":
        """Run ``prompts`` greedily through the engine in ``fixed`` mode and keep every verified round
        (its accepted drafts and the length head's ratio; the drafter needs a length head), each request's rounds
        together and in order (``sequences``)."""
        from ..engine import Engine, EngineConfig

        if getattr(drafter, "length_head", None) is None:
            raise ValueError("recording a trace needs a drafter with a length head (its ratios are replayed)")
        by_request: dict[int, list[TraceRound]] = {}

        def keep(v):
            if v.verify_len == drafter.config.block_size:  # a block cut by max_new_tokens says less
                by_request.setdefault(v.row, []).append(TraceRound(v.num_accepted, float(v.predicted_ratio)))

        engine_kwargs.setdefault("max_len", max(len(p) for p in prompts) + max_new_tokens + 8)
        Engine(target, drafter, EngineConfig(length_policy="fixed", round_sink=keep, **engine_kwargs)).generate(
            prompts, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)
        runs = [by_request[k] for k in sorted(by_request)]
        return cls([r for run in runs for r in run], ReplayPolicy.from_drafter(drafter), name, [len(run) for run in runs])


class PerPositionTrace:
    """Rounds drawn from per-slot acceptance: ``probs[j - 1]`` is the probability that draft slot ``j`` is
    accepted (non-increasing in ``j``). One uniform ``u`` per round gives ``L = #{j: probs[j-1] > u}``,
    so ``P(L >= j) = probs[j - 1]`` exactly.

    The head's ratio: the oracle ``(L + 1) / B`` (``ratio_from=None``: the verify length is exactly what
    is accepted, an upper bound for any head), or a ratio a recorded head gave for a round of the same
    ``L`` (``ratio_from``: a :class:`RecordedTrace`). ``policy``: the oracle's (rate 1.0, over the ``block_size``
    given to ``paper_dflash_trace``, else ``len(probs) + 1``) or ``ratio_from``'s.

    Example:
        >>> PerPositionTrace([1.0, 0.5, 0.0]).tau
        2.5
    """

    def __init__(self, probs: list[float], ratio_from: RecordedTrace | None = None, name: str = "per-position",
                 block_size: int | None = None):
        probs = [float(p) for p in probs]
        if not probs or any(not 0.0 <= p <= 1.0 for p in probs):
            raise ValueError(f"per-slot acceptance must be probabilities in [0, 1], got {probs}")
        if any(b > a for a, b in zip(probs, probs[1:])):
            raise ValueError(f"per-slot acceptance must not increase with the slot, got {probs}")
        if ratio_from is not None and block_size is not None and block_size != ratio_from.policy.block_size:
            raise ValueError(f"ratios recorded at block size {ratio_from.policy.block_size} cannot stand for a "
                             f"head at block size {block_size}")
        self.probs, self.ratio_from, self.name = probs, ratio_from, name
        self.policy = ratio_from.policy if ratio_from is not None else ReplayPolicy.oracle(block_size or len(probs) + 1)

    @property
    def tau(self) -> float:
        return 1.0 + sum(self.probs)

    def stream(self, rng: random.Random, block_size: int):
        """One replayed request's rounds: independent draws (per-slot acceptance has no order)."""
        while True:
            yield self.draw(rng, block_size)

    def draw(self, rng: random.Random, block_size: int) -> TraceRound:
        u = rng.random()
        accepted = min(sum(p > u for p in self.probs), block_size - 1)
        ratio = (accepted + 1) / block_size if self.ratio_from is None else self.ratio_from.ratio_for(accepted, rng)
        return TraceRound(accepted, ratio)


def paper_dflash_trace(block_size: int = 16, ratio_from: RecordedTrace | None = None) -> PerPositionTrace:
    """The paper's DFlash per-slot acceptance on Qwen3-8B, 0.89 at slot 1 falling geometrically to 0.13
    at slot 15 (only the ends are published; see ``PAPER_DFLASH_ENDS``), over ``block_size - 1`` slots."""
    first, last = PAPER_DFLASH_ENDS
    n = block_size - 1
    step = (last / first) ** (1.0 / max(n - 1, 1))
    name = "paper DFlash per-slot" + (f" (ratios from {ratio_from.name})" if ratio_from is not None else " (oracle head)")
    return PerPositionTrace([first * step**j for j in range(n)], ratio_from, name, block_size)


class DraftReplay:
    """Makes the engine's drafts and length-head ratios follow a trace (``EngineConfig(draft_replay=...)``: a
    :class:`~adaflash_hf.engine.round_drafts.DraftSource`).

    ``references[tuple(prompt)]``: the plain greedy continuation of each prompt (at least as long as its
    ``max_new_tokens``). Per request and round the next round of the request's ``trace.stream`` (seeded by the
    prompt's place among ``references``, so that every engine, run and mode given the same prompts replays the same
    rounds: engines reused across runs number their requests on, and a stream seeded by request id would give two modes
    compared at one concurrency different recorded requests); :meth:`ratios` replaces the
    head's ratios, :meth:`drafts` the drafted tokens. ``planned[(request id, round)]`` keeps each draw
    (``round``: the request's verify rounds so far), which a check compares with what was accepted.
    Greedy requests only: under sampling the target's accepted tokens are not the precomputed ones.
    ``trace`` may be swapped between runs.
    """

    def __init__(self, references: dict[tuple, list[int]], trace, seed: int = 0):
        self.references, self.trace, self.seed = references, trace, seed
        self.own_drafts = False  # the trace's drafts: prompt n-grams and the chained body stay off
        self.planned: dict[tuple[int, int], TraceRound] = {}
        self._streams: dict[int, object] = {}  # per request id: its trace stream
        self._streams_of = trace
        self._refs: dict[int, list[int]] = {}  # per request id: its prompt's reference (hashing a prompt per round costs)
        self._place = {prompt: i for i, prompt in enumerate(references)}  # seeds each prompt's stream

    def _round(self, r, block_size: int) -> TraceRound:
        key = (r.id, len(r.accepted))
        plan = self.planned.get(key)
        if plan is None:
            if not r.params.greedy:
                raise ValueError("acceptance replay runs greedy requests only")
            if self._streams_of is not self.trace:  # swapped between runs: its streams start afresh
                self._streams, self._streams_of = {}, self.trace
            stream = self._streams.get(r.id)
            if stream is None:
                place = self._place.get(tuple(r.prompt), len(self._place) + r.id)
                stream = self._streams[r.id] = self.trace.stream(random.Random(self.seed * 1_000_003 + place), block_size)
            plan = self.planned[key] = next(stream)
        return plan

    def ratios(self, running, ratio: torch.Tensor, block_size: int) -> torch.Tensor:
        """The trace's head ratio of this round for each running request (on ``ratio``'s device)."""
        values = [self._round(r, block_size).ratio for r in running]
        # Through pinned memory: a copy from pageable memory makes CUDA wait for the stream first, a read that
        # `fixed` (which never asks for ratios) would not pay.
        return to_device(torch.tensor(values, dtype=torch.float32), ratio.device)

    def drafts(self, running, draft: torch.Tensor, block_size: int) -> torch.Tensor:
        """The drafts ``[n, B-1]`` on ``draft``'s device: each request's greedy continuation for the round's
        accepted count, then a token other than the continuation's, zeros after."""
        # The harness's own host work, charged to every round it replays: one list pass and one copy, no
        # per-request tensor ops.
        rows = [[0] * (block_size - 1) for _ in running]
        for row, r in zip(rows, running):
            ref = self._refs.get(r.id)
            if ref is None:
                ref = self._refs[r.id] = self.references.get(tuple(r.prompt))
                if ref is None:
                    raise KeyError(f"no reference continuation for request {r.id}'s prompt")
            cont = ref[len(r.tokens): len(r.tokens) + block_size - 1]
            good = min(self._round(r, block_size).accepted, len(cont))
            row[:good] = cont[:good]
            if good < min(len(cont), block_size - 1):
                t = cont[good]
                row[good] = t - 1 if t > 0 else t + 1
        return to_device(torch.tensor(rows, dtype=torch.long).view(len(running), block_size - 1), draft.device)

    def followed(self, outputs) -> tuple[int, int]:
        """``(rounds that accepted what the trace planned, rounds checked)`` over ``outputs``: a round
        accepts ``min(L, verify_len - 1)`` drafts when replay holds."""
        ok = total = 0
        for o in outputs:
            for t, (a, v) in enumerate(zip(o.accepted, o.verify_lengths)):
                plan = self.planned.get((o.request_id, t))
                if plan is not None:
                    total += 1
                    ok += int(a == min(plan.accepted, v - 1))
        return ok, total
