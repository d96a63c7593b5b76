"""The markdown of ``replay_bench.py``'s results: issue 35's table per arrival pattern (x = ratio of decode tok/s),
the rows behind it per trace, the reference pair's real engine runs, profiles, kernels and checks.

Modes: ``off`` (plain decoding), ``fixed`` (whole block), ``packed:adaptive`` (the paper's floor rule on the length
head; the issue's "adaptive"), ``packed`` (the cost rule) and ``default`` (what the trace's drafter runs when no policy
is asked for: the cost rule for the shipped head, the floor rule for the oracle; the same engine and row as another
mode when its settings are that mode's).
"""

from __future__ import annotations

import json

import gpu_common as common

ADAPTIVE = "packed:adaptive"  # the issue's "adaptive": the length head's floor rule, each request its own k_hat


def find(rows, kind, mode, trace, c, arrival):
    """The row of ``(kind, mode, trace, concurrency, arrival)`` (``off`` replay rows have no trace), or ``{}``."""
    trace = None if kind == "replay" and mode == "off" else trace
    return next((r for r in rows if r["kind"] == kind and r["mode"] == mode and r.get("trace") == trace
                 and r["concurrency"] == c and r["arrival"] == arrival), {})


def ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def ratios(rows, kind, trace, c, arrival, key="tok_per_s") -> dict:
    """``{"adaptive/fixed", "adaptive/off", "fixed/off", "default/max"}`` of ``key`` at one cell (``None`` where a
    row is missing)."""
    v = {m: find(rows, kind, m, trace, c, arrival).get(key) for m in ("off", "fixed", ADAPTIVE, "default")}
    div = lambda a, b: a / b if a and b else None  # noqa: E731
    best = max(v["off"] or 0, v["fixed"] or 0) or None
    return {"adaptive/fixed": div(v[ADAPTIVE], v["fixed"]), "adaptive/off": div(v[ADAPTIVE], v["off"]),
            "fixed/off": div(v["fixed"], v["off"]), "default/max": div(v["default"], best), **v}


def x(v) -> str:
    return f"{v:.2f}x" if v else "-"


def issue_table(res, kind, traces, arrival) -> list[str]:
    """Issue 35's table: one row per trace; the worst ``default / max(off, fixed)`` over every concurrency run."""
    conc, rows = res["meta"]["concurrency" if kind == "replay" else "real_concurrency"], res["rows"]
    out = ["| trace (head) | c=1 adaptive / fixed | c=32 adaptive / fixed | c=128 adaptive / off | c=128 fixed / off | "
           "default / max(off, fixed), lowest (at c) |", "|---|---|---|---|---|---|"]
    for name in traces:
        cells = {c: ratios(rows, kind, name, c, arrival) for c in conc}
        worst = min(((v["default/max"], c) for c, v in cells.items() if v["default/max"]), default=None)
        get = lambda c, k: x(cells[c][k]) if c in cells else "-"  # noqa: E731
        head = res["traces"].get(name, {}).get("head", "") if kind == "replay" else "reference pair, real engine"
        out.append(f"| `{name}` ({head}) | {get(1, 'adaptive/fixed')} | "
                   f"{get(32, 'adaptive/fixed')} | {get(128, 'adaptive/off')} | {get(128, 'fixed/off')} | "
                   + (f"{worst[0]:.2f}x (c={worst[1]})" if worst else "-") + " |")
    return out + [""]


def detail_table(res, kind, name, arrival) -> list[str]:
    """Every concurrency of one trace (or set, for real runs) and arrival pattern."""
    conc, rows = res["meta"]["concurrency" if kind == "replay" else "real_concurrency"], res["rows"]
    closed = arrival == "closed"
    out = ["| c | off | fixed | adaptive | default | adaptive / fixed | adaptive / off | fixed / off | default / max(off, "
           "fixed) | " + ("tau fixed / adaptive | adaptive verify len" if closed else "mean latency s off / fixed / adaptive "
                           "/ default | offered req/s") + " | identical |", "|---" * 12 + "|"]
    for c in conc:
        r = ratios(rows, kind, name, c, arrival)
        row = {md: find(rows, kind, md, name, c, arrival) for md in ("off", "fixed", ADAPTIVE, "default")}
        num = lambda md: f"{row[md]['tok_per_s']:.0f}" if row[md].get("tok_per_s") else (row[md].get("error") or "-")[:30]  # noqa: E731
        if closed:
            extra = (f"{row['fixed'].get('tau', 0):.2f} / {row[ADAPTIVE].get('tau', 0):.2f} | "
                     f"{row[ADAPTIVE].get('mean_verify_len', 0):.2f}")
        else:
            extra = (" / ".join(f"{row[md]['latency_s']:.2f}" if "latency_s" in row[md] else "-" for md in row)
                     + f" | {row['off'].get('offered_rate', 0):.1f}")
        ident = "/".join(str(row[md].get("identical", "-")) for md in row)
        out.append(f"| {c} | {num('off')} | {num('fixed')} | {num(ADAPTIVE)} | {num('default')} | {x(r['adaptive/fixed'])} | "
                   f"{x(r['adaptive/off'])} | {x(r['fixed/off'])} | {x(r['default/max'])} | {extra} | {ident} of "
                   f"{row['off'].get('requests', '-')} |")
    return out + [""]


def _overheads(rc: dict) -> str:
    """A measured round cost's overheads per round (older runs recorded none), in ms where the unit was recorded."""
    if "spec_overhead" not in rc:
        return ""
    unit, name = (rc["unit_ms"], "ms") if rc.get("unit_ms") else (1.0, "plain steps")
    per = lambda vs: "/".join(f"{v * unit:.2f}" for v in vs)  # noqa: E731
    return (f", overhead per round at {'/'.join(map(str, rc['rows']))} requests: drafting {per(rc['spec_overhead'])}, "
            f"plain {per(rc['plain_overhead'])}" + (f", the read whole blocks spare {per(rc['read_overhead'])}"
                                                     if "read_overhead" in rc else "") + f" {name}")


def markdown(res: dict) -> str:
    m, rows = res["meta"], res["rows"]
    out = ["# ACCEPTANCE REPLAY, Qwen3-8B shape (random bf16 weights), engine tok/s; and the reference pair's real runs", "",
           f"{m.get('gpu') or m['device']}; {m['prompt_len']}-token prompts, {m['max_new_tokens']} new tokens per request; "
           f"drafter: {m.get('drafter', '')}. Replay: the drafts follow the trace, the engine's forwards, kernels and "
           "verify lengths are real; each trace replayed at its recording drafter's policy (rate, min len). Not a "
           "model's result. Closed batch: one request per slot, all submitted at once, tok/s = decode (after every "
           "request has its first token, to the end of the run, tail included). Poisson `poisson:L`: open-loop "
           "arrivals at L x `off`'s closed-batch request rate at that concurrency, at most c requests in the engine, "
           "tok/s over first arrival to last finish, latency = arrival to last token. adaptive = `packed:adaptive` (the "
           "paper's floor rule); default = what the trace's drafter runs unasked (shipped head: the cost rule"
           + (f", on this GPU's measured round cost, drafter fraction {m['round_cost']['draft_fraction']:.3f}"
              + _overheads(m["round_cost"]) if m.get("round_cost") else ", on SPEC section 6's cost table") + ").", ""]
    traces = list(res.get("traces", {}))
    for arrival in m["arrivals"]:
        out += [f"## Issue 35's table, replay, {arrival} (x = ratio of tok/s)", ""] + issue_table(res, "replay", traces, arrival)
    if m.get("real_sets"):
        out += ["## Issue 35's table, the reference pair's own engine runs (real model, closed batch)", ""]
        for name, rc in m.get("round_cost_real", {}).items():
            out += [f"`{name}`: default on the pair's own measured round cost, drafter fraction {rc['draft_fraction']:.3f}"
                    + _overheads(rc) + ".", ""]
        out += issue_table(res, "real", m["real_sets"], "closed")
    for name, tr in res.get("traces", {}).items():
        out += [f"## trace `{name}`: {tr['description']} (trace tau {tr['tau']:.2f}; policy {tr['policy']})", ""]
        for arrival in m["arrivals"]:
            out += [f"{arrival}:", ""] + detail_table(res, "replay", name, arrival)
    for name in m.get("real_sets", []):
        out += [f"## Real runs, reference pair on `{name}` (closed batch; identical = equal to `off`'s output)", ""]
        out += detail_table(res, "real", name, "closed")
    prof = [r for r in rows if "phases" in r]
    if prof:
        out += ["## Per step (profiled run, device synced per phase)", "", "| trace | mode | concurrency | phases |", "|---|---|---|---|"]
        out += [f"| {r.get('trace', '-')} | {r['mode']} | {r['concurrency']} | {common.fmt_phases(r['phases'])} |" for r in prof]
        out.append("")
    for r in (r for r in rows if r.get("kernels")):
        k = r["kernels"]
        out += [f"## Device kernels, {r['mode']} at concurrency {r['concurrency']} ({k['forwards']} target forwards mid-run: "
                f"{k['kernel_ms_per_forward']:.2f} ms of kernels per forward in {k['wall_ms_per_forward']:.2f} ms wall)", "",
                "By kind, ms per forward: " + ", ".join(f"{g} {v:.2f}" for g, v in k["groups_ms_per_forward"].items()), "",
                "| ms per forward | calls per forward | kernel |", "|---|---|---|"]
        out += [f"| {t['us'] / 1e3 / k['forwards']:.3f} | {t['count'] / k['forwards']:.1f} | `{t['name'][:90]}` |" for t in k["top"]]
        out.append("")
    if res.get("checks"):
        out += ["## Checks", "", "```", json.dumps(res["checks"], indent=1, default=str), "```", ""]
    return "\n".join(out)
