"""`run_bench`: every (dataset, concurrency, method) of a `BenchConfig`, plain first as the reference."""

from __future__ import annotations

import os
import sys
import traceback
from dataclasses import asdict, dataclass, field

import torch

from ..generation.prompts import encode_prompt, left_pad
from ..loading import load_models, resolve_device_dtype
from ..training import data as D
from .config import BASELINES, BenchConfig
from .environment import environment, hardware
from .measure import fill_computed, measure
from .methods import METHODS, BenchContext
from .multiturn import greedy_answers, turn_label, turn_prompts
from .prompt_lookup_grid import check_choice, read_choice
from .prompts import load_prompt_set
from .results import BenchCell, BenchResult
from .timing import run_batch


def log(config, msg):
    if config.verbose:
        print(msg, file=sys.stderr, flush=True)


def loud(msg):
    print(f"!!! BENCH FAILURE: {msg}", file=sys.stderr, flush=True)


def _generate_kwargs(config: BenchConfig, target, tokenizer) -> tuple[dict, int, set[int]]:
    """(the generate arguments every method shares, the pad id, the EOS ids)."""
    greedy = config.temperature <= 0
    gen = dict(max_new_tokens=config.max_new_tokens, do_sample=not greedy)
    if greedy:
        gen.update(temperature=None, top_p=None, top_k=None)
    else:
        gen.update(temperature=config.temperature, top_p=config.top_p, top_k=config.top_k)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    pad_id = 0 if pad_id is None else pad_id
    gen["pad_token_id"] = pad_id
    eos = target.generation_config.eos_token_id
    if eos is None and tokenizer.eos_token_id is not None:
        eos = tokenizer.eos_token_id
        gen["eos_token_id"] = eos
    eos_ids = set(eos if isinstance(eos, list) else ([] if eos is None else [eos]))
    return gen, pad_id, eos_ids


def _config_dict(config: BenchConfig, tokenizer) -> dict:
    """The config as ``bench.json`` records it: models by path or by type name."""
    models = ("target", "drafter", "tokenizer", "assistant")
    out = {k: v for k, v in asdict(config).items() if k not in models}
    for k in models:
        v = getattr(config, k)
        out[k] = str(v) if isinstance(v, (str, os.PathLike)) else (None if v is None else type(v).__name__)
    out["chat_template"] = bool(getattr(tokenizer, "chat_template", None))
    out["greedy"] = config.temperature <= 0
    return out


def _split_counts(name: str, data_dir) -> dict | None:
    """`split_counts` of a named set, so bench.json says what the slice left out; None when the set fell back
    to the built-in sample (not deduplicated, see `load_prompts`)."""
    from ..training.splits import split_counts

    try:
        return split_counts(name, data_dir)
    except D.HubUnavailable:
        return None


@dataclass
class _Run:
    """One run's shared state: what every cell of the grid needs."""

    config: BenchConfig
    ctx: BenchContext
    result: BenchResult
    pad_id: int
    eos_ids: set
    warm_pool: list = field(default_factory=list)
    warmed: set = field(default_factory=set)
    references: dict = field(default_factory=dict)  # label -> plain's greedy rows of its first concurrency (greedy runs)

    @property
    def on_cuda(self) -> bool:
        return self.ctx.device.type == "cuda"

    def reference_rows(self, prompts: list[list[int]], conc: int, layouts, greedy: bool) -> list[list[int]]:
        """Plain's rows, untimed, for a group that does not time plain: at ``reference_concurrency`` prompts a batch
        when set (greedy only: sampled rows depend on how the batch draws), else in the group's own batches."""
        size = self.config.reference_concurrency
        if greedy and size and size != conc:
            layouts = [left_pad(prompts[i : i + size], self.pad_id, self.ctx.device) for i in range(0, len(prompts), size)]
        rows: list[list[int]] = []
        for bi, (ids, mask) in enumerate(layouts):
            rows += run_batch(METHODS["plain"], self.ctx, ids, mask, self.eos_ids, self.config.seed + bi, self.on_cuda)[1]
        return rows

    def group(self, label: str, prompts: list[list[int]], conc: int, methods: list[str]) -> list[BenchCell]:
        """Every method on one (dataset, concurrency): the cells, speedups filled in."""
        config = self.config
        greedy = config.temperature <= 0
        batches = [list(range(i, min(i + conc, len(prompts)))) for i in range(0, len(prompts), conc)]
        layouts = [left_pad([prompts[j] for j in b], self.pad_id, self.ctx.device) for b in batches]
        # plain's rows: the correctness reference under greedy decoding, and what computed cells are computed from
        reference: list[list[int]] | None = None
        wants_rows = greedy or any(METHODS[n].from_plain is not None for n in methods)
        if wants_rows and "plain" not in methods:
            reference = self.reference_rows(prompts, conc, layouts, greedy)
        group: list[BenchCell] = []
        for name in methods:
            cell = BenchCell(method=name, dataset=label, concurrency=conc, num_prompts=len(prompts), num_batches=len(batches))
            group.append(cell)
            if METHODS[name].from_plain is not None:
                self.computed(METHODS[name], cell, prompts, reference)
                continue
            rows = self.cell(METHODS[name], cell, layouts)
            if rows is None:
                continue
            if name == "plain":
                reference = rows
            if name == "plain" and greedy:
                cell.identical = True
                cell.notes.append("reference for the correctness check")
            elif not greedy:
                cell.notes.append("sampling run: outputs are not compared token for token")
            elif reference is None:
                cell.notes.append("no plain reference (plain failed): not compared")
            else:
                compare(cell, rows, reference, self.result, self.ctx.target, prompts)
            log(config, _progress(cell))
        if greedy and reference is not None:
            self.references.setdefault(label, reference)
        _fill_speedups(group)
        cross_check(group, self.result)
        return group

    def computed(self, method, cell: BenchCell, prompts, reference) -> None:
        """A `Method.from_plain` cell: its figures from plain's rows of the same prompts, untimed."""
        reason = method.skip_reason(self.ctx, cell.concurrency)
        if reason is None and reference is None:
            reason = "no plain reference (plain failed): nothing to compute from"
        if reason is not None:
            cell.skipped, cell.skip_reason = True, reason
            log(self.config, f"[{cell.dataset} c={cell.concurrency}] {method.name}: skipped ({reason})")
            return
        try:
            out = method.from_plain(self.ctx, prompts, reference, self.config.max_new_tokens, self.eos_ids)
        except Exception as exc:  # reported like a method that raised; the other cells go on
            self.error(method, cell, exc)
            return
        fill_computed(cell, reference, out.stats)
        cell.settings = out.settings
        cell.notes.append(
            f"computed from plain's outputs (concurrency {cell.concurrency}), not decoded or timed: exact for "
            "batch-1 prompt lookup wherever those outputs are its continuation (under sampling plain's draw stands "
            "for prompt lookup's, same distribution); tau leaves the prefill forward out, as every method's does"
        )
        log(self.config, _progress(cell))

    def cell(self, method, cell: BenchCell, layouts) -> list[list[int]] | None:
        """Measure one cell; its generated rows, or None when it was skipped or raised."""
        reason = method.skip_reason(self.ctx, cell.concurrency)
        if reason is not None:
            cell.skipped, cell.skip_reason = True, reason
            log(self.config, f"[{cell.dataset} c={cell.concurrency}] {method.name}: skipped ({reason})")
            return None
        try:
            return measure(method, self.ctx, cell, layouts, self.config, self.eos_ids, self.warm_pool, self.warmed, self.pad_id,
                           self.ctx.device, self.on_cuda, self.result.hardware, online=self.result.online)  # fmt: skip
        except Exception as exc:  # a crash is a failure of the run, reported, not hidden
            self.error(method, cell, exc)
            if self.on_cuda:
                torch.cuda.empty_cache()
            return None

    def error(self, method, cell: BenchCell, exc: Exception) -> None:
        """Record a cell whose method raised: the cell's error, a failure of the run, printed loudly."""
        cell.error = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
        self.result.failures.append(dict(kind="error", method=method.name, dataset=cell.dataset,
                                         concurrency=cell.concurrency, prompt_index=None, message=cell.error))
        loud(f"{method.name} on {cell.dataset} (concurrency {cell.concurrency}) raised {cell.error}")


def run_bench(config: BenchConfig) -> BenchResult:
    """Run every (dataset, concurrency, method) of `config`; write outputs when ``config.out`` is set."""
    unknown = [m for m in config.methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}: choose from {', '.join(METHODS)}")
    ref = config.reference_concurrency
    counts = [config.num_prompts, *config.concurrency, *([ref] if ref is not None else [])]
    if min(counts) < 1:
        raise ValueError("num_prompts, every concurrency and reference_concurrency must be >= 1")
    if not (config.temperature >= 0 and 0 < config.top_p <= 1 and config.top_k >= 0):  # NaN fails too
        raise ValueError(f"need temperature >= 0 (0: greedy), top_p in (0, 1] and top_k >= 0 (0: off); got "
                         f"{config.temperature!r}, {config.top_p!r}, {config.top_k!r}")
    # Plain first: it is the correctness reference of every other method.
    methods = sorted(dict.fromkeys(config.methods), key=lambda m: m != "plain")
    names = D.expand_datasets(config.datasets)
    sets = [load_prompt_set(d, config.num_prompts, config.data_dir, config.split) for d in names]
    choice = read_choice(config.prompt_lookup_choice) if config.prompt_lookup_choice else None
    labels = [turn_label(s.label, t) for s in sets for t in range(1, 2 + max(map(len, s.later_turns), default=0))]
    check_choice(choice, labels, methods, config.split)
    device, dtype = resolve_device_dtype(config.device, config.dtype)
    target, drafter, tokenizer, assistant = load_models(
        config.target, config.drafter, config.tokenizer, reference=config.reference, assistant=config.assistant,
        device=device, dtype=dtype, attn_implementation=config.attn_implementation, threads=config.threads,
    )  # fmt: skip
    gen, pad_id, eos_ids = _generate_kwargs(config, target, tokenizer)
    ctx = BenchContext(target, drafter, assistant, tokenizer, device, gen, prompt_lookup_num_tokens=config.prompt_lookup_num_tokens,
                       length_rate=config.length_rate, halving_batch=config.halving_batch,
                       fast_path=True if config.fast_path else "auto")
    result = BenchResult(config=_config_dict(config, tokenizer), environment=environment(config, device, dtype),
                         hardware=hardware(target, drafter, device))  # fmt: skip

    if config.split != "all":
        result.config["split_counts"] = {s.label: _split_counts(d, config.data_dir) for d, s in zip(names, sets)}
    run = _Run(config, ctx, result, pad_id, eos_ids)
    for s in sets:
        _run_set(run, s, methods, choice or {})

    if result.failures:
        loud(f"{len(result.failures)} failure(s); see 'failures' in the result")
    if config.out:
        from .report import write_outputs

        write_outputs(result, config.out, plots=config.plots)
    return result


def _run_set(run: _Run, pset, methods: list[str], choice: dict) -> None:
    """Every turn of one set at every concurrency: turn 1, then each later turn on the conversations so far
    (the target's greedy answers in them, `.multiturn`)."""
    conversations = dict(enumerate(pset.prompts))
    turn = 1
    while conversations:
        label = turn_label(pset.label, turn)
        run.ctx.prompt_lookup_tuned = choice.get(label)  # this set's setting chosen on validation, if any
        order = sorted(conversations)
        encoded = [encode_prompt(run.ctx.tokenizer, conversations[i]) for i in order]
        run.warm_pool = sorted(encoded, key=len, reverse=True)  # longest first (`measure._warm_up`)
        for conc in run.config.concurrency:
            run.result.cells.extend(run.group(label, encoded, conc, methods))
        turn += 1
        if not any(len(t) >= turn - 1 for t in pset.later_turns):
            break
        answers = dict(zip(order, greedy_answers(run, encoded, run.references.get(label))))
        conversations = turn_prompts(conversations, pset.later_turns, answers, turn)


# ----------------------------------------------------------------------------- correctness & speedups
def _logit_gap(target, prompt: list[int], prefix: list[int], want: int, got: int | None) -> float | None:
    """The target's logit of plain's token minus the method's token, after the common prefix (one
    unpadded row): a gap near zero points at floating-point near-ties, a large one at a real bug."""
    if got is None:
        return None
    ids = torch.tensor([prompt + prefix], device=target.device)
    with torch.inference_mode():
        logits = target(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
    return float(logits[want] - logits[got])


def compare(cell, rows, reference, result, target=None, prompts=None):
    """Compare a cell's rows with plain's, prompt by prompt; every mismatch is a failure, printed loudly."""
    bad = []
    for i, (got, want) in enumerate(zip(rows, reference)):
        if got == want:
            continue
        first = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        bad.append(i)
        gap = None
        if target is not None and prompts is not None and first < len(want):
            gap = _logit_gap(target, prompts[i], want[:first], want[first], got[first] if first < len(got) else None)
        result.failures.append(
            dict(
                kind="mismatch", method=cell.method, dataset=cell.dataset, concurrency=cell.concurrency,
                prompt_index=i, first_mismatch=first, expected_len=len(want), got_len=len(got),
                expected_token=want[first] if first < len(want) else None,
                got_token=got[first] if first < len(got) else None, logit_gap=gap,
            )
        )  # fmt: skip
        loud(
            f"{cell.method} on {cell.dataset} (concurrency {cell.concurrency}): prompt {i} differs from plain "
            f"decoding at new token {first} (lengths {len(got)} vs {len(want)}"
            + (f"; target logit gap plain-vs-method {gap:.4g}" if gap is not None else "")
            + ")"
        )
    cell.identical = not bad
    cell.mismatched_prompts = bad


# A computed method and the real one it stands for: when the real one decoded plain's outputs exactly,
# its rounds are the same function of those outputs, so every round figure must agree.
CROSS_CHECKS = {"prompt_lookup_exact": "prompt_lookup", "prompt_lookup_grid": "prompt_lookup_tuned"}


def cross_check(group: list[BenchCell], result: BenchResult) -> None:
    """Compare each computed cell of one (dataset, concurrency) with its real method's; a difference is a failure."""
    cells = {c.method: c for c in group}
    for computed, real in CROSS_CHECKS.items():
        a, b = cells.get(computed), cells.get(real)
        if a is None or b is None or a.tau is None or b.tau is None or b.identical is not True:
            continue
        fields = ("rounds", "tau", "mean_verify_length", "tau_histogram")
        diff = [f for f in fields if getattr(a, f) != getattr(b, f)]
        if diff:
            msg = f"{computed} differs from the real {real} run in {', '.join(diff)}"
            a.notes.append(msg)
            result.failures.append(dict(kind="error", method=computed, dataset=a.dataset, concurrency=a.concurrency,
                                        prompt_index=None, message=msg))  # fmt: skip
            loud(f"{msg} on {a.dataset} (concurrency {a.concurrency})")
        else:
            a.notes.append(f"cross-checked: rounds, tau and verify lengths equal the real {real} run's")


def _fill_speedups(group: list[BenchCell]) -> None:
    base = {c.method: c.tokens_per_s for c in group if c.method in BASELINES and c.tokens_per_s}
    for c in group:
        c.speedup = {b: (c.tokens_per_s / v if c.tokens_per_s else None) for b, v in base.items()}


def _progress(c: BenchCell) -> str:
    from .summary import fmt

    tau = f" tau {c.tau:.2f}" if c.tau is not None else ""
    ident = {True: " identical", False: " MISMATCH", None: ""}[c.identical]
    return f"[{c.dataset} c={c.concurrency}] {c.method}: {fmt(c.tokens_per_s, '.1f')} tok/s{tau}{ident}"
