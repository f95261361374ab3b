"""``tierstore plan`` over several drives (issue 25, item 3): what each drive holds and the step's disk time.

The plan places the shards with the optimizer's own placement
(``tierstore._storage.placement.place``, by each drive's read+write
bandwidth), so each drive's bytes follow its speed; a streamed step's disk
time is the slowest drive's share, never below the striped floor (the
streamed bytes over the combined bandwidth) and below the fastest drive alone.
Every bad ``--drive`` and every flag that describes one drive is refused,
naming it.
"""

from __future__ import annotations

import json
import os

import pytest

from tierstore._config.knobs_file import DriveFigure, encode_knobs_file, knobs_document
from tierstore._storage.placement import drive_bytes, place
from tierstore.cli import main
from tierstore.errors import ConfigError, ConfigTypeError
from tierstore.planner import plan_memory
from tierstore.planner.drive_specs import parse_drive, resolve_drives
from tierstore.planner.drives import check_drives
from tierstore.planner.results import GB, DriveSpec

FAST, SLOW = DriveSpec("/nvme0", read_gbps=6.0, write_gbps=3.0), DriveSpec("/nvme1", read_gbps=3.0, write_gbps=1.5)
PLAN = dict(host_ram=64 << 30, ram_budget="1/4")


def test_each_drive_holds_its_bandwidths_share_as_the_optimizer_places_it():
    plan = plan_memory(10**8, durable=True, drives=[FAST, SLOW], **PLAN)
    fast, slow = plan.drives
    assert sum(d.state for d in plan.drives) == plan.state and sum(d.shards for d in plan.drives) == plan.shards
    assert fast.state / plan.state == pytest.approx(2 / 3, abs=0.01)  # 2 GB/s against 1 GB/s read+write
    assert fast.bandwidth_gbps == pytest.approx(2.0) and slow.bandwidth_gbps == pytest.approx(1.0)
    assert all(d.files == 2 * d.state for d in plan.drives)  # durable: two copies of each of its shards
    assert sum(d.streamed for d in plan.drives) == plan.traffic.disk_read
    s = plan.striped
    assert s.floor_seconds == pytest.approx(plan.traffic.disk_read / (3.0 * GB))
    assert s.floor_seconds <= s.placement_seconds <= s.floor_seconds * 1.02 < s.fastest_alone_seconds
    assert plan.step_time.disk == s.placement_seconds == max(d.step_seconds for d in plan.drives)
    # The placement is the optimizer's: the same function over the same shard sizes (the last one is partial).
    shards = [plan.host.slot] * (plan.shards - 1) + [plan.state - plan.host.slot * (plan.shards - 1)]
    assert [d.state for d in plan.drives] == drive_bytes(shards, place(shards, [2e9, 1e9]), drives=2)


def test_not_durable_a_drive_holds_its_streamed_shards_once():
    plan = plan_memory(10**8, durable=False, drives=[FAST, SLOW], **PLAN)
    assert all(d.files == d.streamed for d in plan.drives)
    assert plan.disk.free is None and plan.disk.fits is None  # free space unknown: nothing to compare


def test_one_drive_in_the_list_is_the_one_drive_plan():
    one = plan_memory(10**8, durable=True, drives=[DriveSpec("/x", free=10**12, read_gbps=6.0, write_gbps=3.0)], **PLAN)
    from tierstore.planner.results import Bandwidth

    plain = plan_memory(10**8, durable=True, disk_free=10**12, bandwidth=Bandwidth(read_gbps=6.0, write_gbps=3.0),
                        **PLAN)
    assert one.step_time.disk == pytest.approx(plain.step_time.disk)
    assert one.disk.total == plain.disk.total and one.disk.fits == plain.disk.fits is True


def test_a_drive_too_small_for_its_share_is_named_with_the_fix():
    small = DriveSpec("/nvme1", free=300 << 20, read_gbps=3.0, write_gbps=1.5)
    plan = plan_memory(10**8, durable=True, drives=[DriveSpec("/nvme0", free=10**13, read_gbps=6, write_gbps=3), small],
                       **PLAN)
    assert plan.verdict == "does not fit" and plan.disk.fits is False
    (short,) = [s for s in plan.shortfalls if s.resource.startswith("drive space")]
    assert short.resource == "drive space on /nvme1" and short.have == 300 << 20 and short.need == plan.drives[1].files
    assert short.fix.startswith("/nvme1 holds ") and "free " in short.fix and "durable=False" in short.fix
    assert " or or " not in short.fix and "leave it out" in short.fix


def test_an_unknown_bandwidth_gives_equal_shares_and_no_step_time():
    plan = plan_memory(10**8, drives=[FAST, DriveSpec("/nvme1")], **PLAN)
    assert abs(plan.drives[0].shards - plan.drives[1].shards) <= 1
    assert plan.step_time.disk is None and plan.striped.floor_seconds is None
    assert any("bandwidth is unknown" in n for n in plan.notes)


@pytest.mark.parametrize(("drives", "error", "message"), [
    ([], ConfigError, "lists 0 drives"),
    ([FAST] * 65, ConfigError, "a state spans 1 to 64"),
    ([FAST, FAST], ConfigError, "name '/nvme0' twice"),
    ([DriveSpec("")], ConfigError, "must be a non-empty string"),
    ([DriveSpec("a", free=-1)], ConfigError, "free=-1 must be a byte count"),
    ([DriveSpec("a", read_gbps=0.0, write_gbps=1.0)], ConfigError, "read_gbps=0.0 must be a finite number"),
    ([DriveSpec("a", read_gbps=1.0, write_gbps=float("inf"))], ConfigError, "write_gbps=inf"),
    (["/nvme0"], ConfigTypeError, "give a DriveSpec"),
    (FAST, ConfigTypeError, "must be a list of DriveSpec"),
])  # fmt: skip
def test_bad_drives_are_refused(drives, error, message):
    with pytest.raises(error, match=message):
        check_drives(drives)
    with pytest.raises(ConfigError, match="disk_free is one drive's"):
        plan_memory(10**8, disk_free=1, drives=[FAST], **PLAN)


# -- the command ---------------------------------------------------------------------------
def test_drive_specs_parse_and_refuse():
    assert parse_drive("/a:1TB") == DriveSpec("/a", 10**12, None, None)
    assert parse_drive("/a:-:7/5") == DriveSpec("/a", None, 7.0, 5.0)
    assert parse_drive("c:/x:y::2") == DriveSpec("c:/x:y", None, 2.0, 2.0)  # colons in a path: the last two fields
    for spec, message in (("", "is empty"), (":1TB", "names no drive"), ("/a:lots", "SIZE"),
                          ("/a:1TB:fast", "READ"), ("/a:1TB:1/2/3", "READ or READ/WRITE"), ("/a::0", "READ"),
                          ("/a:-1TB", "negative")):
        with pytest.raises(ConfigError, match=message):
            parse_drive(spec)


def _plan(capsys, *argv):
    rc = main(["plan", "--params", "1e8", "--host-ram", "64GiB", "--ram-budget", "1/4", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_plan_prints_each_drive_and_the_striped_step(capsys, tmp_path):
    rc, out, _ = _plan(capsys, "--durable", "--drive", f"{tmp_path}::6/3", "--drive", "/nvme1:2TB:3/1.5")
    assert rc == 0
    assert "drives: 2, shards placed by bandwidth; each holds two copies of its shards (durable)" in out
    assert f"  {tmp_path}  " in out and " of 1.82 TiB (2,000.00 GB) free  fits" in out
    assert "striped floor" in out and "the fastest drive alone" in out and "disk = the slowest drive's share" in out
    rc, out, _ = _plan(capsys, "--drive", "/nvme0:1TB:6/3", "--drive", "/nvme1:1TB:3/1.5", "--json")
    doc = json.loads(out)
    assert [d["name"] for d in doc["drives"]] == ["/nvme0", "/nvme1"] and doc["striped"]["floor_seconds"] > 0


def test_plan_takes_each_drives_bandwidth_from_bench_io_or_tune(capsys, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    io_json = tmp_path / "io.json"
    io_json.write_text(json.dumps({"summary": {"best_read_GBps": 9.0, "best_write_GBps": 4.5, "drives": [
        {"dir": str(a), "read_GBps": 6.0, "write_GBps": 3.0}, {"dir": str(b), "read_GBps": 3.0, "write_GBps": 1.5}]}}))
    drives = resolve_drives([], io_json=str(io_json))  # the drives bench io measured
    assert [(d.name, d.read_gbps, d.write_gbps) for d in drives] == [(str(a), 6.0, 3.0), (str(b), 3.0, 1.5)]
    assert all(d.free > 0 for d in drives)
    rc, out, _ = _plan(capsys, "--io-json", str(io_json))
    assert rc == 0 and "drives: 2, shards placed by bandwidth" in out
    figures = [DriveFigure(str(a), os.stat(a).st_dev, 2e9), DriveFigure(str(b), os.stat(b).st_dev, 1e9, 2e9, 2e9)]
    knobs = tmp_path / "tuned.json"
    knobs.write_bytes(encode_knobs_file(knobs_document({}, drives=figures)))
    drives = resolve_drives([str(a / "state"), str(b / "state")], knobs=str(knobs))
    assert [(d.read_gbps, d.write_gbps) for d in drives] == [(4.0, 4.0), (2.0, 2.0)]  # read+write 2 and 1 GB/s


@pytest.mark.parametrize(("argv", "message"), [
    (["--drive", "/a", "--disk-free", "1TB"], "--disk-free describes one drive"),
    (["--drive", "/a", "--state-dir", "/a"], "--state-dir describes one drive"),
    (["--drive", "/a", "--read-gbps", "3"], "--read-gbps describes one drive"),
    (["--knobs", "tuned.json"], "--knobs gives the bandwidths of drives named by --drive"),
    (["--drive", "/a:lots"], "SIZE"),
    (["--drive", "/a", "--drive", "/a"], "name '/a' twice"),
])  # fmt: skip
def test_plan_refuses_flags_of_one_drive_with_several(capsys, argv, message):
    rc, _, err = _plan(capsys, *argv)
    assert rc == 2 and message in err, err
