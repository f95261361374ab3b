"""``tierstore bench io DIR DIR...``: each drive alone and all at once, over workers and request sizes (issue 25).

Runs the command on two small directories (one on the disk, one on tmpfs
where ``/dev/shm`` exists), checks the table, the JSON (each drive's figures
and the drives together, where ``tierstore plan --io-json`` reads them) and
the plot; that one directory still gives the full one-drive report; that each
bad option is refused naming it; and the arithmetic the sweep rests on: the
shares of an all-at-once transfer and the summary's ``sum`` and ``all/sum``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore.cli import main
from tierstore.cli.bench import drives, drives_report, io, io_drives, io_options
from tierstore.errors import ClosedError, ConfigError
from tierstore.planner.inputs import read_io_json

MiB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def two_dirs(tmp_path):
    """A directory on the test's drive and one on tmpfs (a faster "drive") where /dev/shm is there."""
    a = tmp_path / "disk"
    a.mkdir()
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        import tempfile

        b = Path(tempfile.mkdtemp(dir=shm, prefix="tierstore-test-"))
    else:  # no tmpfs: a second directory on the same drive still exercises every path
        b = tmp_path / "second"
        b.mkdir()
    yield a, b
    if b.parent == shm:
        import shutil

        shutil.rmtree(b, ignore_errors=True)


def _files(path):
    return sorted(p.name for p in path.iterdir())


def test_two_directories_print_the_sweep_and_write_json_and_png(two_dirs, tmp_path, capsys):
    a, b = two_dirs
    out, png = tmp_path / "io.json", tmp_path / "io.png"
    rc = main(["bench", "io", str(a), str(b), "--quick", "--size", "8MiB", "--requests", "1MiB,2MiB", "--workers", "2",
               "--rounds", "2", "--json", str(out), "--plot", str(png)])
    assert rc == 0
    assert _files(a) == [] and _files(b) == []  # test files removed
    text = capsys.readouterr().out
    assert text.startswith("hardware: ") and f"d0 = {a}" in text and f"d1 = {b}" in text
    header = next(line for line in text.splitlines() if line.startswith("request"))
    assert header.split() == ["request", "workers", "d0", "r", "d0", "w", "d1", "r", "d1", "w", "all", "r", "all", "w",
                              "sum", "r", "sum", "w", "all/sum", "r", "all/sum", "w"]
    assert "best all at once: read " in text and "read+write" in text
    doc = json.loads(out.read_text())
    s = doc["summary"]
    assert [d["dir"] for d in s["drives"]] == [str(a), str(b)] == doc["config"]["dirs"]
    assert all(d["read_GBps"] > 0 and d["write_GBps"] > 0 and d["step_GBps"] > 0 for d in s["drives"])
    assert s["best_read_GBps"] == s["combined"]["read_GBps"] > 0 and s["best_write_GBps"] > 0
    assert s["rounds"] == 2 and {"read", "write"} <= set(s["combined"]["vs_sum"])
    kinds = {row["kind"] for row in doc["settings"]}
    assert kinds == {"d0", "d1", "all", "sum"}
    assert {(row["request_bytes"], row["workers"]) for row in doc["settings"]} == {(MiB, 2), (2 * MiB, 2)}
    together = [t for t in doc["trials"] if t["kind"] == "all"]
    assert len(together) == 2 * 2 * 2  # rounds x settings x (read, write)
    assert all(sum(t["shares"]) == 8 * MiB and len(t["shares"]) == 2 for t in together)
    assert doc["verdict"] == "UNDECIDED" and doc["hardware"].startswith("hardware: ")
    assert png.read_bytes()[:4] == b"\x89PNG"
    # The planner reads the drives together, as it reads one drive's file.
    speeds = read_io_json(out)
    assert speeds["read_gbps"] == pytest.approx(s["best_read_GBps"]) and speeds["memory_gbps"] > 0


def test_one_directory_keeps_the_one_drive_report(tmp_path, capsys):
    drive = tmp_path / "drive"
    drive.mkdir()
    out = tmp_path / "one.json"
    assert main(["bench", "io", str(drive), "--quick", "--size", "8MiB", "--requests", "1MiB", "--workers", "2", "--rounds", "1",
                 "--backends", "direct", "--no-dd", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("hardware: ") and "best drive read" in text and "d0 =" not in text
    doc = json.loads(out.read_text())
    assert doc["config"]["dir"] == str(drive) and "drives" not in doc["summary"]
    assert {"raw", "direct"} <= set(doc["summary"]["best"])


def _args(argv):
    import argparse

    parser = argparse.ArgumentParser()
    io.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--size", "1MiB"], "below 4 MiB"),
        (["--size", "lots"], "not a size"),
        (["--requests", "3000"], "multiples of 4 KiB"),
        (["--workers", "0"], ">= 1"),
        (["--backends", "direct,mmap"], "measures one backend"),
        (["--backends", "floppy"], "unknown"),
        (["--rounds", "0"], ">= 1"),
    ],
)
def test_several_directories_reject_bad_options(tmp_path, extra, message):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    with pytest.raises(ConfigError, match=message):
        io_drives.DrivesConfig.from_args(_args([str(a), str(b), *extra]))


def test_directories_are_checked_one_by_one(tmp_path, capsys):
    a = tmp_path / "a"
    a.mkdir()
    (tmp_path / "link").symlink_to(a)
    with pytest.raises(ConfigError, match="give the directory to measure"):
        io_options.directories_of(_args([]))
    with pytest.raises(ConfigError, match=r"given twice; give each directory once"):
        io_drives.DrivesConfig.from_args(_args([str(a), str(tmp_path / "link")]))
    with pytest.raises(ConfigError, match=r"given twice"):
        io_drives.DrivesConfig.from_args(_args([str(a), "--dir", str(tmp_path / "." / "a")]))
    assert main(["bench", "io", str(a), str(tmp_path / "nope")]) == 2  # a missing input: usage
    assert "'" + str(tmp_path / "nope") + "' is not a directory" in capsys.readouterr().err
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="is not a directory"):
        io_drives.DrivesConfig.from_args(_args([str(a), str(f)]))


def test_unwritable_directory_is_refused(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    monkeypatch.setattr(io_options.os, "access", lambda path, mode: Path(path) != b)
    with pytest.raises(ConfigError, match=f"'{b}' is not writable"):
        io_drives.DrivesConfig.from_args(_args([str(a), str(b)]))


def test_bench_io_refuses_a_machine_without_room(tmp_path, monkeypatch):
    from tierstore.cli.bench import resources

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    monkeypatch.setattr(resources, "available_ram", lambda: 1 << 20)
    monkeypatch.setattr(drives.DriveSet, "open", lambda self: pytest.fail("allocated before checking"))
    with pytest.raises(ConfigError, match="over 2 directories needs about"):
        io_drives.run(_args([str(a), str(b), "--quick"]))


# -- the pieces ------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    weights=st.lists(st.one_of(st.floats(0.01, 100.0), st.just(0.0), st.just(float("nan"))), min_size=1, max_size=6),
    units=st.integers(0, 200),
    extra=st.integers(0, 4095),
    cap_units=st.integers(1, 120),
)
def test_shares_add_up_respect_the_cap_and_follow_the_weights(weights, units, extra, cap_units):
    align = 1 << 16
    total, cap = units * align + extra, cap_units * align + 4096
    if cap * len(weights) < total:
        with pytest.raises(ConfigError, match="do not fit"):
            drives.proportional_shares(total, weights, align=align, cap=cap)
        return
    shares = drives.proportional_shares(total, weights, align=align, cap=cap)
    assert sum(shares) == total and all(0 <= s <= cap for s in shares)
    good = [w if w == w and w > 0 else 0.0 for w in weights]
    if any(good) and all(s < cap - align for s in shares):  # nobody capped: each within two units of its share
        for s, w in zip(shares, good):
            assert abs(s - total * w / sum(good)) <= 2 * align + extra


def test_drive_set_moves_bytes_and_refuses_misuse(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    ds = drives.DriveSet([a, b], size=4 * MiB, backend="buffered")
    with pytest.raises(ClosedError, match="not open"):
        ds.alone(0, "read", request_bytes=MiB, workers=1)
    with ds.open():
        assert [d.backend for d in ds.drives] == ["buffered", "buffered"]
        assert all(f.stat().st_size == 4 * MiB for f in ds.files)
        assert ds.together("write", [3 * MiB, MiB], request_bytes=MiB, workers=2) > 0
        with pytest.raises(ConfigError, match="one per drive"):
            ds.together("read", [5 * MiB, 0], request_bytes=MiB, workers=2)
    assert _files(a) == [] and _files(b) == []
    ds.close()  # twice is fine


def test_summary_adds_the_drives_alone_and_divides_round_by_round():
    trials = []
    for rnd, (d0, d1, together) in enumerate(((1.0, 1.0, 0.6), (0.5, 1.0, 0.5), (1.0, 0.5, 0.4))):
        for op in ("read", "write"):
            for kind, seconds in (("d0", d0), ("d1", d1), ("all", together)):
                trials.append(SimpleNamespace(kind=kind, op=op, request_bytes=MiB, workers=2, nbytes=10**9,
                                              seconds=seconds, round=rnd))
    described = [{"index": 0, "dir": "/a", "backend": "direct"}, {"index": 1, "dir": "/b", "backend": "direct"}]
    result = drives_report.summarize(trials, drives=described, memory_GBps=[5.0, 6.0])
    row = next(r for r in result["settings"] if r["kind"] == "all" and r["op"] == "read")
    # Each round: all at once / (d0 + d1) in GB/s: (1/0.6)/2, 2/3, 2.5/3.
    assert row["vs_sum_per_round"] == pytest.approx([1 / 1.2, 2 / 3, 2.5 / 3])
    sums = next(r for r in result["settings"] if r["kind"] == "sum" and r["op"] == "read")
    assert sums["GBps_per_round"] == pytest.approx([2.0, 3.0, 3.0])
    s = result["summary"]
    assert s["memory_GBps"] == 6.0 and s["combined"]["step_GBps"] == pytest.approx(1 / (1 / 2.0 + 1 / 2.0))
    text = drives_report.render(result)
    assert "d0 = /a: filesystem unknown, backend direct" in text and "all/sum r" in text


def test_replot_renders_a_several_drive_json(two_dirs, tmp_path):
    import importlib.util

    a, b = two_dirs
    out = tmp_path / "io.json"
    assert main(["bench", "io", str(a), str(b), "--quick", "--size", "4MiB", "--requests", "1MiB", "--workers", "1",
                 "--rounds", "1", "--json", str(out)]) == 0
    spec = importlib.util.spec_from_file_location("replot", ROOT / "bench" / "replot.py")
    replot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(replot)
    png = tmp_path / "again.png"
    text = replot.REPORTS["tierstore bench io"](json.loads(out.read_text()), str(png))
    assert "d1 = " in text and png.read_bytes()[:4] == b"\x89PNG"


# -- bench/multi_drive.py: its verdicts, from made-up rounds ----------------------------------------
def _script(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_multi_drive_judges_each_target_round_by_round():
    bench = _script("multi_drive")
    seconds = {"striped": [1.0, 1.1, 0.9], "disk alone": [2.0, 2.0, 2.0], "fast alone": [1.5, 1.0, 1.2],
               "same-drive pair": [2.2, 2.1, 2.3], "tuned": [1.0, 1.0, 1.0], "floor": [0.9, 1.0, 0.9]}
    rows = {n: {"seconds": s, "split": [{"read_wait": 0.1, "update": 0.2, "write_wait": 0.0}] * 3}
            for n, s in seconds.items()}
    found = {v["key"]: v for v in bench.verdicts_of({"rows": rows, "streamed_bytes": 1 << 30})}
    assert found["striped_vs_floor"]["samples"] == pytest.approx([1 / 0.9, 1.1, 1.0])
    assert found["striped_vs_floor"]["verdict"] == "PASS"  # median 1.1 <= 1.15
    assert found["striped_vs_fastest_alone"]["samples"] == pytest.approx([1 / 1.5, 1.1, 0.9 / 1.2])
    assert found["same_drive_pair_vs_one"]["median"] == pytest.approx(1.1)
    assert found["same_drive_pair_vs_one"]["verdict"] == "FAIL"  # above 1.05x
    assert found["tuned_vs_defaults"]["samples"] == pytest.approx([1.0, 1 / 1.1, 1 / 0.9])
    doc = {"machine": {"cpu_model": "x", "cpus": 2}, "drives": {"disk": "/d on ext4", "fast": "loop"},
           "config": {"params": 10, "budget": "1/8"}, "interleaved": {"rows": rows, "streamed_bytes": 1 << 30},
           "verdicts": list(found.values())}
    text = bench.render(doc)
    assert text.startswith("hardware: ") and "\nfloor " in text and "; 3 rounds, the order rotating" in text
    assert "FAIL  two directories on the same drive: step / the one-directory step: median 1.10x" in text


def test_multi_drive_refuses_bad_options_before_it_allocates(tmp_path):
    bench = _script("multi_drive")
    with pytest.raises(ConfigError, match="only tune and big can be skipped"):
        bench.main(["--dir", str(tmp_path), "--skip", "lunch"])
    with pytest.raises(ConfigError, match="--rounds=0 must be >= 1"):
        bench.main(["--dir", str(tmp_path), "--rounds", "0"])
    with pytest.raises(ConfigError, match="not a parameter count"):
        bench.main(["--dir", str(tmp_path), "--params", "many"])
    with pytest.raises(SystemExit):
        bench.main([])  # --dir is required
    assert list(tmp_path.iterdir()) == []
