"""No silent wrong checkpoint: every byte read is checked against the checksum written with it,
manifests whose pieces overlap or leave gaps are refused, `CheckpointManager.restore` falls back
to the newest checkpoint that verifies and says what it skipped, and saves to one path never
mix (each bad interleaving forced with the commit hook, not left to timing)."""
import json
import shutil
import struct
import threading
from pathlib import Path

import pytest
import torch

import xtrain
from xtrain.checkpoint import CheckpointError, CheckpointManager, CheckpointWarning, read_manifest, writer

from models import MLP, mlp_batches

pytestmark = pytest.mark.e2e

WAIT_S = 120  # a safety net for a broken build (events below are set deterministically)


def sgd_step(seed=0):
    torch.manual_seed(seed)
    model = MLP()
    return xtrain.compile(model, xtrain.Mesh(data=8),
                          optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))


@pytest.fixture(scope="module")
def trained():
    """A step after 1 and 2 steps: (step, state after 1, state after 2), saved at both."""
    step = sgd_step()
    batches = mlp_batches(n=2)
    step(*batches[0])
    first = step.state_dict()
    step(*batches[1])
    return step, first, step.state_dict()


def equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def pieces_in(file: Path) -> dict[str, tuple[int, int]]:
    """{key: (first byte, end byte)} of each tensor's data in a safetensors file."""
    raw = file.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + size])
    return {k: (8 + size + v["data_offsets"][0], 8 + size + v["data_offsets"][1])
            for k, v in header.items() if k != "__metadata__"}


def flip(file: Path, offset: int) -> None:
    data = bytearray(file.read_bytes())
    data[offset] ^= 0x01
    file.write_bytes(bytes(data))


@pytest.fixture
def two_saves(trained, tmp_path):
    """A manager directory with step 1 and step 2 saved (step 2 is the trained step's state)."""
    step, first, second = trained
    manager = CheckpointManager(tmp_path)
    fresh = sgd_step()
    fresh(*mlp_batches(n=1)[0])
    manager.save(fresh, extra={"at": 1})
    manager.save(step, extra={"at": 2})
    return manager, first, second


# -- checksums -------------------------------------------------------------------------------
def test_a_flipped_byte_in_any_piece_is_named_and_restore_returns_the_previous_step(two_saves):
    manager, first, _ = two_saves
    shard = manager.latest() / "shards-00000.safetensors"
    original = shard.read_bytes()
    pieces = pieces_in(shard)
    assert len(pieces) >= 8  # parameters, momentum, step, key
    for key, (lo, hi) in pieces.items():
        flip(shard, (lo + hi) // 2)
        target = sgd_step(seed=1)
        with pytest.raises(CheckpointError, match=rf"shards-00000\.safetensors: piece '{key}'.* fails its crc32 "
                                                  r"checksum: the bytes on disk are not those that were saved"):
            target.load(manager.latest())
        assert target.step_count == 0  # a failed load leaves the step as it was
        shard.write_bytes(original)
    flip(shard, pieces["params/fc2.weight#0"][0] + 5)
    target = sgd_step(seed=1)
    with pytest.warns(CheckpointWarning, match=r"loaded .*step_00000001, skipping newer checkpoints that do not "
                                               r"load: step_00000002: .*params/fc2\.weight#0' rows 0-31 fails"):
        assert manager.restore(target) == {"at": 1}
    assert target.step_count == 1 and equal(target.state_dict(), first)
    assert [p.name for p, _ in manager.skipped] == ["step_00000002"]


def test_verify_false_loads_the_bytes_as_they_are(two_saves):
    manager, _, second = two_saves
    shard = manager.latest() / "shards-00000.safetensors"
    lo, hi = pieces_in(shard)["params/fc1.bias#0"]
    flip(shard, lo + 3)  # the low byte of fc1.bias[0]'s mantissa
    target = sgd_step(seed=1)
    assert target.load(manager.latest(), verify=False) == {"at": 2}
    got = target.state_dict()
    assert [k for k in second if not torch.equal(got[k], second[k])] == ["fc1.bias"]


def test_a_truncated_shard_names_the_file_and_no_loadable_checkpoint_is_an_error(two_saves):
    manager, _, _ = two_saves
    for path in manager.complete():
        shard = path / "shards-00000.safetensors"
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"step_00000002/shards-00000\.safetensors: cannot read piece .*the "
                                              r"file is truncated, corrupt or not a safetensors file"):
        sgd_step().load(manager.latest())
    with pytest.raises(CheckpointError, match=r"no checkpoint in .* loads: step_00000002: .*truncated.*; "
                                              r"step_00000001: .*truncated"):
        manager.restore(sgd_step())


# -- manifests -------------------------------------------------------------------------------
def edited(path: Path, tmp: Path, edit) -> Path:
    copy = tmp / f"edited_{len(list(tmp.iterdir()))}"
    shutil.copytree(path, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    edit(manifest["tensors"])
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def duplicate_piece(rows_a, rows_b):
    def edit(tensors):
        pieces = tensors["params/fc1.weight"]["pieces"]
        second = json.loads(json.dumps(pieces[0]))
        pieces[0]["region"][0], second["region"][0] = rows_a, rows_b
        pieces.append(second)
    return edit


@pytest.mark.parametrize("edit,message", [
    # rows 8-15 stored twice, rows 24-31 never: the element count alone matches
    (duplicate_piece([0, 16], [8, 24]), r"pieces of params/fc1\.weight overlap \(regions \[\[0, 16\], \[0, 12\]\] and "
                                        r"\[\[8, 24\], \[0, 12\]\]\): the manifest is corrupt"),
    (duplicate_piece([0, 16], [20, 36]), r"a piece of params/fc1\.weight holds region \[\[20, 36\], \[0, 12\]\], "
                                         r"outside its shape \[32, 12\]"),
    (lambda t: t["params/fc1.weight"]["pieces"][0]["region"].__setitem__(0, [0, 16]),
     r"the stored pieces of params/fc1\.weight cover 192 of the 384 elements"),
])
def test_manifests_whose_pieces_do_not_tile_a_tensor_are_refused(trained, tmp_path, edit, message):
    step = trained[0]
    step.save(tmp_path / "ok")
    with pytest.raises(CheckpointError, match=message):
        sgd_step().load(edited(tmp_path / "ok", tmp_path, edit))


def test_a_manifest_that_does_not_describe_its_file_is_refused(trained, tmp_path):
    trained[0].save(tmp_path / "ok")

    def swap_keys(tensors):  # fc1.bias's piece pointed at fc1.weight's bytes
        tensors["params/fc1.bias"]["pieces"][0]["key"] = "params/fc1.weight#0"
    with pytest.raises(CheckpointError, match=r"piece 'params/fc1\.weight#0' has shape \[32, 12\] but the manifest "
                                              r"says it holds a region of shape \[32\]"):
        sgd_step().load(edited(tmp_path / "ok", tmp_path, swap_keys))


# -- saves to one path -----------------------------------------------------------------------
class Pause:
    """commit_hook that holds the first save reaching `stage` until `release` is set, and logs
    (stage, step being saved) of every call."""

    def __init__(self, stage: str, fail: bool = False):
        self.stage, self.fail, self.log = stage, fail, []
        self.reached, self.release = threading.Event(), threading.Event()

    def __call__(self, stage: str, path: Path):
        partial = path.with_name(path.name + ".partial")
        self.log.append((stage, json.loads((partial / "begin.json").read_text())["step"]))
        if stage == self.stage and not self.reached.is_set():
            self.reached.set()
            if self.fail:
                raise KeyboardInterrupt("the process dies here")
            assert self.release.wait(WAIT_S)


@pytest.fixture
def hook(monkeypatch):
    def install(pause: Pause) -> Pause:
        monkeypatch.setattr(writer, "commit_hook", pause)
        return pause
    return install


def test_a_second_async_save_to_a_path_waits_and_the_later_save_stays_whole(hook, tmp_path):
    pause = hook(Pause("commit"))
    step = sgd_step()
    batches = mlp_batches(n=2)
    step(*batches[0])
    first = step.save(tmp_path / "ckpt", extra={"which": "A"}, blocking=False)
    assert pause.reached.wait(WAIT_S)  # A has written its shards and stands before its commit
    step(*batches[1])
    expected = step.state_dict()
    second = step.save(tmp_path / "ckpt", extra={"which": "B"}, blocking=False)
    assert not second.done() and not (tmp_path / "ckpt").exists()  # B waits for A
    pause.release.set()
    assert first.wait() == second.wait() == tmp_path / "ckpt"
    assert pause.log == [("commit", 1), ("commit", 2), ("swap", 2)]
    target = sgd_step(seed=1)
    assert target.load(tmp_path / "ckpt") == {"which": "B"} and target.step_count == 2
    assert equal(target.state_dict(), expected)
    assert not (tmp_path / "ckpt.partial").exists() and not (tmp_path / "ckpt.old").exists()


def test_a_save_whose_staging_directory_another_job_took_over_is_refused(hook, trained, tmp_path):
    pause = hook(Pause("commit"))
    handle = trained[0].save(tmp_path / "ckpt", blocking=False)
    assert pause.reached.wait(WAIT_S)
    begin = tmp_path / "ckpt.partial" / "begin.json"  # what another job's save of this path does first
    begin.write_text(json.dumps({**json.loads(begin.read_text()), "save": "another-job"}))
    pause.release.set()
    with pytest.raises(CheckpointError, match=r"another save into .*ckpt\.partial started while this one was writing "
                                              r"\(two jobs saving to the same path\?\): this save was not committed"):
        handle.wait()
    assert not (tmp_path / "ckpt").exists()


def test_a_crash_between_the_overwrite_renames_leaves_a_named_loadable_checkpoint(hook, tmp_path):
    step = sgd_step()
    manager = CheckpointManager(tmp_path)
    step(*mlp_batches(n=1)[0])
    manager.save(step, extra={"save": 1})
    expected = step.state_dict()
    pause = hook(Pause("swap", fail=True))
    with pytest.raises(KeyboardInterrupt):  # the same step saved again dies between its renames
        manager.save(step, extra={"save": 2})
    path = manager.path_for(1)
    assert not path.exists() and (tmp_path / "step_00000001.old" / "COMMITTED").exists()
    assert pause.log == [("commit", 1), ("swap", 1)]
    with pytest.raises(CheckpointError, match=r"no checkpoint at .*step_00000001; a save replacing it stopped between "
                                              r"its two renames: the checkpoint it replaced is complete at "
                                              r".*step_00000001\.old \(step 1\): load that"):
        read_manifest(path)
    target = sgd_step(seed=1)
    assert manager.restore(target) == {"save": 1} and equal(target.state_dict(), expected)
    hook(Pause("none"))
    manager.save(step, extra={"save": 3})  # saving it again cleans up
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]


def test_a_truncated_file_for_sharded_init_names_the_file(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = MLP()
    save_file(model.state_dict(), str(tmp_path / "model.safetensors"))
    raw = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(raw[: len(raw) - 200])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: cannot read .*the file is truncated, corrupt or "
                                              r"not a safetensors file"):
        target = MLP()
        xtrain.compile(target, xtrain.Mesh(data=8), optimizer=torch.optim.SGD(target.parameters(), lr=0.1),
                       init_from=tmp_path / "model.safetensors")
