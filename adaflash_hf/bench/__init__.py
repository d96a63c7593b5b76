"""`adaflash bench`: every decoding method on the same prompts, side by side, checked for correctness.

One run loads a target, an AdaFlash drafter (and optionally a small autoregressive assistant for
HF's own assisted generation), takes the prompts of each dataset (chat template applied), and for
each concurrency (prompts decoded together in one left-padded batch) times every method:

- ``plain``: ``target.generate`` with the default dynamic cache (the reference for correctness);
- ``plain_static``: ``target.generate(cache_implementation="static")``, compiled on CUDA;
- ``hf_assisted``: HF assisted generation with ``--assistant`` (batch 1 only);
- ``prompt_lookup``: HF prompt-lookup decoding (``prompt_lookup_num_tokens``, an n-gram copy of the
  prompt and the text so far; no drafter, no training; batch 1 only), the baseline a user already has;
- ``prompt_lookup_exact``: prompt lookup's rounds *computed* from plain's outputs of the same
  prompts (`.prompt_lookup_tau`), at any concurrency, in no model time: its candidates and acceptance
  are a function of the prompt and the output (under sampling too: a candidate is kept iff it equals the
  target's sample there, and the candidates top-p forbids are modelled), so under greedy decoding its tau,
  rounds and verify lengths are exact, and under sampling plain's draw stands for prompt lookup's, a draw
  of the same distribution (tau and rounds leave the prefill forward out, as for every method: `..speculation.rounds`);
  no speed figure (``not timed (computed)``). Beside ``prompt_lookup`` at concurrency 1 in greedy runs the
  two are cross-checked: any difference in rounds is a failure;
- ``dflash_native``: transformers' own DFlash path, ``speculation_type="dflash"`` (batch 1 only);
- ``fixed``, ``adaptive``, ``expected_gain``: our speculative loop with that length policy;
- ``osd``, ``adaflash``: our loop serving the dataset's prompts in order while an
  `adaflash_hf.online.OnlineAdapter` trains a fresh copy of the drafter on the served requests:
  ``osd`` (forward-KL online distillation, fixed policy) and ``adaflash`` (on-policy distillation
  + length head, adaptive policy when the drafter's length head is trained, else fixed). Their
  wall time includes the adapter's cost (with ``--online-wait``, the wait for every triggered
  update); tau per update goes to ``BenchResult.online`` and the ``tau_online.png`` plot;
- ``engine_off``, ``engine_fixed``, ``engine_adaptive``: the serving engine
  (`adaflash_hf.engine.Engine`, continuous batching over a slotted KV cache, CUDA graphs on GPU)
  without a drafter, or with that length policy, the batch submitted at once.

For greedy runs every method's generated ids are compared, prompt by prompt, with plain decoding
of the same batch layout; a mismatch is a *failure* (``BenchResult.failures``), printed loudly, and
makes the CLI exit non-zero. A method that cannot run in a configuration is reported as skipped,
with the reason, never dropped.

Outputs (``--out DIR``): ``bench.json`` (every figure, the environment, the exact command),
``bench.md`` (tables) and PNG plots (``pip install adaflash-hf[plot]``).

Example:
    >>> from adaflash_hf.bench import BenchConfig, run_bench
    >>> result = run_bench(BenchConfig(reference=True, datasets=["gsm8k"], num_prompts=8))  # doctest: +SKIP
    >>> result.failures, result.cell("fixed", "gsm8k", 1).tokens_per_s  # doctest: +SKIP

CLI: ``adaflash bench --reference --datasets gsm8k,mathqa --num-prompts 32 --out runs/bench``
(also ``python -m adaflash_hf.bench ...``).

Layout: `.config` (BenchConfig, method names), `.methods` (one module per method family),
`.runner` (the grid, plain first, correctness), `.measure` (one cell), `.timing`, `.prompts`,
`.prompt_lookup_tau` (prompt lookup's rounds from a greedy output),
`.environment` (versions, bandwidth floor), `.results`, `.report` (bench.md / bench.json), `.plots`,
`.cli_args` (the flags). Model / device loading is `adaflash_hf.loading`, shared with the CLI.
"""


from __future__ import annotations

import importlib

from .cli_args import add_arguments, main, run_from_args
from .config import BASELINES, DEFAULT_METHODS, BenchConfig  # noqa: F401 - DEFAULT_METHODS: the default --methods

__all__ = [
    "BASELINES",
    "BenchCell",
    "BenchConfig",
    "BenchContext",
    "BenchResult",
    "METHODS",
    "Method",
    "MethodOutput",
    "add_arguments",
    "main",
    "measure_copy_bandwidth",
    "run_bench",
    "run_from_args",
    "target_weight_bytes",
    "write_outputs",
    "write_plots",
]

# Loaded on first use (they import torch): `adaflash bench --help` needs only the flags above.
_LAZY = {
    "BenchCell": ".results",
    "BenchResult": ".results",
    "BenchContext": ".methods",
    "METHODS": ".methods",
    "Method": ".methods",
    "MethodOutput": ".methods",
    "measure_copy_bandwidth": ".environment",
    "target_weight_bytes": ".environment",
    "run_bench": ".runner",
    "write_outputs": ".report",
    "write_plots": ".plots",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value
