"""Placement of shards over several drives (tierstore/_storage/placement.py) and the drive probe.

- every drive's bytes follow its share (bytes proportional to its bandwidth),
  so every drive finishes its part of a step at about the same time: the
  slowest drive's time is within one shard per drive of the ideal;
- equal drives get the shards round robin; one drive gets all of them;
- directories on one drive (``devices``) share its deal of the shards in
  runs, each its share of the drive's bytes;
- the same inputs give the same placement (it is recorded and must be
  reproducible in a test);
- offsets: a drive's files hold its shards back to back in layout order
  (one drive: the offsets a single state directory always had);
- every bad input is a ConfigError naming the value;
- the probe times what a streamed step asks of a drive: every byte of a
  written file read back and written again, synced (the first write, which
  allocates the file, is not counted), the median of a few passes; it moves
  its bytes through one buffer of 4 MiB whatever their number, and leaves
  nothing in the directory;
- directories on one drive (one ``st_dev``) are probed once and share its
  figure equally.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore._storage import drive_speed
from tierstore._storage.drive_speed import (
    PROBE_BUFFER_BYTES,
    DriveSpeed,
    measure_drive,
    probe_drive,
    probe_drives,
    probe_nbytes,
)
from tierstore._storage.placement import (
    MAX_DRIVES,
    check_bandwidths,
    check_placement,
    drive_bytes,
    drive_offsets,
    place,
)
from tierstore.errors import ConfigError, ConfigTypeError

sizes = st.lists(st.integers(1, 1 << 20), min_size=0, max_size=300)
speeds = st.lists(st.floats(1e6, 1e10), min_size=1, max_size=6)


@settings(max_examples=200, deadline=None)
@given(shards=sizes, bandwidths=speeds)
def test_each_drive_gets_its_share_within_one_shard(shards, bandwidths):
    placement = place(shards, bandwidths)
    assert len(placement) == len(shards) and all(0 <= d < len(bandwidths) for d in placement)
    per_drive = drive_bytes(shards, placement, drives=len(bandwidths))
    biggest = max(shards, default=0)
    ideal = sum(shards) / sum(bandwidths)  # seconds if every drive moved exactly its share
    # Greedy by finish time: a drive's last shard went where it finished soonest, and the least of
    # (bytes_k + s) / b_k is at most their sums' ratio, so no drive ends later than the ideal plus
    # the time all drives together need for one shard per drive.
    slack = len(bandwidths) * biggest / sum(bandwidths)
    for d, nbytes in enumerate(per_drive):
        assert nbytes / bandwidths[d] <= (ideal + slack) * (1 + 1e-9)
    assert sum(per_drive) == sum(shards)


@settings(max_examples=200, deadline=None)
@given(shards=sizes, bandwidths=speeds, data=st.data())
def test_directories_on_one_drive_hold_runs_of_its_share(shards, bandwidths, data):
    devices = data.draw(st.lists(st.integers(0, 2), min_size=len(bandwidths), max_size=len(bandwidths)))
    placement = place(shards, bandwidths, devices=devices)
    assert sum(drive_bytes(shards, placement, drives=len(bandwidths))) == sum(shards)
    drives = sorted(set(devices))
    members = {g: [k for k, d in enumerate(devices) if d == g] for g in drives}
    # Each drive is dealt its shards as one directory with its directories' bandwidths added would be.
    alone = place(shards, [sum(bandwidths[k] for k in members[g]) for g in dict.fromkeys(devices)])
    order = list(dict.fromkeys(devices))
    assert [devices[d] for d in placement] == [order[g] for g in alone]
    biggest = max(shards, default=0)
    for g in drives:
        mine = [d for d in placement if devices[d] == g]
        assert mine == sorted(mine), f"drive {g}'s directories do not hold runs: {mine}"  # in directory order
        total, weight = sum(s for s, d in zip(shards, placement) if devices[d] == g), sum(bandwidths[k] for k in members[g])
        for k in members[g]:
            held = sum(s for s, d in zip(shards, placement) if d == k)
            assert abs(held - total * bandwidths[k] / weight) <= biggest, (k, held, total)


def test_devices_that_do_not_name_each_directory_are_refused():
    with pytest.raises(ConfigError, match="must name the drive of each of the 2 directories"):
        place([4096], [1e9, 1e9], devices=[0])
    with pytest.raises(ConfigError, match="must name the drive of each"):
        place([4096], [1e9, 1e9], devices="ab")


@settings(max_examples=50, deadline=None)
@given(shards=sizes, bandwidths=speeds)
def test_the_same_inputs_give_the_same_placement(shards, bandwidths):
    assert place(shards, bandwidths) == place(list(shards), tuple(bandwidths))


def test_equal_drives_take_turns_and_one_drive_takes_all():
    assert place([8192] * 7, [1e9, 1e9, 1e9]) == [0, 1, 2, 0, 1, 2, 0]
    assert place([8192] * 3, [5e8]) == [0, 0, 0]
    assert place([], [1e9, 2e9]) == []


def test_a_faster_drive_takes_proportionally_more_and_the_drives_interleave():
    placement = place([4 << 20] * 300, [3e9, 1e9])
    assert placement.count(0) == 225 and placement.count(1) == 75
    # Interleaved in layout order: never more than 3 consecutive shards on the fast drive.
    runs = "".join(map(str, placement)).split("1")
    assert max(len(r) for r in runs) <= 3


def test_offsets_put_each_drives_shards_back_to_back_in_layout_order():
    shards = [100, 200, 300, 400, 500]
    offsets, totals = drive_offsets(shards, [0, 0, 0, 0, 0], drives=1)
    assert offsets == [0, 100, 300, 600, 1000] and totals == [1500]  # a single directory's layout
    offsets, totals = drive_offsets(shards, [1, 0, 1, 1, 0], drives=2)
    assert offsets == [0, 0, 100, 400, 200] and totals == [700, 800]


@pytest.mark.parametrize(("value", "error", "words"), [
    ([], ConfigError, "lists 0 drives"),
    ([1e9] * (MAX_DRIVES + 1), ConfigError, f"1 to {MAX_DRIVES}"),
    ("2e9", ConfigTypeError, "must be a list"),
    (2e9, ConfigTypeError, "must be a list"),
    ([1e9, True], ConfigTypeError, "bandwidths[1]=True must be a number"),
    ([1e9, "fast"], ConfigTypeError, "bandwidths[1]='fast'"),
    ([1e9, 0.0], ConfigError, "bandwidths[1]=0.0 must be a positive, finite"),
    ([-1.0], ConfigError, "bandwidths[0]=-1.0"),
    ([float("nan")], ConfigError, "bandwidths[0]=nan"),
    ([float("inf")], ConfigError, "bandwidths[0]=inf"),
])  # fmt: skip
def test_bad_bandwidths_are_refused_naming_the_value(value, error, words):
    with pytest.raises(error) as caught:
        place([4096], value)
    assert words in str(caught.value)


def test_a_bandwidth_count_that_differs_from_the_directories_is_refused():
    with pytest.raises(ConfigError, match="lists 3 bandwidths for 2 directories"):
        check_bandwidths([1e9, 1e9, 1e9], drives=2)


def test_a_negative_shard_size_and_a_bad_placement_are_refused():
    with pytest.raises(ConfigError, match="shard 1 has -5 bytes"):
        place([4096, -5], [1e9, 1e9])
    with pytest.raises(ConfigError, match="names a drive for 2 shards, the layout has 3"):
        check_placement([0, 1], shards=3, drives=2)
    with pytest.raises(ConfigError, match="puts shard 1 on drive 2; drives are 0 to 1"):
        check_placement([0, 2], shards=2, drives=2)
    with pytest.raises(ConfigError, match="puts shard 0 on drive True"):
        check_placement([True], shards=1, drives=2)


def test_the_probe_times_reading_back_and_rewriting_and_leaves_nothing_behind(tmp_path):
    speed = measure_drive(tmp_path, backend="buffered", nbytes=2 << 20, passes=3, workers=2)
    assert isinstance(speed, DriveSpeed) and speed.backend == "buffered" and speed.nbytes == 2 << 20
    assert speed.fill_seconds > 0 and len(speed.pass_seconds) == 3 and all(t > 0 for t in speed.pass_seconds)
    assert speed.seconds == sorted(speed.pass_seconds)[1]
    assert speed.bandwidth == pytest.approx(speed.nbytes / speed.seconds)
    assert os.listdir(tmp_path) == []
    assert probe_drive(tmp_path, "auto", 1 << 20) > 0 and os.listdir(tmp_path) == []


@pytest.mark.parametrize(("kw", "message"), [
    (dict(nbytes=1000), "nbytes=1000 must be a positive multiple of 4096"),
    (dict(nbytes=True), "nbytes=True must be a positive multiple of 4096"),
    (dict(passes=0), "passes=0 must be an int >= 1"),
    (dict(passes=True), "passes=True must be an int >= 1"),
])
def test_the_probe_refuses_a_size_that_is_not_whole_pages_and_no_passes(tmp_path, kw, message):
    with pytest.raises(ConfigError, match=message):
        measure_drive(tmp_path, **kw)
    assert os.listdir(tmp_path) == []


def test_the_probe_size_follows_the_state_within_bounds():
    assert probe_nbytes(0, 2) == 1 << 20
    assert probe_nbytes(6 << 20, 2) == 3 << 20
    assert probe_nbytes(1 << 40, 4) == 64 << 20


class _ModelDrive:
    """A drive that takes one request at a time: a block's first write costs ``first`` s/MiB (allocation, a
    cache filling), a rewrite ``rewrite``, a read ``read``; records every operation."""

    def __init__(self, file, *, first: float, rewrite: float, read: float) -> None:
        self.file, self.costs, self.log, self.written = file, (first, rewrite, read), [], set()
        self.lock = threading.Lock()

    def _serve(self, op: str, nbytes: int, offset: int, seconds_per_mib: float) -> None:
        with self.lock:
            self.log.append((op, offset, nbytes))
            time.sleep(seconds_per_mib * nbytes / (1 << 20))

    def write_from(self, buffer, offset):
        first, rewrite, _ = self.costs
        new = offset not in self.written
        self.written.add(offset)
        self.file.write_from(buffer, offset)
        self._serve("write", len(buffer), offset, first if new else rewrite)

    def read_into(self, buffer, offset):
        self.file.read_into(buffer, offset)
        self._serve("read", len(buffer), offset, self.costs[2])

    def sync(self):
        self.file.sync()
        self.log.append(("sync", 0, 0))

    def close(self):
        self.file.close()

    def __getattr__(self, name):  # everything else (parallel, path, ...) is the real file's
        return getattr(self.file, name)


def test_the_probe_figure_is_a_steps_read_and_rewrite_not_the_first_write(tmp_path, monkeypatch):
    # A drive whose first write of a block costs 10x a rewrite (a fresh file's allocation; a cache in front
    # of a virtual disk) looks 5x slower to a probe that times the first write: the 32 MiB probe's error on
    # this VM's disk. A streamed step rewrites blocks written before: 5 ms/MiB read + 5 ms/MiB rewritten here.
    drives, real = [], drive_speed.open_backend

    def model(kind, path, nbytes, **kw):
        drives.append(_ModelDrive(real(kind, path, nbytes, **kw), first=0.05, rewrite=0.005, read=0.005))
        return drives[-1]

    monkeypatch.setattr(drive_speed, "open_backend", model)
    nbytes, mib = 4 << 20, 1 << 20
    speed = measure_drive(tmp_path, backend="buffered", nbytes=nbytes, passes=3, workers=4)
    step = nbytes / (nbytes / mib * (0.005 + 0.005))  # the drive serves one request at a time
    assert step / 2 < speed.bandwidth <= step * 1.01, (speed, step)
    assert speed.fill_seconds >= 0.05 * nbytes / mib  # timed, not counted
    # What each pass asked of the drive: the fill wrote every block once and synced; each timed pass
    # read every block back and wrote it again, then synced.
    log = drives[0].log
    cuts = [k for k, (op, _, _) in enumerate(log) if op == "sync"]
    assert len(cuts) == 4, log
    blocks = set(range(0, nbytes, mib))
    fill, passes = log[: cuts[0]], [log[a + 1 : b] for a, b in zip(cuts, cuts[1:])]
    assert {o for op, o, _ in fill if op == "write"} == blocks and all(op == "write" for op, _, _ in fill)
    for one in passes:
        assert sorted(o for op, o, _ in one if op == "read") == sorted(blocks), one
        assert sorted(o for op, o, _ in one if op == "write") == sorted(blocks), one
    assert os.listdir(tmp_path) == []


def test_the_probe_moves_its_bytes_through_one_small_buffer(tmp_path, monkeypatch):
    sizes = []
    real = drive_speed.HostBuffer

    def recorded(nbytes, **kw):
        sizes.append(nbytes)
        return real(nbytes, **kw)

    monkeypatch.setattr(drive_speed, "HostBuffer", recorded)
    # 16 MiB moved, 8 requests of 8 MiB asked for: one buffer of 4 MiB (the RSS of a whole construction under a
    # small budget: tests/test_ram_budget.py).
    speed = measure_drive(tmp_path, backend="buffered", nbytes=16 << 20, passes=1, request_bytes=8 << 20, workers=8)
    assert speed.nbytes == 16 << 20 and sizes == [PROBE_BUFFER_BYTES] == [4 << 20]


def test_directories_on_one_drive_are_probed_once_and_share_its_figure(tmp_path, monkeypatch):
    pair = [tmp_path / "a", tmp_path / "b"]
    for d in pair:
        d.mkdir()
    measured = []
    real = drive_speed.measure_drives

    def spy(directories, **kw):
        measured.append([str(d) for d in directories])
        return real(directories, **kw)

    monkeypatch.setattr(drive_speed, "measure_drives", spy)
    one, two = probe_drives(pair, backend="buffered", nbytes=1 << 20, passes=1)
    assert measured == [[str(pair[0])]] and one == two > 0
    assert sorted(os.listdir(tmp_path)) == ["a", "b"] and not os.listdir(pair[0])


def test_a_drive_shared_by_two_directories_weighs_as_one_beside_another(tmp_path, monkeypatch):
    other = "/dev/shm"
    if not os.path.isdir(other) or os.stat(other).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("no second filesystem at /dev/shm")
    figures = {str(tmp_path / "a"): 2e9, other: 3e9}
    speed = lambda d: DriveSpeed(str(d), "buffered", 1 << 20, 0.0, (1.0 / figures[str(d)] * (1 << 20),))  # noqa: E731
    monkeypatch.setattr(drive_speed, "measure_drives", lambda dirs, **kw: [speed(d) for d in dirs])
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    got = probe_drives([tmp_path / "a", other, tmp_path / "b"])
    assert got == pytest.approx([1e9, 3e9, 1e9])


@given(
    figure=st.floats(1e6, 1e11, allow_nan=False, allow_infinity=False),
    sizes=st.lists(st.sampled_from([8192, 1 << 22]), min_size=2, max_size=80),
)
def test_directories_on_one_drive_place_alike_whatever_the_figures_scale(figure, sizes) -> None:
    """Two directories at [f, f] on one drive place exactly as at [1, 1]: a shard whose middle falls on the run's
    end goes the same way (float arithmetic of total * f / 2f flipped it for some f: a flaky multi-drive test)."""
    assert place(sizes, [figure, figure], devices=[0, 0]) == place(sizes, [1.0, 1.0], devices=[0, 0])
