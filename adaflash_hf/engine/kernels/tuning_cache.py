"""Kernel choices of :meth:`.fused.FusedTarget.tune_row_kernels` kept on disk, so a second process skips the timing.

Timing every few-row kernel on a model's weights takes tens of seconds at the 8B shape, and its answer
depends only on the GPU, the weight shapes and dtype, and the software that compiles the kernels. The
choices are stored as one small JSON file per such key, in the user's cache directory next to
Triton's and Inductor's own caches: ``$ADAFLASH_HF_CACHE`` if set, else ``$XDG_CACHE_HOME/adaflash_hf/
kernels`` (default ``~/.cache/adaflash_hf/kernels``). Files are written atomically (a temporary file
renamed into place); a file that cannot be read back is ignored with a warning and tuned again. Other measurements of
this machine keep their own folder beside ``kernels`` the same way (:func:`load_entry`, :func:`save_entry`: the
engine's round cost, :mod:`adaflash_hf.engine.cost_cache`).

Example:
    >>> key = tuning_key(fused)  # doctest: +SKIP
    >>> saved = load_tuning(key)  # None: tune, then save_tuning(key, choices)  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

import torch

from ...atomic_io import write_text_atomic

__all__ = ["cache_dir", "entries", "load_entry", "load_tuning", "save_entry", "save_tuning", "tuning_key", "versions"]

FORMAT = 2  # the layout of the saved choices (FusedTarget.tuning_choices); a new layout takes a new number


def cache_dir(kind: str = "kernels") -> Path:
    """Where files of ``kind`` live (tuning files: ``kernels``; see the module docstring)."""
    explicit = os.environ.get("ADAFLASH_HF_CACHE")
    if explicit:
        return Path(explicit) / kind
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "adaflash_hf" / kind


def versions() -> dict[str, str]:
    """The software a measurement of this machine depends on (torch, transformers, ours, CUDA, Triton)."""
    import transformers

    from ... import __version__ as ours

    out = {"torch": torch.__version__, "transformers": transformers.__version__, "adaflash_hf": ours,
           "cuda": str(torch.version.cuda)}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = "none"
    return out


def tuning_key(shapes: dict[str, list], dtype: torch.dtype, device: torch.device) -> dict:
    """Everything a kernel choice depends on: the device's name and capability, the projections' weight
    shapes (and bias presence), the dtype and the library versions."""
    device = torch.device(device)
    if device.type == "cuda":
        name, capability = torch.cuda.get_device_name(device), list(torch.cuda.get_device_capability(device))
    else:
        name, capability = device.type, []
    return {"format": FORMAT, "device": name, "capability": capability, "dtype": str(dtype), "shapes": shapes,
            **versions()}


def _path(key: dict, kind: str = "kernels") -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir(kind) / f"{digest}.json"


def load_entry(key: dict, kind: str, field: str = "value", what: str = "cache file"):
    """The ``field`` saved for ``key`` in ``kind``'s folder, or ``None`` (never saved, or unreadable: then a warning
    naming the file as ``what``)."""
    path = _path(key, kind)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data["key"] != key:
            raise ValueError("the file holds another key")
        return data[field]
    except Exception as exc:  # noqa: BLE001 - a bad cache file must never stop a build: measure again
        warnings.warn(f"ignoring the {what} {path} ({type(exc).__name__}: {exc}); measuring again",
                      RuntimeWarning, stacklevel=3)
        return None


def save_entry(key: dict, value, kind: str, field: str = "value") -> Path | None:
    """Write ``value`` (JSON-able) for ``key`` in ``kind``'s folder atomically; a cache directory that cannot be
    written is skipped with a warning (``None``: the next process measures again)."""
    path = _path(key, kind)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps({"key": key, field: value}, indent=1, sort_keys=True))
    except OSError as exc:
        warnings.warn(f"could not save to {path} ({exc}); the next process measures again", RuntimeWarning, stacklevel=3)
        return None
    return path


def entries(kind: str, field: str = "value") -> list[tuple[Path, dict, object]]:
    """Every readable ``(path, key, field)`` of ``kind``'s folder, oldest first (a file that cannot be read is left out)."""
    folder = cache_dir(kind)
    out = []
    for path in sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime) if folder.is_dir() else []:
        try:
            data = json.loads(path.read_text())
            out.append((path, data["key"], data[field]))
        except (OSError, ValueError, KeyError):
            continue
    return out


def load_tuning(key: dict) -> dict | None:
    """The choices saved for ``key``, or ``None`` (never saved, or unreadable: then a warning)."""
    return load_entry(key, "kernels", "choices", what="kernel tuning cache file")


def save_tuning(key: dict, choices: dict) -> Path | None:
    """Write ``choices`` (JSON-able) for ``key`` atomically; a cache directory that cannot be written
    is skipped with a warning (``None``)."""
    return save_entry(key, choices, "kernels", "choices")
