"""Data loading for training steps: resumable position, prefetch to devices, optional bucketing.

Two sources, one interface (iterate for placed global batches; `state_dict()` /
`load_state_dict()` for the position, a JSON-able dict the checkpoint stores):

- `Loader(source, step=step)`: the user's global batches: an iterable (a list, a torch
  DataLoader) or a function `epoch -> iterable`. Every process iterates the same batches; each
  materialises only its own devices' slices. Resume replays the source and skips what was
  consumed, so it is exact whenever iterating the source again gives the same stream (a torch
  DataLoader with `generator=torch.Generator().manual_seed(s)`, or `epoch -> DataLoader` seeded
  by epoch, which also makes the skip cheap: only the current epoch is replayed).
- `ShardedLoader(dataset, batch_size=..., step=step)`: per-process loading from a map-style
  dataset (`len(ds)`, `ds[i]` -> one sample). The global batch of step t is a slice of a
  seeded per-epoch permutation, so the position is one integer and resume costs nothing; each
  process reads only the samples of the rows its devices hold.

Both prefetch: a background thread pads, converts and places the next `prefetch` batches on
the devices while the current step runs (JAX releases the GIL while a step executes).
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterable, Iterator, Mapping

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from xtrain import data
from xtrain.buckets import Buckets
from xtrain.errors import BatchTypeError, InputError, OptionsError, PlanError
from xtrain.sharding.plan import Spec, axes_of

_DONE = object()


def _placement(step, mesh, batch_spec: Spec | None) -> tuple[jax.sharding.Mesh | None, Spec]:
    """(jax mesh, batch spec) from a compiled step, or from an explicit mesh (xtrain or jax)."""
    if step is not None:
        return step.mesh, step.batch_spec
    if mesh is not None and hasattr(mesh, "build"):
        mesh = mesh.build()
    spec = tuple(batch_spec) if batch_spec is not None else (("data",) if mesh is not None else ())
    if mesh is not None:
        unknown = [a for e in spec for a in axes_of(e) if a not in mesh.shape]
        if unknown:
            raise PlanError(f"batch_spec={spec} names mesh axes {unknown} that the mesh "
                            f"({dict(mesh.shape)}) lacks; use axes of the mesh")
    return mesh, spec


def prefetched(items: Iterator, depth: int) -> Iterator:
    """Yields `items` in order while a background thread computes the next `depth` of them."""
    if depth <= 0:
        yield from items
        return
    slots: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(entry) -> bool:
        while not stop.is_set():
            try:
                slots.put(entry, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        try:
            for item in items:
                if not put((item, None)):
                    return
            put((_DONE, None))
        except BaseException as err:  # handed to the consumer, raised there
            put((_DONE, err))

    threading.Thread(target=work, name="xtrain-prefetch", daemon=True).start()
    try:
        while True:
            item, err = slots.get()
            if err is not None:
                raise err
            if item is _DONE:
                return
            yield item
    finally:
        stop.set()  # the consumer stopped early (break, exception): let the thread end


class _Resumable:
    """Position bookkeeping and prefetch shared by both loaders; subclasses produce batches.

    One pipeline (producer + prefetch thread) serves every iteration until the position is
    reset, so a loop that stops and a later loop that continues see one unbroken stream, and no
    prefetched batch is lost, whatever the source."""

    def __init__(self, prefetch: int):
        if prefetch < 0:
            raise OptionsError(f"prefetch={prefetch}: give the number of batches to prepare ahead (0 = none)")
        self.prefetch = prefetch
        self._pipeline: Iterator | None = None

    def __iter__(self) -> Iterator[tuple]:
        """Placed global batches from the current position on; the position advances as each
        batch is handed out (batches prefetched but not consumed do not count), so iterating
        again continues where the last iteration stopped."""
        if self._pipeline is None:
            self._pipeline = prefetched(self._produce(), self.prefetch)
        for position, batch in self._pipeline:
            self._position = position
            yield batch

    def _restart(self) -> None:
        """A new position: the running pipeline (and what it prefetched) is dropped."""
        if self._pipeline is not None:
            self._pipeline.close()
            self._pipeline = None

    def _produce(self) -> Iterator[tuple[Any, tuple]]:
        raise NotImplementedError


class Loader(_Resumable):
    """The user's global batches, placed on the mesh ahead of the step.

    Args:
        source: an iterable of global batches (tuples of the step's arguments, torch or numpy),
            e.g. a list or a torch DataLoader; or a function `epoch -> iterable`.
        step: the compiled step whose mesh and batch layout the batches take (or give `mesh`
            and `batch_spec`; with neither, batches stay on the host as numpy).
        buckets: pad variable-length batches to these shapes (xtrain.buckets.Buckets).
        prefetch: batches prepared ahead by a background thread (0: none).
        epochs: passes over the source in all (None: repeat until the training loop stops).
    """

    def __init__(self, source: Iterable | Callable[[int], Iterable], *, step=None, mesh=None,
                 batch_spec: Spec | None = None, buckets: Buckets | None = None, prefetch: int = 2,
                 epochs: int | None = None):
        super().__init__(prefetch)
        self.source, self.buckets, self.epochs = source, buckets, epochs
        self.mesh, self.batch_spec = _placement(step, mesh, batch_spec)
        self._position = (0, 0)  # (epoch, batches consumed in that epoch)

    def state_dict(self) -> dict:
        epoch, batch = self._position
        return {"kind": "Loader", "epoch": epoch, "batch": batch}

    def load_state_dict(self, state: dict) -> None:
        """Resume at a saved position: the next iteration starts with the batch after it."""
        if state.get("kind") != "Loader":
            raise InputError(f"a Loader cannot resume from a {state.get('kind')!r} position {state}")
        self._restart()
        self._position = (int(state["epoch"]), int(state["batch"]))

    def _per_epoch_function(self) -> bool:
        return callable(self.source) and not hasattr(self.source, "__iter__")

    def _epoch(self, epoch: int) -> Iterator:
        return iter(self.source(epoch)) if self._per_epoch_function() else iter(self.source)

    def _produce(self) -> Iterator[tuple[tuple[int, int], tuple]]:
        epoch, skip = self._position
        if not self._per_epoch_function():
            self._replay(epoch)
        while self.epochs is None or epoch < self.epochs:
            batches = self._epoch(epoch)
            count = self._skip(batches, skip, epoch)
            for batch in batches:
                count += 1
                yield (epoch, count), self.place(batch)
            if count == 0 or batches is self.source:  # an empty epoch, or a one-shot iterator
                return
            epoch, skip = epoch + 1, 0

    def _replay(self, epochs: int) -> None:
        """Iterates the earlier epochs of a re-iterable source (a seeded DataLoader draws each
        epoch's shuffle from its generator, so skipping them would change the order)."""
        for epoch in range(epochs):
            batches = iter(self.source)
            if batches is self.source:
                raise InputError(f"cannot resume at epoch {epochs}: the source is a one-shot iterator "
                                 f"({type(self.source).__name__}); pass a re-iterable or `epoch -> iterable`")
            for _ in batches:
                pass

    def _skip(self, batches: Iterator, count: int, epoch: int) -> int:
        for done in range(count):
            if next(batches, _DONE) is _DONE:
                raise InputError(f"cannot resume at batch {count} of epoch {epoch}: the source yields "
                                 f"only {done} batches in that epoch; is it the same data?")
        return count

    def place(self, batch: Any) -> tuple:
        """Pads (buckets) and places one global batch on the mesh."""
        if isinstance(batch, Mapping):
            raise BatchTypeError(
                f"a batch is a tuple of the step's positional arguments, got a dict with keys "
                f"{sorted(batch)}; give the Loader e.g. ((b['input_ids'], b['labels']) for b in source)")
        batch = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
        if self.buckets is not None:
            batch = self.buckets.pad(batch)
        if self.mesh is None:
            return tuple(data.to_numpy(x) if x is not None else x for x in batch)
        return data.shard_batch(batch, self.mesh, self.batch_spec)


class ShardedLoader(_Resumable):
    """Per-process loading: each process reads only the samples its devices train on.

    Global batch t holds samples `order(epoch)[k*B:(k+1)*B]` (epoch, k = divmod(t, len(ds)//B)),
    where `order` is a permutation seeded by (seed, epoch), or the identity without shuffle;
    an incomplete last batch of an epoch is dropped so every step has the same shape.

    Args:
        dataset: map-style: `len(dataset)` and `dataset[i]` -> one sample (a tuple of arrays
            without the batch axis, or one array).
        batch_size: the global batch (all processes), a multiple of the batch's mesh axes.
        step: where batches go (as in Loader; a mesh, given or the step's, is required here).
        mesh: the mesh, when no step is given.
        batch_spec: the batch's layout over the mesh (as in Loader).
        buckets: pad variable-length samples (xtrain.buckets.Buckets). Every process must pad to
            the same length: with several processes give `lengths` (each sample's length, read
            without loading it), else batches are padded to the largest bucket.
        lengths: per-sample sequence lengths, for bucketing across processes.
        seed: seeds the sample order.
        shuffle: False keeps the dataset's order.
        prefetch: batches prepared ahead by a background thread (0: none).
    """

    def __init__(self, dataset, *, batch_size: int, step=None, mesh=None, batch_spec: Spec | None = None,
                 buckets: Buckets | None = None, lengths=None, seed: int = 0, shuffle: bool = True,
                 prefetch: int = 2):
        super().__init__(prefetch)
        self.mesh, self.batch_spec = _placement(step, mesh, batch_spec)
        if self.mesh is None:
            raise OptionsError("ShardedLoader needs step=<compiled step> or mesh=: it reads each process's rows")
        self.dataset, self.batch_size, self.seed, self.shuffle = dataset, batch_size, seed, shuffle
        self.buckets, self.lengths = buckets, None if lengths is None else np.asarray(lengths)
        self.steps_per_epoch = len(dataset) // batch_size
        if self.steps_per_epoch == 0:
            raise InputError(f"the dataset has {len(dataset)} samples, fewer than one global batch of {batch_size}")
        data.check_divisible(0, (batch_size,), self.batch_spec, self.mesh)
        self.rows = data.process_rows((batch_size,), self._sharding(1))
        self._position = 0  # global batches consumed

    def state_dict(self) -> dict:
        return {"kind": "ShardedLoader", "step": self._position, "seed": self.seed, "shuffle": self.shuffle,
                "batch_size": self.batch_size, "samples": len(self.dataset)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "ShardedLoader":
            raise InputError(f"a ShardedLoader cannot resume from a {state.get('kind')!r} position {state}")
        mine = self.state_dict()
        changed = {k: (state[k], mine[k]) for k in ("seed", "shuffle", "batch_size", "samples") if state[k] != mine[k]}
        if changed:
            raise InputError("the saved data position was taken with a different loader: "
                             + ", ".join(f"{k} saved {a!r}, now {b!r}" for k, (a, b) in changed.items())
                             + "; resume with the same dataset, seed, shuffle and batch_size")
        self._restart()
        self._position = int(state["step"])

    def global_indices(self, t: int) -> np.ndarray:
        """The dataset indices of global batch `t`, in batch order."""
        epoch, k = divmod(t, self.steps_per_epoch)
        n = len(self.dataset)
        order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
        return order[k * self.batch_size:(k + 1) * self.batch_size]

    def _produce(self) -> Iterator[tuple[int, tuple]]:
        t = self._position
        while True:
            yield t + 1, self.load(t)
            t += 1

    def load(self, t: int) -> tuple:
        """Reads this process's samples of global batch `t` and assembles the global arrays."""
        indices = self.global_indices(t)
        samples = [_as_tuple(self.dataset[int(i)]) for i in indices[self.rows]]
        columns = [list(col) for col in zip(*samples)]  # per argument: this process's rows
        if self.buckets is not None:
            columns = list(self.buckets.pad(columns, self._bucket_length(indices, columns)))
        else:
            columns = [_stack(col, arg) for arg, col in enumerate(columns)]
        return tuple(self._global(np.asarray(col)) for col in columns)

    def _bucket_length(self, indices: np.ndarray, columns: list) -> int | None:
        if self.lengths is not None:
            return self.buckets.length_for(int(self.lengths[indices].max()))
        if jax.process_count() == 1:
            return None  # every row is local: the batch's own bucket
        return self.buckets.lengths[-1]

    def _sharding(self, ndim: int) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec(*self.batch_spec[:ndim]))

    def _global(self, local: np.ndarray) -> jax.Array:
        """This process's rows (in `self.rows` order) -> the global batch array on the mesh."""
        local = data.to_numpy(local)
        where = {row: k for k, row in enumerate(self.rows)}
        shape = (self.batch_size, *local.shape[1:])

        def shard(index: tuple) -> np.ndarray:
            rows = range(*index[0].indices(self.batch_size)) if index else range(self.batch_size)
            return local[[where[r] for r in rows]][(slice(None), *index[1:])]

        return jax.make_array_from_callback(shape, self._sharding(local.ndim), shard)


def _as_tuple(sample: Any) -> tuple:
    return tuple(sample) if isinstance(sample, (tuple, list)) else (sample,)


def _stack(rows: list, arg: int) -> np.ndarray:
    shapes = {tuple(np.shape(r)) for r in rows}
    if len(shapes) > 1:
        raise InputError(f"samples of argument {arg} have different shapes {sorted(shapes)[:4]}; pad them to "
                         f"a few shapes with buckets=xtrain.buckets.Buckets(lengths=..., pad_values=...)")
    return np.stack([data.to_numpy(r) for r in rows])
