"""What a benchmark run measures: `BenchConfig` and the method names (no torch here: the CLI's flags use it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

BASELINES = ("plain", "plain_static")
DEFAULT_METHODS = (
    "plain", "plain_static", "hf_assisted", "prompt_lookup", "prompt_lookup_exact", "dflash_native",
    "fixed", "cost", "adaptive", "expected_gain", "osd", "adaflash",
    "engine_off", "engine_fixed", "engine_cost", "engine_adaptive",
)  # fmt: skip
# Accepted by --methods, run only when named: prompt lookup at its best, the drafter without the prompt n-gram
# rule (`*_alone`), and candidates verified past the block (`*_wide`).
OPT_IN_METHODS = (
    "prompt_lookup_grid", "prompt_lookup_tuned", "fixed_alone", "fixed_wide", "cost_alone", "cost_wide",
    "engine_fixed_alone",
)  # fmt: skip
METHOD_NAMES = DEFAULT_METHODS + OPT_IN_METHODS  # every name `bench.METHODS` knows (a test keeps them equal)


@dataclass
class BenchConfig:
    """What to benchmark. Model fields take a local path, a Hub id, or an already loaded object.

    ``datasets``: names understood by `adaflash_hf.training.data.eval_prompts` (gsm8k, mathqa,
    math500, aime2025, mbpp, codealpaca, sharegpt, alpaca_eval, spec_bench, eagle_bench, blend) or
    ``jsonl:PATH`` (one record a line with a ``"prompt"`` string or a ``"messages"`` list).
    ``split``: ``"all"`` (every record as listed), or the ``"validation"`` / ``"test"`` slice of each
    named set with training duplicates removed (`adaflash_hf.training.splits`).
    ``concurrency``: batch sizes; N prompts are decoded together in one left-padded batch.
    ``temperature`` 0 means greedy, and only greedy runs are compared token for token.
    ``threads``: torch's CPU threads (None: `loading.set_cpu_threads` picks, one for small models on the CPU).
    ``warmup``: prompts decoded untimed before each (method, concurrency) is first timed on a set (its longest).
    ``prompt_lookup_num_tokens``: candidate tokens per round of the ``prompt_lookup`` baseline (and of
    ``prompt_lookup_exact``, its rounds computed from plain's outputs, untimed).
    ``prompt_lookup_choice``: a ``--split validation`` run's ``bench.json`` whose ``prompt_lookup_grid`` cells
    chose each set's prompt-lookup setting, reported here by ``prompt_lookup_grid`` and ``prompt_lookup_tuned``
    (`.prompt_lookup_grid`). ``datasets`` may name a suite, ``spec_bench_all`` (`training.data.SUITES`).
    ``length_rate``: the length head's ``k_hat = clamp(floor(a * B * rate), 1, B)`` rate for every adaptive
    method (``None``: the drafter config's); ``halving_batch``: the engine methods scale that rate down with
    the batch (half at this many requests; ``None``, the default: fixed rate, load left to admission).
    ``reference_concurrency``: when ``plain`` is not among the methods, the untimed plain rows that greedy cells are
    compared with are decoded this many prompts at a time (``None``: at each cell's concurrency). Plain greedy float32
    decoding gives the same rows at any batch, and at concurrency 1 the drafter methods run
    several times faster than plain does, so a long concurrency-1 run spends most of its time on its reference.
    ``fast_path``: our loop's methods take the engine's fast path off CUDA too (on CUDA they do by default), so a
    CPU run makes the GPU path's decisions.
    ``online_*``: the online methods' adapter (``OnlineAdapter``) settings: what a sample is
    (``"request"``: a finished request, or ``"round"``), samples that trigger an
    update, epochs over them, learning rate, and whether each triggered update is waited for
    before the next batch is served (reproducible curves; the wait is counted in the wall time).
    """

    target: Any = None
    drafter: Any = None
    tokenizer: Any = None
    assistant: Any = None
    reference: bool = False
    datasets: list[str] = field(default_factory=lambda: ["gsm8k"])
    num_prompts: int = 8
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    concurrency: list[int] = field(default_factory=lambda: [1])
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    device: str = "auto"
    dtype: str = "auto"
    threads: int | None = None
    attn_implementation: str = "sdpa"
    warmup: int = 1
    prompt_lookup_num_tokens: int = 10
    prompt_lookup_choice: str | None = None
    length_rate: float | None = None
    halving_batch: int | None = None
    fast_path: bool = False
    reference_concurrency: int | None = None
    online_sample_unit: str = "request"
    online_samples_per_update: int = 128
    online_epochs: int = 2
    online_lr: float = 3e-4
    online_wait: bool = True
    out: str | None = None
    data_dir: str | None = None
    split: str = "all"
    command: str | None = None
    plots: bool = True
    verbose: bool = True
