"""Training an online update in a second process, so that its Python never holds the serving loop's GIL.

With ``OnlineConfig(trainer="process")`` the adapter's worker thread hands each update's samples to a child process
(spawned at the first update) that trains the shadow there and sends its weights back; the guard, the swap, the
rollback and publishing stay in the serving process exactly as with ``trainer="thread"``, on a local shadow that
receives the child's weights after every update. The child is given the target and the serving drafter through
``torch.multiprocessing``, which shares their storage (CUDA IPC on GPU, shared memory on CPU) instead of copying
it, so a second target costs no memory (the target it is given is the trainer's: with a ``trainer_device`` of its own,
the copy there, :mod:`~adaflash_hf.online.placement`; on CPU the trainer moves both models into shared memory when it is made,
before anything serves: moved later, their old memory would be freed under a forward reading it); it rebuilds its
shadow from the serving weights whenever the adapter's own is reset (a refusal, a rollback, a failure).

Why: an update trained in a thread beside the engine slows serving even while the GPU has room: the loss is the
one interpreter both Python loops share, not the GPU.

The spawned child imports the program's main module, as every ``multiprocessing`` spawn does: a script that makes
an adapter with ``trainer="process"`` keeps its entry point under ``if __name__ == "__main__":``.

Example:
    >>> adapter = OnlineAdapter(drafter, target, OnlineConfig(trainer="process"))  # doctest: +SKIP
    >>> adapter.trainer  # a ProcessTrainer around adapter.worker, the ShadowTrainer here  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
import signal

import torch
import torch.multiprocessing as mp
from torch import nn

from .buffer import Sample
from .config import OnlineConfig
from .placement import model_tensors, rebuild
from .worker import NonFiniteLossError, ShadowTrainer, UpdateAbandoned

__all__ = ["ProcessTrainer", "SharedMemoryTooSmall"]

logger = logging.getLogger("adaflash_hf.online")

_SHM = "/dev/shm"
_POLL_S = 0.05  # how often the waiting worker thread checks for a close or a dead child


class SharedMemoryTooSmall(RuntimeError):
    """``/dev/shm`` cannot hold the models a CPU trainer process shares (raised before anything moves)."""

    remedy = "use trainer='thread' (--trainer thread), or enlarge /dev/shm (docker run --shm-size)"

    def __init__(self, need: int, free: int, path: str):
        self.problem = (f"the online trainer process needs {need / 2**30:.2f} GiB of shared memory for the models on "
                        f"the CPU; {path} has {free / 2**30:.2f} GiB free")
        super().__init__(f"{self.problem}: {self.remedy}")


class ProcessTrainer:
    """Trains ``local``'s shadow in a child process (module doc): :meth:`train` sends the samples to the child and
    loads the weights it sends back into ``local.shadow``; everything else (the guard's measurements, the shadow that
    is swapped in, kept aside or published) is ``local``'s, in this process. :meth:`reset` goes through here, so
    that the child rebuilds its shadow too.

    Example:
        >>> trainer = ProcessTrainer(ShadowTrainer(drafter, target, OnlineConfig()))  # doctest: +SKIP
        >>> trainer.train(samples, 1)  # trained in the child; trainer.local.shadow holds the result  # doctest: +SKIP
        >>> trainer.close()  # doctest: +SKIP
    """

    def __init__(self, local: ShadowTrainer):
        self.local = local
        share_cpu_memory(local.target, local.drafter)  # now, before serving reads them (module doc); the trainer's target
        self.process: mp.Process | None = None
        self._conn = None
        self._stop = None
        self._child_fresh = True  # the child must rebuild its shadow from the serving weights

    def reset(self) -> None:
        """Drop the local shadow, and have the child rebuild its own from the serving weights at its next update."""
        self.local.reset()
        self._child_fresh = True

    def _start_child(self) -> None:
        local = self.local
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._stop = ctx.Event()
        config = local.config.replace(trainer_device=local.device, output_dir=None, hub_repo=None)  # train on this device
        process = ctx.Process(target=_child_main, name="adaflash-online-trainer", daemon=True,
                              args=(child_conn, self._stop, portable(local.drafter), portable(local.target), config,
                                    torch.get_num_threads()))
        try:
            process.start()  # pickles the models' tensors: a failure here fails the update, nothing is left started
        finally:
            child_conn.close()
        self.process, self._child_fresh = process, True

    def train(self, samples: list[Sample], update_index: int, should_stop=lambda: False) -> dict:
        """:meth:`ShadowTrainer.train`'s contract, the training in the child."""
        shadow, _ = self.local.ensure_shadow()  # the local copy that receives the child's weights
        if self.process is None or not self.process.is_alive():
            self._start_child()
        self._stop.clear()
        self._conn.send(("train", samples, update_index, self._child_fresh))
        kind, payload = self._reply(should_stop)
        if kind == "ok":
            result, state = payload
            shadow.load_state_dict(state)
            self._child_fresh = False
            return result
        self.reset()
        if kind == "abandoned":
            raise UpdateAbandoned("the adapter is closing")
        if kind == "nonfinite":
            raise NonFiniteLossError(payload)
        raise RuntimeError(f"the online trainer process failed: {payload}")

    def _reply(self, should_stop) -> tuple[str, object]:
        """The child's answer to one update; a close asks it to stop at its next step; a dead child is a failure
        (the next update starts a new one)."""
        while not self._conn.poll(_POLL_S):
            if should_stop():
                self._stop.set()
            if not self.process.is_alive():
                break
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            self.process.join(5)
            code = self.process.exitcode
            self._drop_child()
            return "died", f"it died during the update (exit code {code})"

    def _drop_child(self) -> None:
        if self.process is not None:
            if self.process.is_alive():
                self.process.kill()
            self.process.join(5)
        self.process, self._child_fresh = None, True

    def close(self, timeout: float | None = 10.0) -> None:
        """Stop the child: asked first, killed after ``timeout`` seconds."""
        if self.process is None:
            return
        try:
            self._stop.set()
            self._conn.send(("close",))
        except (OSError, ValueError):
            pass
        self.process.join(timeout)
        self._drop_child()


def _unshared(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and not t.is_shared()


def share_cpu_memory(*models: nn.Module) -> None:
    """Move the models' CPU tensors into shared memory, in place. Only while nothing reads them: the move frees the
    old memory under any forward running in another thread. Refused before any move when ``/dev/shm`` (where torch
    puts it on Linux) has too little room: a full one kills the process with SIGBUS mid-copy instead."""
    # one tensor per storage: moving it moves every view of that storage (tied and fused weights) with it
    loose = {t.untyped_storage().data_ptr(): t for m in models for _, t in model_tensors(m) if _unshared(t)}
    need = sum(t.untyped_storage().nbytes() for t in loose.values())
    if need and os.path.isdir(_SHM):
        fs = os.statvfs(_SHM)
        free = fs.f_bavail * fs.f_frsize
        if need > free:
            raise SharedMemoryTooSmall(need, free, _SHM)
    for t in loose.values():
        t.share_memory_()


def portable(model: nn.Module) -> tuple:
    """``(class, config, tensors)``: what rebuilds ``model`` in another process around the same memory
    (:func:`~adaflash_hf.online.placement.rebuild`). Its runtime state stays behind: transformers' output-capturing
    hooks are local functions that pickle refuses, and a compiled or hooked module is not the object to train from anyway.

    A CPU tensor outside shared memory is sent as a shared copy: pickling it as it is would move its storage into
    shared memory in place, freeing the memory a serving forward may be reading at that moment."""
    sent: dict[int, torch.Tensor] = {}  # by the tensor's identity: a tied weight stays one tensor in the child
    for name, t in model_tensors(model):
        if id(t) not in sent:
            sent[id(t)] = t.detach().clone().share_memory_() if _unshared(t) else t.detach()
    return type(model), model.config, {name: sent[id(t)] for name, t in model_tensors(model)}


def _child_main(conn, stop, drafter_parts, target_parts, config: OnlineConfig, threads: int) -> None:
    """The child's loop: one update per message until ``close`` or the parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the whole group: the parent decides
    torch.set_num_threads(threads)  # the serving process's CPU threads, not a second full set beside it
    parent = os.getppid()
    target, drafter = rebuild(*target_parts), rebuild(*drafter_parts)
    for _, _, tensors in (target_parts, drafter_parts):
        # The Process object keeps its arguments until exit: emptied here, the shared tensors are released with the
        # models when this function returns, not at interpreter teardown (where CUDA IPC warns of unreleased memory).
        tensors.clear()
    trainer = ShadowTrainer(drafter.bind_target(target), target, config)
    while True:
        if not conn.poll(1.0):
            if os.getppid() != parent:
                return
            continue
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message[0] == "close":
            return
        _, samples, update_index, fresh = message
        if fresh:
            trainer.reset()
        try:
            result = trainer.train(samples, update_index, should_stop=stop.is_set)
            state = {k: v.detach().to("cpu", copy=True) for k, v in trainer.shadow.state_dict().items()}
            reply = ("ok", (result, state))
        except UpdateAbandoned:
            reply = ("abandoned", None)
        except NonFiniteLossError as e:
            reply = ("nonfinite", str(e))
        except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the update
            logger.exception("online trainer process: the update failed")
            reply = ("error", f"{type(e).__name__}: {e}")
        if reply[0] != "ok":
            trainer.reset()
        conn.send(reply)
