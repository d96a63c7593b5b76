"""Does speculative sampling draw from the target's distribution? A two-sample check at scale.

Rows sampled by a speculative sampler (the drafter through ``generate``, through the engine) are compared
with rows sampled by plain ``generate`` on the same prompts: the first token's distribution and the
n-gram frequencies of the first tokens of each row, each by total variation and by the chi-square
homogeneity statistic. Every threshold comes from a permutation test: the rows of both samplers are
pooled and relabelled at random *within each prompt* (rows are the exchangeable unit, so n-grams of one
row may depend on each other), which is exact under the null (both samplers draw the same distribution)
whatever the vocabulary or the sample size. A check passes when every statistic's permutation p-value is
at least ``alpha / number of statistics`` (Bonferroni: ``alpha`` is the check's family-wise level).

A check must be able to fail: `accepting_every_draft` is a deliberately biased sampler (drafts kept
without the rejection correction) and a temperature a little off is another; both are negative controls
(``examples/sampling_distribution_check.py``, ``tests/test_sampling_distribution.py``).

Example:
    >>> plain = [[[5, 1, 2], [5, 2, 2]]]        # one prompt, two rows
    >>> spec = [[[5, 1, 2], [5, 2, 2]]]
    >>> two_sample_check(plain, spec, CheckSettings(permutations=999)).passed
    True
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field
from typing import Sequence

import torch

Rows = Sequence[Sequence[int]]  # one prompt's sampled continuations (EOS included, nothing after it)


@dataclass(frozen=True)
class SamplingSettings:
    """How rows are sampled: ``temperature`` > 0, ``top_p`` in (0, 1], ``top_k`` (0: off), new tokens per row."""

    temperature: float = 1.0
    top_p: float = 0.95
    top_k: int = 0
    max_new_tokens: int = 8

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 for a sampling check, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0 or self.max_new_tokens < 1:
            raise ValueError(f"top_k must be >= 0 and max_new_tokens >= 1, got {self.top_k!r}, {self.max_new_tokens!r}")


@dataclass(frozen=True)
class CheckSettings:
    """The test: n-gram ``orders`` over the first ``max_new_tokens`` of each row (order 1 is the first
    token alone, its distribution at position 0; orders >= 2 pool every n-gram of the row), ``permutations``
    of the labels, family-wise level ``alpha``, the permutations' ``seed``, and ``chunk`` permutations
    computed at once (memory: ``chunk x distinct n-grams`` floats)."""

    orders: tuple[int, ...] = (1, 2, 3)
    permutations: int = 2000
    alpha: float = 0.01
    seed: int = 0
    chunk: int = 256

    def __post_init__(self):
        if not self.orders or any(n < 1 for n in self.orders):
            raise ValueError(f"orders must be n-gram sizes >= 1, got {self.orders!r}")
        if not 0 < self.alpha < 1:
            raise ValueError(f"alpha must be in (0, 1), got {self.alpha!r}")
        tests = 2 * len(self.orders)
        if (self.permutations + 1) * self.alpha / tests < 1:  # the smallest p-value must be able to fall under
            need = int(tests / self.alpha)
            raise ValueError(f"{self.permutations} permutations cannot reach p < alpha / {tests} = {self.alpha / tests:.2g}: "
                             f"use at least {need}")


@dataclass
class StatTest:
    """One statistic of a check: observed value, the permutation threshold at the check's per-test level, p-value."""

    name: str  # "tv" or "chi2"
    order: int
    observed: float
    threshold: float
    p_value: float
    passed: bool


@dataclass
class CheckResult:
    """A check's statistics; ``passed`` when every one passed. ``rows`` per sampler, ``level`` per test."""

    label: str
    rows: tuple[int, int]
    level: float
    tests: list[StatTest] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(t.passed for t in self.tests)

    def to_dict(self) -> dict:
        return dict(label=self.label, rows=list(self.rows), level=self.level, passed=self.passed,
                    tests=[asdict(t) for t in self.tests])  # fmt: skip


def _gram_label(order: int) -> str:
    return "first token" if order == 1 else f"{order}-grams"


def markdown_table(results: Sequence[CheckResult]) -> list[str]:
    """Lines of a markdown table: one row per (check, statistic).

    Example:
        >>> print("\\n".join(markdown_table([])))  # doctest: +NORMALIZE_WHITESPACE
        | check | rows (reference / sampler) | statistic | observed | threshold | p | result |
        |---|---|---|---|---|---|---|
    """
    lines = ["| check | rows (reference / sampler) | statistic | observed | threshold | p | result |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        for t in r.tests:
            lines.append(f"| {r.label} | {r.rows[0]} / {r.rows[1]} | {t.name} of {_gram_label(t.order)} | {t.observed:.4g} | "
                         f"{t.threshold:.4g} | {t.p_value:.2g} | {'pass' if t.passed else '**FAIL**'} |")  # fmt: skip
    return lines


# ----------------------------------------------------------------------------- statistics
def _occurrences(rows: list[list[int]], order: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(row index, n-gram id) of every counted n-gram, and the number of distinct n-grams. Order 1 counts
    each row's first token; higher orders every n-gram inside the row."""
    ids: dict[tuple, int] = {}
    occ_row, occ_gram = [], []
    for r, row in enumerate(rows):
        grams = [tuple(row[:1])] if order == 1 else [tuple(row[i : i + order]) for i in range(len(row) - order + 1)]
        for g in grams:
            occ_row.append(r)
            occ_gram.append(ids.setdefault(g, len(ids)))
    return torch.tensor(occ_row, dtype=torch.long), torch.tensor(occ_gram, dtype=torch.long), len(ids)


def _count_matrix(rows: list[list[int]], order: int, device) -> torch.Tensor:
    """Sparse ``[distinct n-grams, rows]`` counts of one order, on `device`."""
    occ_row, occ_gram, k = _occurrences(rows, order)
    if k == 0:
        raise ValueError(f"no {order}-grams: rows are shorter than {order} tokens")
    ones = torch.ones(len(occ_row), dtype=torch.float64)
    return torch.sparse_coo_tensor(torch.stack([occ_gram, occ_row]), ones, (k, len(rows)), check_invariants=True).coalesce().to(device)


def _statistics(counts: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """TV and chi-square homogeneity of groups ``labels == 1`` / ``== 0`` for every label column.

    ``counts``: sparse ``[K, R]`` n-gram counts per row; ``labels``: ``[R, P]`` 0/1 float. Returns two ``[P]``."""
    a = torch.sparse.mm(counts, labels)  # [K, P] n-gram counts of group A under each labelling
    total = torch.sparse.sum(counts, dim=1).to_dense()[:, None]  # [K, 1]
    b = total - a
    na, nb = a.sum(0), b.sum(0)
    tv = 0.5 * (a / na.clamp_min(1) - b / nb.clamp_min(1)).abs().sum(0)
    ea = total * (na / (na + nb))
    eb = total - ea
    chi2 = ((a - ea) ** 2 / ea.clamp_min(1e-12) + (b - eb) ** 2 / eb.clamp_min(1e-12)).sum(0)
    return tv, chi2


def _permuted_labels(labels: torch.Tensor, strata: torch.Tensor, count: int, gen: torch.Generator) -> torch.Tensor:
    """``[R, count]`` relabellings of ``labels`` shuffled within each stratum (rows are laid out stratum by stratum)."""
    noise = torch.rand(count, labels.shape[0], generator=gen, dtype=torch.float64).to(labels.device)  # CPU stream: reproducible
    keys = strata[None, :].double() + noise
    order = keys.argsort(dim=1)  # strata are contiguous: each row draws a label from its own stratum
    return labels[order].T.contiguous()


def two_sample_check(reference: Sequence[Rows], sampler: Sequence[Rows], settings: CheckSettings | None = None,
                     label: str = "sampler vs reference", device: str | torch.device = "cpu") -> CheckResult:
    """Permutation test that ``sampler``'s rows follow the same distribution as ``reference``'s, prompt by prompt.

    ``reference[s]`` / ``sampler[s]``: the rows sampled for prompt ``s`` (token ids, EOS included); the
    permutations shuffle the labels within each prompt. See the module docstring for the statistics.

    Example:
        >>> r = two_sample_check([[[1, 2], [1, 3]]], [[[1, 2], [1, 3]]], CheckSettings(orders=(1,), permutations=999))
        >>> r.passed, [t.name for t in r.tests]
        (True, ['tv', 'chi2'])
    """
    settings = settings or CheckSettings()
    if len(reference) != len(sampler) or not reference:
        raise ValueError(f"need the same prompts on both sides, got {len(reference)} and {len(sampler)}")
    rows, labels, strata = [], [], []
    for s, (ref, got) in enumerate(zip(reference, sampler)):
        if not ref or not got or any(len(r) == 0 for r in [*ref, *got]):
            raise ValueError(f"prompt {s}: every prompt needs rows on both sides, each with a token at least")
        rows += [list(r) for r in ref] + [list(r) for r in got]
        labels += [0.0] * len(ref) + [1.0] * len(got)
        strata += [s] * (len(ref) + len(got))
    labels_t, strata_t = torch.tensor(labels, dtype=torch.float64), torch.tensor(strata)
    tests = 2 * len(settings.orders)
    level = settings.alpha / tests
    result = CheckResult(label, (int((labels_t == 0).sum()), int(labels_t.sum())), level)
    counts = [_count_matrix(rows, order, device) for order in settings.orders]
    labels_d = labels_t.to(device)
    observed = [[s.item() for s in _statistics(c, labels_d[:, None])] for c in counts]
    null = [([], []) for _ in counts]
    gen = torch.Generator().manual_seed(settings.seed)
    for start in range(0, settings.permutations, settings.chunk):  # one relabelling serves every order
        perm = _permuted_labels(labels_d, strata_t.to(device), min(settings.chunk, settings.permutations - start), gen)
        for c, acc in zip(counts, null):
            for a, s in zip(acc, _statistics(c, perm)):
                a.append(s.cpu())
    for order, obs_pair, acc in zip(settings.orders, observed, null):
        for name, obs, perm in zip(("tv", "chi2"), obs_pair, acc):
            perm = torch.cat(perm)
            p = (1 + int((perm >= obs * (1 - 1e-12)).sum())) / (settings.permutations + 1)
            threshold = float(torch.quantile(perm, 1 - level))
            result.tests.append(StatTest(name, order, obs, threshold, p, p >= level))
    return result


# ----------------------------------------------------------------------------- samplers
def _trim(row: list[int], eos_ids: set[int]) -> list[int]:
    for j, t in enumerate(row):
        if t in eos_ids:
            return row[: j + 1]
    return row


def _eos_ids(target) -> set[int]:
    eos = target.generation_config.eos_token_id
    return set(eos if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos]))


def generate_rows(target, prompt: list[int], n: int, sampling: SamplingSettings, seed: int, batch: int = 512,
                  drafter=None, length_policy: str = "fixed") -> list[list[int]]:
    """``n`` rows sampled by ``target.generate`` on one prompt: plain sampling, or speculative with
    ``drafter`` (``assistant_model=drafter``); ``torch.manual_seed(seed + chunk index)`` before each chunk.

    Example:
        >>> rows = generate_rows(target, [5, 6, 7], 100, SamplingSettings(), seed=0)  # doctest: +SKIP
    """
    eos = _eos_ids(target)
    pad = target.generation_config.pad_token_id
    extra = {} if drafter is None else dict(assistant_model=drafter, length_policy=length_policy)
    out: list[list[int]] = []
    ids = torch.tensor([prompt], device=target.device)
    for i, start in enumerate(range(0, n, batch)):
        b = min(batch, n - start)
        torch.manual_seed(seed + i)
        with torch.inference_mode():
            seq = target.generate(ids.expand(b, -1), attention_mask=torch.ones_like(ids).expand(b, -1), do_sample=True,
                                  temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                                  max_new_tokens=sampling.max_new_tokens, pad_token_id=0 if pad is None else pad, **extra)  # fmt: skip
        out += [_trim(r, eos) for r in seq[:, len(prompt) :].tolist()]
    return out


def engine_rows(engine, prompt: list[int], n: int, sampling: SamplingSettings, seed: int, seeded: bool) -> list[list[int]]:
    """``n`` rows sampled by a serving `Engine` on one prompt. ``seeded``: request ``i`` carries seed ``seed + i``
    (the engine's position-keyed samples); else the requests draw from the engine's one stream, reseeded from the
    global generator (``torch.manual_seed(seed)`` first): the rejection-sampling path.

    Example:
        >>> rows = engine_rows(Engine(target, drafter), [5, 6, 7], 100, SamplingParams(), 0, seeded=False)  # doctest: +SKIP
    """
    eos = _eos_ids(engine.target)
    torch.manual_seed(seed)
    outs = engine.generate([prompt] * n, sampling.max_new_tokens, temperature=sampling.temperature, top_k=sampling.top_k or None,
                           top_p=sampling.top_p, seed=seed if seeded else None, eos_token_id=tuple(eos) or None)  # fmt: skip
    return [_trim(list(o.token_ids), eos) for o in outs]


@contextlib.contextmanager
def accepting_every_draft():
    """A deliberately biased sampler (negative control): while inside, speculative sampling keeps every
    draft without the rejection correction, so drafted tokens follow the drafter, not the target. It replaces
    `speculation.verify`'s ``speculative_accept``, the one acceptance step of ``generate`` and the engine alike.

    Example:
        >>> with accepting_every_draft():  # doctest: +SKIP
        ...     rows = generate_rows(target, prompt, 500, SamplingSettings(), 0, drafter=drafter)
    """
    from ..speculation import verify
    from ..speculation.acceptance import AcceptResult

    real = verify.speculative_accept

    def accept_all(draft_tokens, draft_probs, target_probs, draft_len=None, generator=None):
        b, k = draft_tokens.shape
        keep = torch.full((b,), k, dtype=torch.long, device=target_probs.device) if draft_len is None else draft_len.to(target_probs.device)
        after = target_probs[torch.arange(b, device=target_probs.device), keep].float()
        return AcceptResult(num_accepted=keep.clone(), next_tokens=torch.multinomial(after, 1, generator=generator).squeeze(1))

    verify.speculative_accept = accept_all
    try:
        yield
    finally:
        verify.speculative_accept = real
