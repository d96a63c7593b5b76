"""Held-out tau and training loss per update against how often the stream has repeated its prompts (issue 33
item 3): the 3-seed H200 runs of docs/logs/online_protocol_lr3e-5 and this folder's dev-CPU runs.

    python docs/logs/online_item3_cpu_1205/repetition_table.py > docs/logs/online_item3_cpu_1205/repetition_table.md
"""

import glob
import json
import statistics as st
from pathlib import Path

LOGS = Path(__file__).resolve().parent.parent
SOURCES = [  # (label, run folders' glob, distinct prompts in the stream)
    ("alpaca_eval (H200, 3 seeds)", "online_protocol_lr3e-5/alpaca_eval__{m}_s*", 741),
    ("gsm8k (H200, 3 seeds)", "online_protocol_lr3e-5/gsm8k__{m}_s*", 1255),
    ("Spec-Bench translation (H200, 3 seeds)", "online_protocol_lr3e-5/translation__{m}_s*", 56),
    ("Spec-Bench summarization (dev CPU, seed 0)", "online_item3_cpu_1205/summarization__{m}_s0", 52),
]


def curves(pattern: str, method: str) -> list[list[dict]]:
    return [json.loads((Path(f) / "protocol.json").read_text())["methods"][method]["curve"]
            for f in sorted(glob.glob(str(LOGS / pattern.format(m=method)))) if Path(f).is_dir()]


print("| source | method | distinct prompts streamed | passes over them by update 1, 2, ... | training loss, updates 1, 2, ... | held-out tau / start after updates 1, 2, ... |")
print("|---|---|---|---|---|---|")
for label, pattern, distinct in SOURCES:
    for method in ("opd", "osd"):
        runs = curves(pattern, method)
        if not runs:
            continue
        n = min(len(c) for c in runs)
        start = st.mean(c[0]["tau"] for c in runs)
        served = [runs[0][i]["served"] for i in range(1, n)]
        passes = ", ".join(f"{s / distinct:.1f}" for s in served)
        loss = ", ".join(f"{st.mean(c[i]['loss'] for c in runs):.2f}" for i in range(1, n))
        tau = ", ".join(f"{st.mean(c[i]['tau'] for c in runs) / start:.3f}" for i in range(1, n))
        print(f"| {label} | {method.upper()} | {distinct} | {passes} | {loss} | {tau} |")
