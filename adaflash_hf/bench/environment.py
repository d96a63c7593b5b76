"""Where a run happened: versions, hardware, the target's weight bytes and the device's copy bandwidth
(the memory-bandwidth floor of a decode step)."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import sys

import torch


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(config, device: torch.device, dtype: torch.dtype) -> dict:
    import transformers

    from .. import __version__

    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        hardware = f"{torch.cuda.get_device_name(idx)} (CUDA {torch.version.cuda})"
    else:
        hardware = f"{_cpu_model()}, {os.cpu_count()} cores"
    command = config.command or shlex.join(sys.argv)
    return {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "hardware": hardware,
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "cpu": f"{_cpu_model()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "adaflash_hf": __version__,
        "command": command,
    }


def target_weight_bytes(model) -> int:
    """Bytes of weights a decode step reads: every parameter once, minus the input embedding table
    (a lookup reads one row) unless it is tied to the LM head."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    if out is None or out.weight.data_ptr() != emb.data_ptr():
        total -= emb.numel() * emb.element_size()
    return total


def measure_copy_bandwidth(device, nbytes: int = 1 << 30, iters: int = 10) -> float:
    """Device memory bandwidth in bytes/s from a large device-to-device copy (read + write bytes)."""
    device = torch.device(device)
    free, _ = torch.cuda.mem_get_info(device)
    nbytes = int(min(nbytes, free // 4))
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    stop.record()
    torch.cuda.synchronize(device)
    seconds = start.elapsed_time(stop) / 1e3
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes * iters / seconds


def hardware(target, drafter, device) -> dict:
    """The models' sizes and, on CUDA, the memory-bandwidth floor of a batch-1 decode step."""
    hw = {
        "target_weight_bytes": target_weight_bytes(target),
        "target_params": sum(p.numel() for p in target.parameters()),
        "drafter_params": sum(p.numel() for p in drafter.parameters()) if drafter is not None else None,
        "drafter_block_size": drafter.config.block_size if drafter is not None else None,
        "copy_bandwidth_bytes_per_s": None,
        "floor_ms_per_token": None,
        "floor_tokens_per_s": None,
    }
    if device.type == "cuda":
        bw = measure_copy_bandwidth(device)
        hw["copy_bandwidth_bytes_per_s"] = bw
        hw["floor_ms_per_token"] = hw["target_weight_bytes"] / bw * 1e3
        hw["floor_tokens_per_s"] = 1e3 / hw["floor_ms_per_token"]
    return hw
