"""Kernel choices of :meth:`.fused.FusedTarget.tune_row_kernels` kept on disk, so a second process skips the timing.

Timing every few-row kernel on a model's weights takes tens of seconds at the 8B shape, and its answer
depends only on the GPU, the weight shapes and dtype, and the software that compiles the kernels. The
choices are stored as one small JSON file per such key, in the user's cache directory next to
Triton's and Inductor's own caches: ``$ADAFLASH_HF_CACHE`` if set, else ``$XDG_CACHE_HOME/adaflash_hf/
kernels`` (default ``~/.cache/adaflash_hf/kernels``). Files are written atomically (a temporary file
renamed into place); a file that cannot be read back is ignored with a warning and tuned again.

Example:
    >>> key = tuning_key(fused)  # doctest: +SKIP
    >>> saved = load_tuning(key)  # None: tune, then save_tuning(key, choices)  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path

import torch

__all__ = ["cache_dir", "load_tuning", "save_tuning", "tuning_key"]

FORMAT = 2  # the layout of the saved choices (FusedTarget.tuning_choices); a new layout takes a new number


def cache_dir() -> Path:
    """Where tuning files live (see the module docstring)."""
    explicit = os.environ.get("ADAFLASH_HF_CACHE")
    if explicit:
        return Path(explicit) / "kernels"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "adaflash_hf" / "kernels"


def _versions() -> dict[str, str]:
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
            **_versions()}


def _path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir() / f"{digest}.json"


def load_tuning(key: dict) -> dict | None:
    """The choices saved for ``key``, or ``None`` (never saved, or unreadable: then a warning)."""
    path = _path(key)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data["key"] != key:
            raise ValueError("the file holds another key")
        return data["choices"]
    except Exception as exc:  # noqa: BLE001 - a bad cache file must never stop a build: tune again
        warnings.warn(f"ignoring the kernel tuning cache file {path} ({type(exc).__name__}: {exc}); tuning again",
                      RuntimeWarning, stacklevel=2)
        return None


def save_tuning(key: dict, choices: dict) -> Path | None:
    """Write ``choices`` (JSON-able) for ``key`` atomically; a cache directory that cannot be written
    is skipped with a warning (``None``)."""
    path = _path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"key": key, "choices": choices}, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as exc:
        warnings.warn(f"could not save kernel choices to {path} ({exc}); the next process tunes again",
                      RuntimeWarning, stacklevel=2)
        return None
    return path
