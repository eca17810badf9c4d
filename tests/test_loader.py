"""xtrain.loader: resumable position (with shuffling), prefetch order and overlap, per-process
rows (real jax process/device mapping, and a real 2-process torchrun job), bucketing into a
few shapes with no recompilation."""
import json
import subprocess
import sys
import threading
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from jax.sharding import PartitionSpec

import xtrain
from xtrain.buckets import IGNORE_INDEX, Buckets
from xtrain.cli import free_port_pair
from xtrain.errors import BatchTypeError, InputError, OptionsError, PlanError
from xtrain.loader import Loader, ShardedLoader, prefetched

from models import GPT

TESTS = Path(__file__).resolve().parent


def rank_coded(n: int, batch: int = 16, width: int = 3) -> list[tuple[np.ndarray, np.ndarray]]:
    """Batches whose every value says which batch and row it came from (reveals misordering)."""
    return [(np.arange(batch * width, dtype=np.float32).reshape(batch, width) + 1000 * b,
             np.arange(batch, dtype=np.int64) + 1000 * b) for b in range(n)]


def as_host(batch) -> tuple:
    return tuple(np.asarray(x) for x in batch)


def take(loader, n: int) -> list[tuple]:
    return [as_host(b) for _, b in zip(range(n), loader)]


def assert_same_stream(got: list[tuple], want: list[tuple]) -> None:
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        for a, b in zip(g, w):
            assert np.array_equal(a, b), f"batch {k} differs"


# -- the user's global batches --------------------------------------------------------------

@pytest.mark.unit
def test_loader_places_batches_on_the_mesh_in_order():
    source = rank_coded(5)
    loader = Loader(source, mesh=xtrain.Mesh(data=8), prefetch=2, epochs=1)
    got = list(loader)
    assert all(x.sharding.spec == PartitionSpec("data") and len(x.sharding.device_set) == 8 for b in got for x in b)
    assert_same_stream([as_host(b) for b in got], [(x, y.astype(np.int32)) for x, y in source])
    assert loader.state_dict() == {"kind": "Loader", "epoch": 0, "batch": 5}


def torch_loader(seed: int = 7) -> torch.utils.data.DataLoader:
    """A shuffling DataLoader (5 batches of 8 per epoch) whose order comes from a seeded generator."""
    data = torch.arange(40 * 3, dtype=torch.float32).reshape(40, 3)
    dataset = torch.utils.data.TensorDataset(data, torch.arange(40))
    return torch.utils.data.DataLoader(dataset, batch_size=8, shuffle=True,
                                       generator=torch.Generator().manual_seed(seed))


@pytest.mark.unit
@pytest.mark.parametrize("stop_at", [3, 7])  # inside the first epoch, and inside the second
def test_loader_resumes_a_shuffled_torch_dataloader_exactly(stop_at):
    mesh = xtrain.Mesh(data=8)
    want = take(Loader(torch_loader(), mesh=mesh), 12)  # 2.4 epochs, uninterrupted

    first = Loader(torch_loader(), mesh=mesh, prefetch=2)
    head = take(first, stop_at)
    saved = json.loads(json.dumps(first.state_dict()))  # stored as JSON by the checkpoint
    assert saved == {"kind": "Loader", "epoch": stop_at // 5, "batch": stop_at % 5}

    resumed = Loader(torch_loader(), mesh=mesh, prefetch=2)  # a new process: a fresh generator
    resumed.load_state_dict(saved)
    assert_same_stream(head + take(resumed, 12 - stop_at), want)
    assert want[0][1].tolist() != want[5][1].tolist()  # the epochs really are shuffled differently


@pytest.mark.unit
def test_loader_resumes_an_epoch_function():
    def batches(epoch):  # each epoch's order from its own seed: resume replays only that epoch
        return torch_loader(seed=100 + epoch)

    want = take(Loader(batches, prefetch=0), 9)
    first = Loader(batches)
    head = take(first, 6)
    resumed = Loader(batches)
    resumed.load_state_dict(first.state_dict())
    assert_same_stream(head + take(resumed, 3), want)


@pytest.mark.unit
def test_loader_refuses_a_position_its_source_cannot_reach():
    loader = Loader(rank_coded(3), epochs=1)
    loader.load_state_dict({"kind": "Loader", "epoch": 0, "batch": 5})
    with pytest.raises(InputError, match="resume at batch 5 of epoch 0: the source yields only 3 batches"):
        next(iter(loader))
    with pytest.raises(InputError, match="a Loader cannot resume from a 'ShardedLoader' position"):
        loader.load_state_dict({"kind": "ShardedLoader", "step": 1})
    one_shot = Loader(iter(rank_coded(3)))
    one_shot.load_state_dict({"kind": "Loader", "epoch": 1, "batch": 0})
    with pytest.raises(InputError, match="cannot resume at epoch 1: the source is a one-shot iterator"):
        next(iter(one_shot))


@pytest.mark.unit
def test_loader_resumes_a_generator_and_continues_where_it_stopped():
    want = [as_host(b) for b in Loader(iter(rank_coded(6)))]  # a one-shot iterator: one pass
    first = Loader(iter(rank_coded(6)), prefetch=2)
    head = take(first, 2) + take(first, 1)  # a second iteration continues the first
    resumed = Loader(iter(rank_coded(6)))  # the new process makes its generator again
    resumed.load_state_dict(first.state_dict())
    assert_same_stream(head + [as_host(b) for b in resumed], want)


@pytest.mark.unit
def test_placement_errors_name_the_fix():
    with pytest.raises(PlanError, match=r"batch_spec=\('batch',\) names mesh axes \['batch'\] that the mesh"):
        Loader([], mesh=xtrain.Mesh(data=8), batch_spec=("batch",))
    with pytest.raises(BatchTypeError, match=r"got a dict with keys \['input_ids', 'labels'\]; give the Loader e.g."):
        next(iter(Loader([{"labels": np.zeros(8), "input_ids": np.zeros(8)}], prefetch=0)))
    with pytest.raises(OptionsError, match="ShardedLoader needs step=<compiled step> or mesh="):
        ShardedLoader(Samples(), batch_size=8)
    with pytest.raises(InputError, match="the dataset has 50 samples, fewer than one global batch of 64"):
        ShardedLoader(Samples(), batch_size=64, mesh=xtrain.Mesh(data=8))
    with pytest.raises(InputError, match="global batch 12 is not divisible by mesh axis data=8"):
        ShardedLoader(Samples(), batch_size=12, mesh=xtrain.Mesh(data=8))


@pytest.mark.unit
def test_the_step_takes_placed_batches_as_they_are_and_re_places_others():
    from xtrain.data import shard_batch

    mesh = xtrain.Mesh(data=8).build()
    placed = Loader(rank_coded(1), mesh=mesh, prefetch=0).place(rank_coded(1)[0])
    again = shard_batch(placed, mesh, ("data",))
    assert all(a is b for a, b in zip(again, placed))  # no copy of a batch the loader placed
    on_one_device = jax.device_put(np.arange(16.0), jax.devices()[3])
    [moved] = shard_batch((on_one_device,), mesh, ("data",))
    assert moved.sharding.spec == PartitionSpec("data") and np.array_equal(np.asarray(moved), np.arange(16.0))


# -- per-process loading ---------------------------------------------------------------------

class Samples:
    """A map-style dataset that records which samples it was asked for."""

    def __init__(self, n: int = 50, width: int = 3):
        self.n, self.width, self.read = n, width, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.read.append(i)
        return np.full(self.width, i, dtype=np.float32), np.int64(i)


@pytest.mark.unit
def test_sharded_loader_resumes_with_shuffling_by_seed():
    mesh = xtrain.Mesh(data=8)
    want = take(ShardedLoader(Samples(), batch_size=16, step=None, mesh=mesh, seed=3), 7)  # 3 per epoch
    first = ShardedLoader(Samples(), batch_size=16, mesh=mesh, seed=3)
    head = take(first, 4)
    resumed = ShardedLoader(Samples(), batch_size=16, mesh=mesh, seed=3)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert_same_stream(head + take(resumed, 3), want)
    epoch0 = np.concatenate([b[1] for b in want[:3]])
    assert len(set(epoch0.tolist())) == 48 and epoch0.tolist() != sorted(epoch0.tolist())  # shuffled, no repeats
    assert not np.array_equal(want[0][1], want[3][1])  # epoch 1 has its own order
    other = ShardedLoader(Samples(), batch_size=16, mesh=mesh, seed=4)
    with pytest.raises(InputError, match="seed saved 3, now 4; resume with the same dataset"):
        other.load_state_dict(first.state_dict())


@pytest.mark.unit
def test_sharded_loader_reads_only_the_rows_of_its_devices():
    """One process holds all 8 devices here, so it must read the whole batch; the rows each
    device gets come from the real jax sharding of the batch (checked per device)."""
    mesh = xtrain.Mesh(data=4, tensor=2)
    dataset = Samples()
    loader = ShardedLoader(dataset, batch_size=8, mesh=mesh, batch_spec=("data",), shuffle=False, prefetch=0)
    x, y = next(iter(loader))
    assert loader.rows == list(range(8)) and sorted(dataset.read) == list(range(8))
    for shard in y.addressable_shards:  # data position d of Mesh(data=4, tensor=2) holds rows 2d, 2d+1
        rows = range(*shard.index[0].indices(8))
        assert len(rows) == 2 and np.asarray(shard.data).tolist() == list(rows)
        assert np.asarray(x.addressable_shards[0].data).shape == (2, 3)


@pytest.mark.multiprocess
def test_sharded_loader_across_two_real_processes(tmp_path):
    out = tmp_path / "rows.json"
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env["PYTHONPATH"] = str(TESTS.parent)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port_pair()}",
           str(TESTS / "_loader_worker.py"), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"torchrun exited with {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    result = json.loads(out.read_text())
    reference = ShardedLoader(Samples(), batch_size=16, mesh=xtrain.Mesh(data=8), seed=5)
    for t, batch in enumerate(result["batches"]):
        want = reference.global_indices(t).tolist()
        assert batch["gathered"] == want  # the global array equals the global batch
        # each process read exactly the half of the batch that its 4 devices hold
        assert batch["read"] == [sorted(want[:8]), sorted(want[8:])], batch
    assert result["rows"] == [list(range(8)), list(range(8, 16))]


# -- prefetch ---------------------------------------------------------------------------------

@pytest.mark.unit
def test_prefetch_keeps_order_and_loads_ahead_of_the_step():
    """While the step works on item i, the loader thread is already producing item i + 1
    (shown by events, not by timing); without prefetch it is not."""
    def source(started):
        for i in range(8):
            started[i].set()
            yield i

    def run(depth):
        started, got = [threading.Event() for _ in range(8)], []
        for item in prefetched(source(started), depth):
            if item < 7:  # "the step" on item: has loading of the next one begun?
                got.append((item, started[item + 1].wait(timeout=60) if depth else started[item + 1].is_set()))
            else:
                got.append((item, None))
        return got

    assert run(2) == [(i, True) for i in range(7)] + [(7, None)]
    assert run(0) == [(i, False) for i in range(7)] + [(7, None)]


@pytest.mark.unit
def test_prefetch_hands_on_the_source_error():
    def broken():
        yield 1
        raise OSError("disk gone")

    got = []
    with pytest.raises(OSError, match="disk gone"):
        for item in prefetched(broken(), 2):
            got.append(item)
    assert got == [1]


# -- bucketing --------------------------------------------------------------------------------

def ragged_text(lengths, batch=16, vocab=64, seed=0):
    """Global batches of (inputs, targets) whose sequence length varies from batch to batch."""
    g = np.random.default_rng(seed)
    for n in lengths:
        tokens = g.integers(0, vocab, size=(batch, n + 1))
        yield tokens[:, :-1], tokens[:, 1:]


@pytest.mark.unit
def test_bucket_padding_and_errors():
    buckets = Buckets(lengths=(8, 16), pad_values=(0, IGNORE_INDEX), mask=True)
    x, y, mask = buckets.pad(([np.arange(3), np.arange(5)], [np.arange(3), np.arange(5)]))
    assert x.shape == y.shape == mask.shape == (2, 8)
    assert y[0].tolist() == [0, 1, 2] + [IGNORE_INDEX] * 5 and mask[1].tolist() == [1] * 5 + [0] * 3
    with pytest.raises(InputError, match="a sequence of 17 tokens is longer than the largest bucket 16"):
        buckets.pad((np.zeros((2, 17)), np.zeros((2, 17))))
    with pytest.raises(OptionsError, match=r"Buckets.lengths=\(16, 8\) must be strictly increasing"):
        Buckets(lengths=(16, 8), pad_values=(0,))
    with pytest.raises(InputError, match="give one pad value per argument"):
        Buckets(lengths=(8,), pad_values=(0,)).pad((np.zeros((2, 3)), np.zeros((2, 3))))


@pytest.mark.e2e
def test_a_varying_stream_compiles_once_per_bucket_and_padding_keeps_the_loss():
    torch.manual_seed(0)
    model = GPT(seq=16)
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          allow_recompile=2)  # one step per bucket
    buckets = Buckets(lengths=(8, 16), pad_values=(0, IGNORE_INDEX))
    lengths = [5, 16, 8, 3, 12, 7, 16, 1]
    shapes = []
    for x, y in Loader(ragged_text(lengths), step=step, buckets=buckets, epochs=1):
        shapes.append(x.shape)
        step(x, y)
    assert shapes == [(16, 8), (16, 16), (16, 8), (16, 8), (16, 16), (16, 8), (16, 16), (16, 8)]
    assert step.compilations == 2  # one compiled program per bucket, none per length

    # ignore-index targets drop the padded positions from the loss; causal attention keeps
    # real positions from seeing the pad tokens behind them
    x, y = next(ragged_text([5], seed=1))
    assert step.eval(*buckets.pad((x, y)))["loss"] == pytest.approx(step.eval(x, y)["loss"], rel=1e-5)


@pytest.mark.unit
def test_sharded_loader_buckets_variable_length_samples():
    class Ragged:
        lengths = [3 + (i * 7) % 14 for i in range(32)]  # 3..16 tokens

        def __len__(self):
            return 32

        def __getitem__(self, i):
            n = self.lengths[i]
            return np.arange(n), np.arange(1, n + 1)

    buckets = Buckets(lengths=(8, 16), pad_values=(0, IGNORE_INDEX))
    loader = ShardedLoader(Ragged(), batch_size=8, mesh=xtrain.Mesh(data=8), buckets=buckets,
                           lengths=Ragged.lengths, seed=1)
    for t, (x, y) in zip(range(4), loader):
        longest = max(Ragged.lengths[i] for i in loader.global_indices(t))
        assert x.shape == (8, 8 if longest <= 8 else 16)
    with pytest.raises(InputError, match="samples of argument 0 have different shapes"):
        next(iter(ShardedLoader(Ragged(), batch_size=8, mesh=xtrain.Mesh(data=8), prefetch=0)))
