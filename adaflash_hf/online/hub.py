"""Optional Hub publishing of drafter versions: background uploads that never disturb serving.

* Every call goes through ``huggingface_hub.HfApi`` (``create_repo`` once, then
  ``upload_folder(..., run_as_future=True)`` per version), so it can be redirected or mocked in
  one place.
* **Credentials** come only from the environment (``HF_TOKEN``) or ``huggingface_hub`` login:
  nothing here accepts a token, so none can end up in a log line, a config or a model card. Every
  message we log is passed through :func:`redact` (which masks the known token values and
  anything shaped like a Hugging Face token) as a second line of defence.
* **Failures** are retried with exponential back-off (``backoff_s * 2**attempt``, capped), counted
  and logged, and never raised into the caller; the local version stays where it is. When versions
  arrive faster than they upload, only the newest pending one is pushed (older pending ones are
  skipped: the Hub repository tracks the latest state, the local directory keeps the window).
* **Local copies in use** (:meth:`HubPublisher.in_use`): the version uploading, the one pending and
  the last one pushed; :class:`~adaflash_hf.online.versions.VersionStore` never prunes them, so a
  rolling window smaller than the upload backlog cannot delete a folder mid-upload.
* **Closing** waits a short, bounded time (``close(timeout=10.0)``): retries stop at once (a push
  still in its back-off gives up, counted in ``gave_up`` with its ``last_error``), the attempt in
  flight and the pending version get the rest of ``timeout``, the local versions stay on disk.
* **Model card**: :func:`render_card` fills ``hub_cards/drafter_card.md`` (``{{ key }}``
  placeholders) with the target, the data domains seen, the versions and tau before / after.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from pathlib import Path

__all__ = ["HubPublisher", "find_card_template", "redact", "render_card"]

logger = logging.getLogger("adaflash_hf.online")

_TOKEN_ENV = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HUGGINGFACE_HUB_TOKEN", "HF_API_TOKEN")
_TOKEN_SHAPE = re.compile(r"\bhf_[A-Za-z0-9]{16,}\b")
_PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


def _known_tokens() -> list[str]:
    tokens = [os.environ.get(k, "") for k in _TOKEN_ENV]
    try:  # the token huggingface_hub itself would use (env or login), so it can be masked too
        from huggingface_hub import get_token

        tokens.append(get_token() or "")
    except Exception:  # noqa: BLE001 - redaction must never fail
        pass
    return sorted({t for t in tokens if len(t) >= 4}, key=len, reverse=True)


def redact(text: object) -> str:
    """``str(text)`` with every known Hub token and every ``hf_...`` token-shaped string masked.

    Example:
        >>> redact("401 for token hf_abcdefghijklmnopqrstuvwx")
        '401 for token ***'
    """
    s = str(text)
    for tok in _known_tokens():
        s = s.replace(tok, "***")
    return _TOKEN_SHAPE.sub("***", s)


class _RedactingFilter(logging.Filter):
    """Masks tokens in every record of the ``adaflash_hf.online`` loggers (defence in depth)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001
            return True
        clean = redact(msg)
        if clean != msg or record.args:
            record.msg, record.args = clean, None
        return True


if not any(isinstance(f, _RedactingFilter) for f in logger.filters):
    logger.addFilter(_RedactingFilter())


# --------------------------------------------------------------------------- model card

_DEFAULT_TEMPLATE = """---
library_name: transformers
tags:
- speculative-decoding
- dflash
- adaflash
- online-distillation
---

# {{ title }}

AdaFlash drafter for **{{ target_name }}**, adapted online ({{ method }}). Latest version: {{ latest_version }}.

Domains seen: {{ domains }}

{{ versions_table }}
"""


def find_card_template(name: str = "drafter_card.md") -> str:
    """The card template: ``hub_cards/<name>`` of the source tree or of the installed package,
    else a built-in minimal template."""
    here = Path(__file__).resolve()
    for candidate in (here.parents[2] / "hub_cards" / name, here.parents[1] / "hub_cards" / name):
        if candidate.is_file():
            return candidate.read_text(encoding="utf-8")
    return _DEFAULT_TEMPLATE


def _fmt(x, digits: int = 3) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def versions_table(history: list[dict]) -> str:
    """Markdown table of update records (newest last)."""
    if not history:
        return "_No versions yet._"
    lines = [
        "| version | samples | loss (first -> last epoch) | tau before | tau after | domains |",
        "|---|---|---|---|---|---|",
    ]
    for h in history:
        if not h.get("swapped", True):
            continue  # a refused update (online guard): never a version
        doms = ", ".join(f"{k} ({v})" for k, v in sorted((h.get("domains") or {}).items())) or "n/a"
        lines.append(
            f"| {_fmt(h.get('version'))} | {_fmt(h.get('samples'))} | {_fmt(h.get('loss_first'))} -> "
            f"{_fmt(h.get('loss_last'))} | {_fmt(h.get('tau_before'))} | {_fmt(h.get('tau_after'))} | {doms} |"
        )
    return "\n".join(lines)


def render_card(context: dict, template: str | None = None) -> str:
    """Fill ``{{ key }}`` placeholders from ``context`` (missing keys render as ``n/a``), redacted.

    ``context["history"]`` (a list of update records) also provides ``{{ versions_table }}``;
    ``context["domains"]`` may be a ``{domain: samples}`` mapping.
    """
    template = find_card_template() if template is None else template
    ctx = dict(context)
    ctx.setdefault("versions_table", versions_table(ctx.get("history") or []))
    doms = ctx.get("domains")
    if isinstance(doms, dict):
        ctx["domains"] = ", ".join(f"{k} ({v} samples)" for k, v in sorted(doms.items())) or "none recorded"
    ctx.setdefault("title", ctx.get("repo_id") or "AdaFlash drafter")
    target = str(ctx.get("target_name") or "")
    # Hub metadata links the card to its target only when the target is a Hub id, not a local path.
    is_hub_id = target.count("/") == 1 and " " not in target and not os.path.exists(target)
    ctx.setdefault("base_model_yaml", f"base_model: {target}" if is_hub_id else "")

    def sub(m: re.Match) -> str:
        return _fmt(ctx.get(m.group(1)))

    return redact(_PLACEHOLDER.sub(sub, template))


# --------------------------------------------------------------------------- publisher


class HubPublisher:
    """Pushes version folders to a Hub model repository from a background thread (module doc).

    Args:
        repo_id: ``"org/name"``.
        private: visibility when the repository is created (``None``: the Hub default).
        max_retries: retries per version after the first attempt.
        backoff_s / max_backoff_s: back-off ``backoff_s * 2**attempt`` seconds, capped.
        create_repo: call ``HfApi.create_repo(exist_ok=True)`` before the first upload.
        timeout_s: how long to wait for one upload future (``None``: no limit).

    Example:
        >>> pub = HubPublisher("my-org/qwen3-8b-adaflash-online")  # doctest: +SKIP
        >>> pub.submit("out/v00003", version=3)  # returns at once  # doctest: +SKIP
        >>> pub.flush(timeout=600); pub.stats  # doctest: +SKIP
    """

    def __init__(
        self,
        repo_id: str,
        private: bool | None = None,
        max_retries: int = 5,
        backoff_s: float = 2.0,
        max_backoff_s: float = 300.0,
        create_repo: bool = True,
        timeout_s: float | None = None,
    ):
        if not isinstance(repo_id, str) or repo_id.count("/") != 1:
            raise ValueError(f"hub repo id must look like 'org/name', got {repo_id!r}")
        self.repo_id = repo_id
        self.private = private
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self.create_repo = create_repo
        self.timeout_s = timeout_s
        self._cv = threading.Condition()
        self._pending: tuple[str, int, str] | None = None
        self._uploading: int | None = None  # the version whose push is in progress
        self._busy = False
        self._draining = False  # close() called: no more retries
        self._closed = False
        self._thread: threading.Thread | None = None
        self._repo_ready = False
        self.pushes = 0
        self.failures = 0  # failed attempts
        self.gave_up = 0  # versions abandoned after all retries
        self.skipped = 0  # pending versions superseded by a newer one
        self.last_pushed: int | None = None
        self.last_error: str | None = None

    @property
    def stats(self) -> dict:
        return {
            "repo_id": self.repo_id,
            "pushes": self.pushes,
            "failures": self.failures,
            "gave_up": self.gave_up,
            "skipped": self.skipped,
            "last_pushed": self.last_pushed,
            "last_error": self.last_error,
        }

    def in_use(self) -> set[int]:
        """The versions whose local folders must stay: uploading, pending, and the last one pushed."""
        with self._cv:
            pending = self._pending[1] if self._pending is not None else None
            return {v for v in (self._uploading, pending, self.last_pushed) if v is not None}

    def submit(self, folder: str | os.PathLike, version: int, commit_message: str | None = None) -> None:
        """Queue ``folder`` for upload; returns immediately (never raises for Hub trouble)."""
        msg = commit_message or f"AdaFlash drafter version {version}"
        with self._cv:
            if self._closed:
                logger.warning("hub publisher for %s is closed; version %s not pushed", self.repo_id, version)
                return
            if self._pending is not None:
                self.skipped += 1
            self._pending = (str(folder), int(version), msg)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="adaflash-hub-publisher", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until nothing is pending or uploading; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._pending is not None or self._busy:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cv.wait(remaining)
        return True

    def close(self, timeout: float | None = 10.0) -> bool:
        """Stop: no more retries; the attempt in flight and the pending version get up to ``timeout``
        seconds (``None``: no limit), then the thread ends. False when a push was left unfinished
        (its upload may still complete in the background; the local version stays either way)."""
        with self._cv:
            self._draining = True
            self._cv.notify_all()
        done = self.flush(timeout)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=0 if not done else 5.0)
        if not done:
            logger.warning("hub publisher for %s closed with a push unfinished after %ss; the local version stays",
                           self.repo_id, timeout)  # fmt: skip
        return done

    # ------------------------------------------------------------------ worker
    def _run(self) -> None:
        while True:
            with self._cv:
                while self._pending is None and not self._closed:
                    self._cv.wait()
                if self._pending is None:
                    return
                job, self._pending = self._pending, None
                self._uploading = job[1]
                self._busy = True
            try:
                self._push_with_retries(*job)
            except BaseException as e:  # noqa: BLE001 - never let the thread die silently
                self.gave_up += 1
                self.last_error = redact(f"{type(e).__name__}: {e}")
                logger.error("hub push of %s crashed: %s", self.repo_id, self.last_error)
            finally:
                with self._cv:
                    self._busy = False
                    self._uploading = None
                    self._cv.notify_all()

    def _sleep(self, attempt: int) -> bool:
        """Back off; returns False when the publisher is closing (no more retries then)."""
        delay = min(self.backoff_s * (2**attempt), self.max_backoff_s)
        with self._cv:
            self._cv.wait_for(lambda: self._draining or self._closed, timeout=delay)
            return not (self._draining or self._closed)

    def _push_with_retries(self, folder: str, version: int, message: str) -> None:
        from huggingface_hub import HfApi

        for attempt in range(self.max_retries + 1):
            try:
                api = HfApi()  # credentials: HF_TOKEN or `hf auth login`, never an argument
                if self.create_repo and not self._repo_ready:
                    api.create_repo(self.repo_id, repo_type="model", private=self.private, exist_ok=True)
                    self._repo_ready = True
                future = api.upload_folder(
                    repo_id=self.repo_id,
                    repo_type="model",
                    folder_path=folder,
                    commit_message=message,
                    run_as_future=True,
                )
                future.result(timeout=self.timeout_s) if hasattr(future, "result") else future
                with self._cv:
                    self.pushes += 1
                    self.last_pushed = version
                logger.info("pushed drafter version %s to %s", version, self.repo_id)
                return
            except Exception as e:  # noqa: BLE001 - Hub trouble must never reach serving
                self.failures += 1
                self.last_error = redact(f"{type(e).__name__}: {e}")
                last = attempt >= self.max_retries
                logger.warning(
                    "hub push of version %s to %s failed (attempt %d/%d): %s%s",
                    version, self.repo_id, attempt + 1, self.max_retries + 1, self.last_error,
                    "; giving up, the local copy stays" if last else "; retrying",
                )  # fmt: skip
                if last:
                    self.gave_up += 1
                    return
                if not self._sleep(attempt):
                    self.gave_up += 1
                    return
