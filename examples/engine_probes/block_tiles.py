"""GPU probe: the 16-row projection tile (``skinny_linear``'s ``_block_kernel``, a verify block) over a wider grid of
tile shapes than :data:`~adaflash_hf.engine.kernels.skinny_linear.BLOCK_CONFIGS`, against the one-row kernel (a decode
step) on the same weights, at the Qwen3-8B shape in bf16.

A 16-token verify reads the same weights as a 1-token step, so at full bandwidth both cost the same; this measures how
far each projection's best 16-row tile is from its best one-row tile. Every projection runs over ``--weights``
distinct weights (one per layer, no L2 reuse) inside one CUDA graph, timed as the engine's tuner times its
candidates (``kernels.fused.graph_ms``: the mean of ``--iters`` replays back to back; the run recorded in
``docs/logs/round_kernels_h100_1207`` took the median of single replays instead).

    python3 examples/engine_probes/block_tiles.py --out $OUT/tiles

Writes ``block_tiles.json`` and prints, per projection: the one-row time (best of ``ROW_CONFIGS``), the current
16-row time (best of ``BLOCK_CONFIGS``), the best 16-row tile of the grid and its time, cuBLAS at 16 rows.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from adaflash_hf.engine.kernels.fused import graph_ms  # the engine's own tuner times its candidates so
from adaflash_hf.engine.kernels.skinny_linear import BLOCK_CONFIGS, ROW_CONFIGS, SkinnyConfig, fitting, skinny_linear

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
GRID = [SkinnyConfig(bn, bk, w, s) for bn, bk, w, s in itertools.product((16, 32, 64, 128), (128, 256, 512), (4, 8),
                                                                           (3, 4, 5))]


def probe(role: str, shape, layers: int, iters: int, budget_end: float) -> dict:
    N, K = shape
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
    x1 = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    x16 = torch.randn(16, K, device="cuda", dtype=torch.bfloat16)

    def timed(x, cfg):
        try:
            return graph_ms(lambda: [skinny_linear(x, w, None, cfg) for w in ws], iters)
        except Exception as e:  # noqa: BLE001 - a tile that does not compile or fit: skip it
            return f"{type(e).__name__}: {str(e)[:80]}"

    row = {str(tuple(c)): timed(x1, c) for c in fitting(ROW_CONFIGS, shape, 1)}
    cur = {str(tuple(c)): timed(x16, c) for c in fitting(BLOCK_CONFIGS, shape, 16)}
    grid = {}
    for c in GRID:
        if time.time() > budget_end:
            break
        if N % c.block_n == 0 and K % c.block_k == 0 and str(tuple(c)) not in cur:
            grid[str(tuple(c))] = timed(x16, c)
    cublas = graph_ms(lambda: [F.linear(x16, w) for w in ws], iters)
    best = lambda d: min(((v, k) for k, v in d.items() if isinstance(v, float)), default=(float("nan"), None))  # noqa: E731
    out = {"shape": shape, "layers": layers, "row": row, "current_16": cur, "grid_16": grid, "cublas_16": cublas,
           "best_row": best(row), "best_current_16": best(cur), "best_grid_16": best({**cur, **grid})}
    del ws
    torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--weights", type=int, default=36)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=200.0)
    args = ap.parse_args(argv)
    end = time.time() + args.budget_s
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "roles": {}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for role, shape in SHAPES.items():
        res["roles"][role] = r = probe(role, shape, args.weights, args.iters, end)
        print(f"{role:8s} {shape}: 1 row {r['best_row'][0]:.3f} ms {r['best_row'][1]}; 16 rows now "
              f"{r['best_current_16'][0]:.3f} {r['best_current_16'][1]}; grid best {r['best_grid_16'][0]:.3f} "
              f"{r['best_grid_16'][1]} ({len(r['grid_16'])} tiles); cuBLAS {r['cublas_16']:.3f}", flush=True)
        (out / "block_tiles.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
