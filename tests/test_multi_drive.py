"""A state over several directories (one per drive): bitwise, resumable, refused clearly when the drives do not match.

- random placements (1 to 3 directories, random bandwidths), shard sizes and
  budgets train bitwise equal to torch.optim.AdamW(fused=True), close,
  resume and go on bitwise; the placement recorded is the one
  ``place(shard sizes, bandwidths)`` gives, and each drive's files hold its
  shards;
- the second directory is on a second, faster "drive" (``second_drive``:
  an ext4 loop device in tmpfs where asked for, ``TIERSTORE_TEST_LOOP=1``,
  and allowed (root, losetup, mkfs.ext4), else a tmpfs directory in
  /dev/shm, where O_DIRECT works on Linux 6.6+ and ``auto`` falls back to
  mmap before; the output, ``-s``, says which and each drive's backend);
- every refusal names the directory and the fix: a directory given twice
  (same path, a link, another spelling), a count that differs (fewer, more,
  a one-directory state given two), a missing drive, a drive of another
  state, an empty directory in a drive's place, drives swapped, the home
  given second, a member record crafted, a fresh state's directory that
  holds another state's manifest or files; each directory is locked;
- no figures given, the probe places the shards: two directories on one
  drive share its figure (half and half), and beside another drive weigh
  as one directory there would;
- a one-element list is a path: the same files and manifest, no member
  record, no ``"drives"`` key;
- every drive has its own I/O queue; a commit syncs every drive before the
  manifest names its bytes (power-cut and SIGKILL tests over two
  directories: tests/test_crash.py, tests/test_powercut.py);
- describe(), ``tierstore inspect``/``verify``/``export`` show and read the
  placement from the home directory alone (or from the list).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierstore import (
    CorruptStateError,
    DriveSetError,
    StateDirInUseError,
    StateExistsError,
    TieredAdamW,
)
from tierstore._state.drive_record import MEMBER
from tierstore._state.reader import StateReader
from tierstore._storage.placement import drive_bytes, place
from tierstore.testing.drives import second_drive

BW = "TIERSTORE_DRIVE_BANDWIDTHS"
SHAPES = ((300, 7), (1000,), (33,))
BIG = ((300, 70), (10000,), (33,))  # 31,033 elements: 8 to 31 shards
KW = dict(lr=1e-2, weight_decay=1e-2, shard_numel=1024, ram_budget="40KiB")


@pytest.fixture(scope="module")
def fast(tmp_path_factory):
    """The second drive: a loop device, tmpfs or disk (said in the test output)."""
    drive = second_drive(tmp_path_factory.mktemp("second-drive"), loop=os.environ.get("TIERSTORE_TEST_LOOP") == "1")
    print(drive.describe())
    yield drive
    drive.close()


@pytest.fixture
def dirs(tmp_path, fast, request):
    """Three fresh directories: the home on the disk, then one on the fast drive, one on the disk."""
    far = fast.path / request.node.name.replace("[", "-").replace("]", "")[:80]
    yield [tmp_path / "home", far, tmp_path / "third"]
    shutil.rmtree(far, ignore_errors=True)


def _params(seed: int = 0, shapes=SHAPES) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def _grads(params, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=gen) for p in params]


def _train(opt, ref, params, ref_params, steps: range) -> None:
    for step in steps:
        for p, q, g in zip(params, ref_params, _grads(params, step)):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        for p, q in zip(params, ref_params):
            assert torch.equal(p, q), f"step {step}: parameters differ from torch's"


def _same_state(opt, ref) -> None:
    mine, theirs = opt.state_dict()["state"], ref.state_dict()["state"]
    assert mine.keys() == theirs.keys()
    for i in theirs:
        for key, value in theirs[i].items():
            assert torch.equal(mine[i][key], value), f"param {i} {key}"


def _make(dirs, bandwidths, params=None, **kw) -> TieredAdamW:
    """An optimizer over ``dirs``, its shards placed by ``bandwidths`` (given, so no probe runs)."""
    os.environ[BW] = ",".join(str(b) for b in bandwidths)
    try:
        return TieredAdamW(params if params is not None else _params(), state_dir=[str(d) for d in dirs], **{**KW, **kw})
    finally:
        del os.environ[BW]


# -- bitwise over random placements ------------------------------------------------------------


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    count=st.integers(1, 3),
    bandwidths=st.lists(st.floats(1e8, 8e9), min_size=3, max_size=3),
    shard_numel=st.sampled_from([1024, 2048, 4096]),
    resident=st.sampled_from([None, 0, 64 << 10]),
    amsgrad=st.booleans(),
)
def test_random_placements_train_and_resume_bitwise_like_torch(dirs, fast, count, bandwidths, shard_numel, resident, amsgrad):
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    chosen = dirs[:count]
    # The arena (prefetch 2 + 2 slots of a shard's two or three fp32 fields) plus some resident shards, or all in RAM.
    budget = None if resident is None else 4 * shard_numel * (12 if amsgrad else 8) + resident
    kw = dict(shard_numel=shard_numel, ram_budget=budget, amsgrad=amsgrad)
    params, ref_params = _params(shapes=BIG), _params(shapes=BIG)
    ref = torch.optim.AdamW(ref_params, lr=KW["lr"], weight_decay=KW["weight_decay"], amsgrad=amsgrad, fused=True)
    opt = _make(chosen, bandwidths[:count], params, **kw)
    _train(opt, ref, params, ref_params, range(3))
    sizes = [opt._layout.shard_nbytes(s) for s in opt._layout.shards]
    opt.close()
    if count > 1:
        manifest = json.loads((chosen[0] / "manifest.json").read_text())
        devices = [os.stat(d).st_dev for d in chosen]  # the home and the third share the disk: runs of its shards
        assert manifest["drives"]["placement"] == place(sizes, bandwidths[:count], devices=devices), fast.describe()
        for k, d in enumerate(chosen):
            assert json.loads((d / MEMBER).read_text())["index"] == k
    resumed = TieredAdamW(params, state_dir=[str(d) for d in chosen], resume=True, **{**KW, **kw})
    _train(resumed, ref, params, ref_params, range(3, 5))
    _same_state(resumed, ref)
    resumed.close()
    with StateReader(chosen[0]) as reader:
        assert reader.verify() == [] and reader.step_count == 5


def test_each_drive_holds_its_shards_with_its_own_queue(dirs, fast):
    params = _params(shapes=BIG)
    with _make(dirs[:2], [1e9, 3e9], params, ram_budget=4 * 8 << 10) as opt:  # the arena only: all streamed
        store = opt._rt.store
        assert store.drives[0].io is not store.drives[1].io, "the drives share an I/O queue"
        for d in store.drives:
            d.io.stats.reset()
        for p, g in zip(params, _grads(params, 0)):
            p.grad = g
        opt.step()
        opt.commit()
        moved = [d.io.stats.bytes_read + d.io.stats.bytes_written for d in store.drives]
        placed = [n for _, _, n, _ in store.drive_shares()]
        text = opt.describe()
    print(fast.describe(), "backends:", [d.backend_name for d in store.drives])
    assert all(m > 0 for m in moved), f"a drive moved nothing: {moved}"
    assert all(n > 0 for n in placed)
    assert "over 2 drives" in text and str(dirs[1]) in text and "shards" in text
    for k, d in enumerate(dirs[:2]):
        on_disk = (d / "shards.0.bin").stat().st_size
        assert on_disk == placed[k], f"drive {k}'s file holds {on_disk} bytes, its shards {placed[k]}"


def test_a_knobs_file_places_a_new_states_shards_by_its_drive_figures(dirs, tmp_path):
    from tierstore._config.knobs_file import (
        DriveFigure,
        device_of,
        encode_knobs_file,
        knobs_document,
    )

    figures = [DriveFigure(str(d.parent), device_of(d.parent), bw) for d, bw in zip(dirs[:2], (1e9, 3e9))]
    knobs = tmp_path / "tuned.json"
    knobs.write_bytes(encode_knobs_file(knobs_document({}, drives=figures)))
    params = _params(shapes=BIG)
    with TieredAdamW(params, state_dir=[str(d) for d in dirs[:2]], knobs=knobs, **KW) as opt:
        sizes = [opt._layout.shard_nbytes(s) for s in opt._layout.shards]
    record = json.loads((dirs[0] / "manifest.json").read_text())["drives"]
    assert record["bandwidths"] == [1e9, 3e9] and record["placement"] == place(sizes, [1e9, 3e9])


def test_two_directories_on_one_drive_are_placed_half_and_half_by_the_probe(tmp_path, monkeypatch):
    # No figures given: the probe runs. Both directories are on tmp_path's drive: it is measured once and
    # each directory gets half its figure (two probes would differ by noise), and half the shards in one run
    # each (a step then streams one file at a time from the drive, as from one directory).
    monkeypatch.delenv(BW, raising=False)
    pair = [tmp_path / "one", tmp_path / "two"]
    params = _params(shapes=BIG)
    with TieredAdamW(params, state_dir=[str(d) for d in pair], **KW) as opt:
        sizes = [opt._layout.shard_nbytes(s) for s in opt._layout.shards]
    record = json.loads((pair[0] / "manifest.json").read_text())["drives"]
    first, second = record["bandwidths"]
    assert first == second > 0, record["bandwidths"]
    assert record["placement"] == place(sizes, [1.0, 1.0], devices=[0, 0]) == sorted(record["placement"])
    shares = drive_bytes(sizes, record["placement"], drives=2)
    assert abs(shares[0] - shares[1]) <= max(sizes), shares


def test_a_drive_with_two_directories_weighs_as_one_beside_another(dirs, fast, monkeypatch):
    # dirs: the home and the third on the disk, the second on the fast drive. The probe measures each drive
    # once (figures faked here: the disk 2 GB/s, the fast drive 3 GB/s); the disk's two directories split its 2.
    from tierstore._storage import drive_speed

    if os.stat(dirs[0].parent).st_dev == os.stat(fast.path).st_dev:
        pytest.skip(f"the second drive is on the disk here: {fast.describe()}")
    monkeypatch.delenv(BW, raising=False)
    measured = []

    def figures(directories, **kw):
        measured.append([Path(d) for d in directories])
        return [drive_speed.DriveSpeed(str(d), "direct", 1 << 20, 0.0, ((1 << 20) / (3e9 if k else 2e9),))
                for k, d in enumerate(directories)]

    monkeypatch.setattr(drive_speed, "measure_drives", figures)
    with TieredAdamW(_params(shapes=BIG), state_dir=[str(d) for d in dirs], **KW) as opt:
        sizes = [opt._layout.shard_nbytes(s) for s in opt._layout.shards]
    assert measured == [dirs[:2]], measured
    record = json.loads((dirs[0] / "manifest.json").read_text())["drives"]
    assert record["bandwidths"] == pytest.approx([1e9, 3e9, 1e9])
    disk = os.stat(dirs[0]).st_dev
    assert record["placement"] == place(sizes, record["bandwidths"], devices=[disk, "fast", disk])
    on_disk = [d for d in record["placement"] if d != 1]
    assert on_disk == sorted(on_disk) and set(on_disk) == {0, 2}  # the disk's two directories: a run each


# -- one directory stays what it was -----------------------------------------------------------


def _run_one(state_dir) -> dict:
    params = _params()
    with TieredAdamW(params, state_dir=state_dir, **KW) as opt:
        for p, g in zip(params, _grads(params, 0)):
            p.grad = g
        opt.step()
    return json.loads((Path(state_dir[0] if isinstance(state_dir, list) else state_dir) / "manifest.json").read_text())


def test_a_one_element_list_is_the_same_state_directory(tmp_path):
    a = _run_one(str(tmp_path / "a"))
    b = _run_one([str(tmp_path / "b")])
    assert "drives" not in a and "drives" not in b
    assert sorted(os.listdir(tmp_path / "a")) == sorted(os.listdir(tmp_path / "b")) == ["manifest.json", "shards.0.bin", "shards.1.bin"]
    for key in ("fingerprint", "layout", "shards", "step_count"):
        assert a[key] == b[key], key
    for name in ("shards.0.bin", "shards.1.bin"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    with TieredAdamW(_params(), state_dir=str(tmp_path / "b"), resume=True, **KW) as opt:
        assert opt.step_count == 1


# -- refusals: each names the directory and the fix --------------------------------------------


def _state(dirs, count=2) -> list[str]:
    """A committed state over ``dirs[:count]`` (bandwidths given: no probe)."""
    opt = _make(dirs[:count], [2e9] * count)
    params = [p for g in opt.param_groups for p in g["params"]]
    for p, g in zip(params, _grads(params, 0)):
        p.grad = g
    opt.step()
    opt.close()
    return [str(d) for d in dirs[:count]]


def _refused(state_dir, error, *words, resume=True):
    with pytest.raises(error) as caught:
        TieredAdamW(_params(), state_dir=state_dir, resume=resume, **KW)
    text = str(caught.value)
    for word in words:
        assert word in text, f"{word!r} not in: {text}"
    assert any(fix in text for fix in ("Pass", "pass", "Mount", "Restore", "restore", "move", "Give", "close()")), text
    return text


def test_a_directory_given_twice_is_refused_however_it_is_spelled(dirs):
    home, other = _state(dirs)
    os.symlink(other, dirs[2])
    _refused([home, other, other], DriveSetError, "state_dir[1]", "state_dir[2]", "same directory")
    _refused([home, home + "/."], DriveSetError, "same directory", "Give each drive's directory once")
    _refused([home, other, str(dirs[2])], DriveSetError, str(dirs[2]), "same directory")  # a link to the member
    with TieredAdamW(_params(), state_dir=[home, str(dirs[2])], resume=True, **KW) as opt:  # the link alone: fine
        assert opt.step_count == 1
    with pytest.raises(DriveSetError, match="same directory"):  # a fresh state too, before anything is made
        TieredAdamW(_params(), state_dir=[str(dirs[0]) + "-new", str(dirs[0]) + "-new/../" + dirs[0].name + "-new"], **KW)
    assert not os.path.exists(str(dirs[0]) + "-new")


def test_another_count_of_directories_is_refused_with_the_move_command(dirs):
    home, other = _state(dirs)
    text = _refused([home], DriveSetError, "lists 1 directory", "spans 2 directories", other, "tierstore move")
    assert home in text
    _refused([home, other, str(dirs[2])], DriveSetError, "lists 3 directories", "spans 2")
    single = dirs[2] / "single"
    _run_one(str(single))
    _refused([str(single), other], DriveSetError, "spans one directory", "tierstore move")


def test_a_missing_drive_is_refused_naming_it(dirs):
    home, other = _state(dirs)
    shutil.rmtree(other)
    _refused([home, other], DriveSetError, f"state_dir[1]={other!r} does not exist", "drive 1", "Mount the drive")
    _refused([home, other], DriveSetError, "does not exist", resume="auto")  # "auto" never starts over a committed state
    assert not os.path.exists(other), "a refused resume created the missing drive's directory"


def test_a_drive_of_another_state_or_an_empty_one_is_refused(dirs, tmp_path):
    home, other = _state(dirs)
    foreign = _state([tmp_path / "f0", tmp_path / "f1"])
    _refused([home, foreign[1]], DriveSetError, foreign[1], "belongs to another state", "drive 1")
    empty = tmp_path / "empty"
    empty.mkdir()
    _refused([home, str(empty)], DriveSetError, str(empty), "holds no member record", "Pass the directory")


def test_swapped_drives_are_refused(dirs):
    home, d1, d2 = _state(dirs, count=3)
    _refused([home, d2, d1], DriveSetError, f"state_dir[1]={d2!r} is drive 2", "swapped", "state's order")
    _refused([d1, home, d2], DriveSetError, f"state_dir[0]={d1!r} is drive 1", "not its home")


def test_each_directory_is_locked(dirs):
    home, other = _state(dirs)
    with TieredAdamW(_params(), state_dir=[home, other], resume=True, **KW):
        _refused([home, other], StateDirInUseError, home)
        fresh = str(dirs[2])
        with pytest.raises(StateDirInUseError) as caught:
            TieredAdamW(_params(), state_dir=[fresh, other], **KW)
        assert other in str(caught.value)
        assert not os.path.exists(fresh), "a refused start left the home it created"


def test_a_crafted_member_record_is_refused(dirs):
    home, other = _state(dirs)
    (Path(other) / MEMBER).write_text('{"format": "tierstore-drive", "version": 1, "state": "zz", "index": 1}')
    _refused([home, other], CorruptStateError, str(Path(other) / MEMBER), "state='zz'", "restore")
    (Path(other) / MEMBER).unlink()
    os.symlink(Path(home) / MEMBER, Path(other) / MEMBER)
    _refused([home, other], CorruptStateError, "symbolic link")


def test_a_crafted_placement_is_refused(dirs):
    from tierstore._state.manifest_file import manifest_checksum

    home, other = _state(dirs)
    path = Path(home) / "manifest.json"
    body = json.loads(path.read_text())
    body["drives"]["placement"] = body["drives"]["placement"][:-1]
    body["manifest_checksum"] = manifest_checksum(body)
    path.write_text(json.dumps(body))
    _refused([home, other], CorruptStateError, "drives.placement", "one per shard", "restore")
    body["drives"]["placement"][0] = 7
    body["drives"]["placement"].append(0)
    body["manifest_checksum"] = manifest_checksum(body)
    path.write_text(json.dumps(body))
    _refused([home, other], CorruptStateError, "drives.placement[0]=7", "0 to 1")


def test_a_fresh_state_never_takes_another_states_directory(dirs, tmp_path):
    home, other = _state(dirs)
    new = str(tmp_path / "new-home")
    _refused([new, home], DriveSetError, f"state_dir[1]={home!r} holds a manifest", "pass another directory", resume=False)
    _refused([new, other], DriveSetError, "is drive 1 of another state", resume=False)
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "shards.0.bin").write_bytes(b"x")
    _refused([new, str(stray)], StateExistsError, str(stray), "state files from another run", resume=False)
    assert not os.path.exists(new), "a refused fresh start left its home behind"
    assert os.listdir(stray) == ["shards.0.bin"], "a refused fresh start left a member record behind"


def test_a_failed_fresh_start_leaves_no_directory_or_record(dirs):
    from tierstore import BudgetError

    with pytest.raises(BudgetError):
        _make(dirs[:2], [1e9, 1e9], ram_budget="1KiB")
    assert not dirs[0].exists() and not dirs[1].exists()


def test_a_state_that_died_before_its_first_commit_starts_over_with_auto(dirs):
    """Member records without a manifest: the leftovers of a start that died; resume='auto' starts afresh."""
    from tierstore._state.drive_record import Member

    for k, d in enumerate(dirs[:2]):
        d.mkdir(parents=True)
        (d / MEMBER).write_bytes(Member("00000000000000aa", k, 2).to_bytes())
        (d / "shards.0.bin").write_bytes(bytes(4096))
    opt = _make(dirs[:2], [1e9, 1e9], resume="auto")
    assert opt.step_count == 0
    opt.close()
    assert json.loads((dirs[1] / MEMBER).read_text())["state"] != "00000000000000aa"


def test_not_durable_over_two_drives_resumes_after_a_clean_close(dirs):
    params, ref_params = _params(), _params()
    ref = torch.optim.AdamW(ref_params, lr=KW["lr"], weight_decay=KW["weight_decay"], fused=True)
    opt = _make(dirs[:2], [1e9, 3e9], params, durable=False)
    _train(opt, ref, params, ref_params, range(2))
    opt.close()
    assert sorted(os.listdir(dirs[1])) == [MEMBER, "shards.0.bin"]
    with TieredAdamW(params, state_dir=[str(d) for d in dirs[:2]], resume=True, durable=False, **KW) as again:
        _train(again, ref, params, ref_params, range(2, 3))


# -- the offline commands ----------------------------------------------------------------------


def test_inspect_verify_and_export_read_the_drives_from_the_home(dirs, tmp_path, capsys):
    from tierstore.checkpoint import load_checkpoint
    from tierstore.cli import main

    home, other = _state(dirs)
    assert main(["inspect", home, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    shares = info["drives"]
    assert [d["path"] for d in shares] == [os.path.abspath(home), os.path.abspath(other)]
    assert sum(d["shards"] for d in shares) == info["layout"]["shards"] and all(d["bytes"] > 0 for d in shares)
    assert any(k.startswith("drive1/") for k in info["bytes"]["files"])
    assert main(["inspect", home]) == 0
    text = capsys.readouterr().out
    assert "placement: over 2 drives" in text and f"drive 1: {os.path.abspath(other)}" in text
    assert main(["verify", home, "--no-progress"]) == 0
    capsys.readouterr()
    out = tmp_path / "c.zarr"
    assert main(["export", home, str(out), "--no-progress"]) == 0
    params = _params()
    with TieredAdamW(params, **{**KW, "ram_budget": None}) as fresh:
        load_checkpoint(fresh, out)
        with TieredAdamW(_params(), state_dir=[home, other], resume=True, **KW) as resumed:
            _same_state(fresh, resumed)
    with StateReader([home, other]) as reader:  # the list works too (a drive mounted elsewhere)
        assert reader.verify() == []
    # damage one byte of the second drive's committed copy: verify names that file
    with StateReader(home) as reader:
        index = reader.placement.index(1)
        path, offset = reader.file_path(index, reader.records[index]["copy"]), reader._offset(index)
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\xff" * 16)
    assert main(["verify", home, "--no-progress"]) == 1
    assert str(path) in capsys.readouterr().out


def test_a_reader_refuses_a_drive_that_is_not_the_states(dirs, tmp_path):
    home, other = _state(dirs)
    foreign = _state([tmp_path / "f0", tmp_path / "f1"])
    with pytest.raises(DriveSetError, match="belongs to another state"):
        StateReader([home, foreign[1]])
    with pytest.raises(DriveSetError, match="spans 2 directories"):
        StateReader([home, other, foreign[1]])
    shutil.rmtree(other)
    with pytest.raises(DriveSetError) as caught:
        StateReader(home)
    assert "drive 1" in str(caught.value) and other in str(caught.value) and "recorded in its manifest" in str(caught.value)
