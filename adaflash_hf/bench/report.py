"""The run's files: ``bench.md`` (tables), ``bench.json`` (every figure) and the PNG plots."""

from __future__ import annotations

import sys
from pathlib import Path

from .results import BenchResult, online_records
from .summary import fmt, summary_table


def _header(result: BenchResult) -> list[str]:
    env, hw = result.environment, result.hardware
    lines = [
        "# adaflash bench",
        "",
        f"- date (UTC): {env['date_utc']}",
        f"- hardware: {env['hardware']} ({env['device']}, {env['dtype']})",
        f"- versions: torch {env['torch']}, transformers {env['transformers']}, adaflash-hf {env['adaflash_hf']}, python {env['python']}",
        f"- command: `{env['command']}`",
        f"- decoding: {decoding(result.config)}",
    ]
    for label, c in result.config.get("split_counts", {}).items():
        lines.append(
            f"- {label}: {result.config['split']} slice" + (": not applied (built-in sample)" if c is None else
            f" of {c['total']} records less {c['exact_duplicates']} exact and {c['near_duplicates']} near duplicates "
            f"of training prompts: validation {c['validation']}, test {c['test']}")
        )  # fmt: skip
    if hw.get("copy_bandwidth_bytes_per_s"):
        lines.append(
            f"- memory-bandwidth floor: {hw['target_weight_bytes'] / 1e9:.2f} GB of target weights / "
            f"{hw['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s copy bandwidth = {hw['floor_ms_per_token']:.2f} ms/token "
            f"({hw['floor_tokens_per_s']:.0f} tok/s at batch 1)"
        )
    return lines


def decoding(config: dict) -> str:
    """How the run decoded, as the report's header says it: greedy (checked token for token against plain) or
    sampling (its settings and seed; not compared token for token).

    Example:
        >>> decoding(dict(greedy=False, temperature=0.7, top_p=0.95, top_k=0, seed=0))[:38]
        'sampling, temperature 0.7, top-p 0.95'
    """
    if config.get("greedy", True):
        return "greedy; every method's outputs compared token for token with plain greedy"
    top_k = config.get("top_k") or "off"
    return (f"sampling, temperature {config['temperature']:g}, top-p {config['top_p']:g}, top-k {top_k}; seed "
            f"{config['seed']} (torch.manual_seed(seed + batch index) before each batch of every method, seed before "
            "the warmup): outputs are not compared token for token (their distribution: "
            "examples/sampling_distribution_check.py)")


def _main_table(result: BenchResult) -> list[str]:
    lines = [
        "",
        "| dataset | concurrency | method | tok/s | speedup vs plain | tau | mean verify len | identical? |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in result.cells:
        if c.skipped:
            lines.append(f"| {c.dataset} | {c.concurrency} | {c.method} | skipped: {c.skip_reason} | - | - | - | - |")
            continue
        if c.error:
            lines.append(f"| {c.dataset} | {c.concurrency} | {c.method} | error: {c.error} | - | - | - | FAILED |")
            continue
        sp = c.speedup.get("plain")
        tau = "-" if c.tau is None else (f"~{c.tau:.2f}" if c.tau_estimated else f"{c.tau:.2f}")
        ident = {True: "yes", False: f"**NO** ({len(c.mismatched_prompts)} prompts)", None: "n/a"}[c.identical]
        speed = "not timed (computed)" if _computed(c) else fmt(c.tokens_per_s, ".1f")
        lines.append(
            f"| {c.dataset} | {c.concurrency} | {c.method} | {speed} | "
            f"{'-' if sp is None else f'{sp:.2f}x'} | {tau} | {fmt(c.mean_verify_length)} | {ident} |"
        )
    if any(_computed(c) and not c.skipped for c in result.cells):
        lines += ["", "Computed rows (not timed): prompt_lookup_exact is transformers' prompt-lookup decoding "
                  "(prompt_lookup_num_tokens, batch 1) replayed on plain's outputs (under sampling, plain's draw of the "
                  "same distribution); "
                  "its tau leaves each prompt's prefill forward out, as every method's does (adaflash_hf.speculation.rounds)."]  # fmt: skip
    return lines


def _computed(c) -> bool:
    """A cell of a `Method.from_plain` method: figures computed from plain's outputs, no timing."""
    from .methods import METHODS

    method = METHODS.get(c.method)
    return method is not None and method.from_plain is not None


def _details(result: BenchResult) -> list[str]:
    lines = [
        "",
        "## Details",
        "",
        "| dataset | concurrency | method | speedup vs plain_static | TTFT ms | TPOT ms | draft s | verify s | peak mem GB | share of BW floor |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in result.cells:
        if c.skipped or c.error:
            continue
        ss = c.speedup.get("plain_static")
        ms = lambda x: None if x is None else x * 1e3  # noqa: E731
        mem = None if c.peak_memory_bytes is None else c.peak_memory_bytes / 1e9
        lines.append(
            f"| {c.dataset} | {c.concurrency} | {c.method} | {'-' if ss is None else f'{ss:.2f}x'} | {fmt(ms(c.ttft_s), '.1f')} | "
            f"{fmt(ms(c.tpot_s), '.2f')} | {fmt(c.draft_time_s, '.3f')} | {fmt(c.verify_time_s, '.3f')} | {fmt(mem)} | "
            f"{fmt(c.floor_share)} |"
        )
    return lines


def _online_table(result: BenchResult) -> list[str]:
    records = online_records(result.online)
    if not records:
        return []
    lines = [
        "",
        "## Online updates",
        "",
        "tau of the rounds served with the weights after N updates (N = 0: the drafter as given).",
        "",
        "| dataset | concurrency | method | tau per update (N: tau, rounds) |",
        "|---|---|---|---|",
    ]
    series: dict[tuple, list] = {}
    for r in records:
        series.setdefault((r.get("dataset"), r.get("concurrency"), r.get("method")), []).append(r)
    for (d, conc, m), rs in series.items():
        pts = ", ".join(f"{r['update']}: {fmt(r['tau'])} ({r.get('rounds', '-')})" for r in sorted(rs, key=lambda r: r["update"]))
        lines.append(f"| {fmt(d, '')} | {fmt(conc, '')} | {fmt(m, '')} | {pts} |")
    return lines


def _correctness(result: BenchResult) -> list[str]:
    lines = ["", "## Correctness", ""]
    if not result.failures:
        lines.append("No failures." if result.config.get("greedy") else "Sampling run: outputs not compared token for token.")
    for f in result.failures:
        if f["kind"] == "mismatch":
            lines.append(
                f"- **MISMATCH** {f['method']} / {f['dataset']} / concurrency {f['concurrency']}: prompt {f['prompt_index']} "
                f"differs from plain at new token {f['first_mismatch']} (target logit gap {fmt(f.get('logit_gap'), '.3g')})"
            )
        else:
            lines.append(f"- **ERROR** {f['method']} / {f['dataset']} / concurrency {f['concurrency']}: {f['message']}")
    return lines


def markdown(result: BenchResult) -> str:
    """``bench.md``: the environment, the results table, the per-set summary, details, online updates, correctness."""
    sections = (_header, _main_table, summary_table, _details, _online_table, _correctness)
    return "\n".join(line for section in sections for line in section(result)) + "\n"


def write_outputs(result: BenchResult, out_dir, plots: bool = True) -> list[str]:
    """Write ``bench.json``, ``bench.md`` and (matplotlib permitting) the PNG plots into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = [str(out / "bench.json"), str(out / "bench.md")]
    if plots:
        try:
            from .plots import write_plots

            files += write_plots(result, out)
        except ImportError:
            print("plots skipped: matplotlib is not installed (pip install 'adaflash-hf[plot]')", file=sys.stderr)
    result.files = files
    (out / "bench.md").write_text(markdown(result), encoding="utf-8")
    (out / "bench.json").write_text(result.to_json() + "\n", encoding="utf-8")
    return files
