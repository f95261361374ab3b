"""Placement of shards over several drives (tierstore/_storage/placement.py) and the drive probe.

- every drive's bytes follow its share (bytes proportional to its bandwidth),
  so every drive finishes its part of a step at about the same time: the
  slowest drive's time is within one shard per drive of the ideal;
- equal drives get the shards round robin; one drive gets all of them;
- the same inputs give the same placement (it is recorded and must be
  reproducible in a test);
- offsets: a drive's files hold its shards back to back in layout order
  (one drive: the offsets a single state directory always had);
- every bad input is a ConfigError naming the value;
- the probe writes, syncs and reads back in the directory and leaves nothing there.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore._storage.drive_speed import DriveSpeed, measure_drive, probe_drive, probe_nbytes
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


def test_the_probe_measures_write_then_read_and_leaves_nothing_behind(tmp_path):
    speed = measure_drive(tmp_path, backend="buffered", nbytes=2 << 20, workers=2)
    assert isinstance(speed, DriveSpeed) and speed.backend == "buffered" and speed.nbytes == 2 << 20
    assert speed.write_seconds > 0 and speed.read_seconds > 0
    assert speed.bandwidth == pytest.approx(speed.nbytes / (speed.write_seconds + speed.read_seconds))
    assert speed.bandwidth < min(speed.write_bandwidth, speed.read_bandwidth)
    assert os.listdir(tmp_path) == []
    assert probe_drive(tmp_path, "auto", 1 << 20) > 0 and os.listdir(tmp_path) == []


def test_the_probe_refuses_a_size_that_is_not_whole_pages(tmp_path):
    with pytest.raises(ConfigError, match="nbytes=1000 must be a positive multiple of 4096"):
        measure_drive(tmp_path, nbytes=1000)


def test_the_probe_size_follows_the_state_within_bounds():
    assert probe_nbytes(0, 2) == 1 << 20
    assert probe_nbytes(6 << 20, 2) == 3 << 20
    assert probe_nbytes(1 << 40, 4) == 32 << 20
