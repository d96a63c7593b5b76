"""These runs' curves, one point per update (a training on 128 served requests, swapped in or refused by the guard).

The protocol that ran them (before this folder's commit) measured held-out tau only after a *swap* and served on
past refused updates, so its ``curve`` is indexed by swaps. Each run's log holds every training in order: a guard
refusal ("online update N refused") or a swap ("[protocol] M update K: held-out tau ..."). After a refusal the serving
weights are unchanged (no rollback happened in these runs: every record's ``rollback_of`` is None, and the logs have
no rollback line), so its point carries the last measurement, as the protocol does now (``"measured": False``).

    python docs/logs/online_item3_h100_1205/per_update.py   # writes per_update/NAME/protocol.json
"""

import json
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
SWAP = re.compile(r"^\[protocol\] \w+ update (\d+): held-out tau ([\d.]+) .*\(served (\d+)\)")


def per_update(run: dict, log: str, per_request: int = 128) -> dict:
    for method, res in run["methods"].items():
        if method == "off":
            continue
        assert all(u.get("rollback_of") is None for u in res["updates"]), "a rollback: this rebuild does not hold"
        measured = {c["update"]: c for c in res["curve"]}
        curve, swaps = [res["curve"][0]], 0
        for line in log.splitlines():
            m = SWAP.match(line)
            if m:
                swaps += 1
                point = measured[int(m.group(1))]
                assert abs(point["tau"] - float(m.group(2))) < 1e-3
                point = {**point, "outcome": "swapped"}
            elif " refused, serving weights unchanged" in line:
                point = {**curve[-1], "outcome": "refused", "measured": False, "loss": None}
            else:
                continue
            curve.append({**point, "update": len(curve), "served": len(curve) * per_request})
        res["curve"] = curve
    return run


def main() -> None:
    for path in sorted(HERE.glob("raw_*/*/protocol.json")):
        log = (path.parent.parent / f"{path.parent.name}.log").read_text(encoding="utf-8")
        out = HERE / "per_update" / path.parent.name / "protocol.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(per_update(json.loads(path.read_text(encoding="utf-8")), log), indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
