"""A directory of numbered checkpoints: periodic saves, keep-last-N, resume from the newest
checkpoint that loads and verifies (saying which it skipped and why), and a save on SIGTERM
(spot reclaim, SageMaker stop, torchrun shutting down)."""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import sys
import threading
import warnings
from pathlib import Path

import jax
import numpy as np

from xtrain.checkpoint.integrity import CheckpointWarning
from xtrain.checkpoint.layout import CheckpointError
from xtrain.checkpoint.store import OLD, PARTIAL, check_complete
from xtrain.checkpoint.writer import SaveHandle
from xtrain.errors import OptionsError
from xtrain.runtime import sagemaker

# step_<N>, or step_<N>.old: a checkpoint a save of the same name was replacing when it stopped
_NAME = re.compile(rf"^step_(\d+)(?:{re.escape(OLD)})?$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointOptions:
    """How a CheckpointManager saves."""

    keep: int = 3
    """Complete checkpoints kept; older ones are deleted after each successful save (0: keep all)."""
    save_every: int = 0
    """`maybe_save` saves when the step count is a multiple of this (0: only explicit saves)."""
    async_save: bool = False
    """Write files in a background thread; the next save (or `wait()`) waits for it."""
    sigterm_grace_s: float = 20.0
    """After SIGTERM, seconds to wait for the current step to end (and the save to start)
    before exiting without a checkpoint: a step whose peer process is gone never ends, and
    torchrun kills its workers 30 s after its own SIGTERM."""

    def __post_init__(self):
        if self.keep < 0:
            raise OptionsError(f"CheckpointOptions.keep={self.keep} must be >= 0 (0 keeps every checkpoint)")
        if self.sigterm_grace_s <= 0:
            raise OptionsError(f"CheckpointOptions.sigterm_grace_s={self.sigterm_grace_s} must be > 0")
        if self.save_every < 0:
            raise OptionsError(f"CheckpointOptions.save_every={self.save_every} must be >= 0 (0: no periodic saves)")


class CheckpointManager:
    """Checkpoints of one run under `directory/step_<N>`.

        manager = CheckpointManager(ckpt_dir, CheckpointOptions(keep=3, save_every=100))
        extra = manager.restore(step) or {}          # resume if there is a checkpoint
        manager.stop_on_sigterm()
        for batch in batches(start=extra.get("next", 0)):
            step(*batch)
            manager.maybe_save(step, extra={"next": ...})   # saves, and exits cleanly after SIGTERM
    """

    def __init__(self, directory: str | os.PathLike | None = None, options: CheckpointOptions | None = None):
        """`directory`: where the checkpoints go; None: the SageMaker job's checkpoint directory
        (xtrain.runtime.sagemaker: configured by the estimator's `checkpoint_s3_uri`, synced
        to S3), an error outside a job that configured one."""
        self.directory = Path(directory if directory is not None else sagemaker.checkpoint_directory()).absolute()
        self.options = options or CheckpointOptions()
        self._pending: SaveHandle | None = None
        self._sigterm = self._watching = False
        self._saving = threading.Event()
        self.skipped: list[tuple[Path, str]] = []  # what the last restore() skipped, and why

    # -- finding -----------------------------------------------------------------------------
    def path_for(self, step_count: int) -> Path:
        return self.directory / f"step_{step_count:08d}"

    def candidates(self) -> list[Path]:
        """Every `step_<N>` directory, oldest first, complete or not; `step_<N>.old` stands for
        step N when `step_<N>` itself is missing (a save replacing it stopped between renames)."""
        if not self.directory.is_dir():
            return []
        found = {}
        for p in sorted(self.directory.iterdir(), key=lambda p: p.name.endswith(OLD)):
            match = _NAME.match(p.name)
            if match and p.is_dir():
                found.setdefault(int(match.group(1)), p)
        return [found[k] for k in sorted(found)]

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first (partial ones are never listed)."""
        found = []
        for p in self.candidates():
            try:
                found.append(check_complete(p))
            except CheckpointError:
                continue
        return found

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        done = self.complete()
        return done[-1] if done else None

    # -- saving ------------------------------------------------------------------------------
    def save(self, step, extra: dict | None = None) -> SaveHandle:
        """Saves `step` (a TrainStep) as `step_<its step count>`; prunes to the last `keep`."""
        self.wait()
        handle = step.save(self.path_for(step.step_count), extra=extra, blocking=not self.options.async_save)
        self._pending = handle
        if handle.done():
            self.wait()
        return handle

    def wait(self) -> None:
        """Waits for an async save to commit, then prunes old checkpoints."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.wait()
            self._prune()

    def _prune(self) -> None:
        if jax.process_index() != 0:
            return
        done = self.complete()
        if self.options.keep:
            for old in done[:-self.options.keep]:
                shutil.rmtree(old, ignore_errors=True)
        for suffix in (PARTIAL, OLD):  # leftovers of killed saves
            for stale in self.directory.glob(f"step_*{suffix}"):
                if stale.with_name(stale.name[:-len(suffix)]) in done:
                    shutil.rmtree(stale, ignore_errors=True)

    def maybe_save(self, step, extra: dict | None = None, *, exit_after_sigterm: bool = True) -> bool:
        """Saves every `save_every` steps, and after a SIGTERM (then exits with status 0 when
        `exit_after_sigterm`). Call it after each step, with the data position in `extra`.
        With `async_save` the periodic save is written while training goes on."""
        every = self.options.save_every
        stopping = self._stop_agreed()
        if stopping:
            self._saving.set()  # the watchdog stands down: the step ended, the save may take long
        if stopping or (every and step.step_count % every == 0):
            self.wait()  # after it every process sees the same committed checkpoints
            if self.path_for(step.step_count) not in self.complete():
                self.save(step, extra)
        if stopping:
            self.wait()
        if stopping and exit_after_sigterm:
            if jax.process_index() == 0:
                print(f"xtrain: SIGTERM: saved {self.latest()}, exiting", flush=True)
            raise SystemExit(0)
        return stopping

    # -- restarts ----------------------------------------------------------------------------
    def restore(self, step, *, verify: bool = True) -> dict | None:
        """Loads the newest checkpoint that is complete and verifies into `step`; returns its
        `extra` (None: no checkpoint at all). Newer ones that do not load (partial, corrupt,
        from another model) are skipped with a CheckpointWarning naming each and why
        (`self.skipped` keeps them); when none loads, a CheckpointError lists them all.

        Args:
            verify: check the bytes read against the checksums saved with them (False: trust
                the files, e.g. for a huge restore from storage you already trust)."""
        self.skipped = []
        for path in reversed(self.candidates()):
            try:
                extra = step.load(path, verify=verify)
            except CheckpointError as err:
                self.skipped.append((path, str(err)))
                continue
            if self.skipped:
                warnings.warn(f"CheckpointManager.restore loaded {path}, skipping newer checkpoints that do not load: "
                              f"{self._skipped_text()}", CheckpointWarning, stacklevel=2)
            return extra
        if self.skipped:
            raise CheckpointError(f"no checkpoint in {self.directory} loads: {self._skipped_text()}")
        return None

    def _skipped_text(self) -> str:
        return "; ".join(f"{path.name}: {reason}" for path, reason in self.skipped)

    def stop_on_sigterm(self) -> None:
        """After SIGTERM, the next `maybe_save` saves and exits cleanly (status 0).

        The signal only sets a flag: saving inside the handler could interrupt a step halfway,
        and every process must save at the same step. A step blocked in a collective whose peer
        died never returns to Python, so a watchdog thread (woken through the signal wakeup fd,
        which works while the main thread is blocked) exits the process with status 143 if no
        step ends within `sigterm_grace_s`."""
        if self._watching:
            return
        read, write = os.pipe()
        os.set_blocking(write, False)
        signal.set_wakeup_fd(write)
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self._watching = True
        threading.Thread(target=self._watchdog, args=(read,), name="xtrain-sigterm-watchdog", daemon=True).start()

    def _on_sigterm(self, signum, frame) -> None:
        self._sigterm = True

    def _watchdog(self, fd: int) -> None:
        while signal.SIGTERM not in os.read(fd, 64):
            pass
        if not self._saving.wait(self.options.sigterm_grace_s):
            print(f"xtrain: SIGTERM: no step ended within {self.options.sigterm_grace_s} s (a peer process is "
                  "gone?); exiting without a checkpoint", file=sys.stderr, flush=True)
            os._exit(128 + signal.SIGTERM)

    def _stop_agreed(self) -> bool:
        """Whether any process got SIGTERM; agreed by all so that every process saves at the
        same step even when the signal reaches them on either side of a step."""
        if not self._watching or jax.process_count() == 1:
            return self._sigterm
        from jax.experimental import multihost_utils

        return bool(multihost_utils.process_allgather(np.int32(self._sigterm)).any())

    @property
    def sigterm_received(self) -> bool:
        return self._sigterm
