"""What predicts a round's acceptance before its drafter runs, from the reference pair's whole-block rounds in order
(`docs/logs/head_calibration_cpu/head_calibration.json`: `fixed`, the first 20 prompts of Spec-Bench's five categories
and MT-bench, 128 new tokens; request boundaries are not marked there, so a few pairs straddle two requests).
Per set: the mean head ratio against the mean realised (accepted + 1) / B, and the correlation of the next round's
realised acceptance with the last ratio, with the mean realised of the last 4 and of the last 16 rounds, and (for
comparison) of a round's own ratio with its own realised acceptance.

    python docs/logs/c1_guess_cpu_1205/next_round_predictors.py
"""

import json
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
B = 16


def main() -> None:
    data = json.loads((ROOT / "head_calibration_cpu" / "head_calibration.json").read_text(encoding="utf-8"))
    print("| set | rounds | mean ratio | mean realised | next ~ last ratio | next ~ mean of last 4 | next ~ mean of last 16 "
          "| own ratio ~ own realised |")
    print("|---|---|---|---|---|---|---|---|")
    for name, trace in data["traces"].items():
        rounds = trace["rounds"]
        real, ratio = [(a + 1) / B for a, _ in rounds], [x for _, x in rounds]
        nxt = real[1:]
        mean_of = lambda w: [statistics.mean(real[max(0, i - w + 1) : i + 1]) for i in range(len(rounds) - 1)]  # noqa: E731
        corr = statistics.correlation
        print(f"| {name} | {len(rounds)} | {statistics.mean(ratio):.3f} | {statistics.mean(real):.3f} | "
              f"{corr(ratio[:-1], nxt):.3f} | {corr(mean_of(4), nxt):.3f} | {corr(mean_of(16), nxt):.3f} | "
              f"{corr(ratio, real):.3f} |")


if __name__ == "__main__":
    main()
