"""Online adaptation: distil the serving drafter from verification feedback, hot-swap, publish.

- :class:`OnlineAdapter` (``adapter.py``): the `RoundSink` that buffers finished requests (or
  verified rounds) and swaps trained weights in between rounds; :class:`OnlineConfig`
  (``config.py``) holds its settings; ``worker.py`` trains the shadow drafter in the background
  through the offline training objective, in a thread or (``trainer_process.py``) a child process; ``guard.py`` swaps an update in only if it does not lower
  acceptance on held-back requests, and rolls a swap back when served tau falls after it; ``lock.py``
  is the round lock. The adapter composes them: its :class:`~.update_loop.UpdateLoop` (``update_loop.py``) trains,
  judges, swaps and publishes on its worker thread, recording into :class:`OnlineCounters` (``counters.py``).
- :class:`ReplayBuffer` (``buffer.py``): bounded by samples and bytes; what a sample costs.
- :class:`VersionStore` / :func:`latest_version` (``versions.py``): atomic, checksummed numbered versions;
  ``resume.py``: a restarted adapter serves the newest version that checks out;
  :class:`VersionPublisher` (``publish.py``): a version + its card + its Hub push, for the adapter
  and the callback alike.
- :class:`HubPublisher` (``hub.py``): background, retried, token-safe Hub uploads + model card.
- :class:`OnlineAdapterCallback` (``callback.py``): the same versions / pushes from a
  ``transformers.Trainer`` run.
- :func:`adapt_from_jsonl` (``external.py``): adapt from SGLang / vLLM traffic logs.
"""

from .adapter import OnlineAdapter
from .counters import OnlineCounters, UpdateRecord
from .buffer import ReplayBuffer, RequestSample, Sample, estimate_sample_bytes
from .callback import OnlineAdapterCallback
from .config import OnlineConfig
from .external import adapt_from_jsonl, rounds_from_response
from .hub import HubPublisher, redact, render_card
from .lock import RoundLock
from .publish import VersionPublisher
from .versions import VersionStore, latest_version, list_versions
from .worker import NonFiniteLossError

__all__ = [
    "HubPublisher",
    "NonFiniteLossError",
    "OnlineAdapter",
    "OnlineAdapterCallback",
    "OnlineConfig",
    "OnlineCounters",
    "ReplayBuffer",
    "RequestSample",
    "RoundLock",
    "Sample",
    "UpdateRecord",
    "VersionPublisher",
    "VersionStore",
    "adapt_from_jsonl",
    "estimate_sample_bytes",
    "latest_version",
    "list_versions",
    "redact",
    "render_card",
    "rounds_from_response",
]
