"""``tierstore tune`` and the knobs file ``TieredAdamW(knobs=...)`` reads (issue 25, item 4).

- the knobs file is read as every file read back is: never through a link,
  a regular file, bounded, strict JSON, known keys, every value checked by
  its knob and bounded; each refusal names the file, the entry and the fix;
- the optimizer takes from it only the knobs its caller left at their
  defaults (an explicit argument wins, even one equal to the default), and a
  state runs with any knobs file: resumed with another one, or none, the
  results stay bitwise those of ``torch.optim.AdamW(fused=True)``;
- the tuner's picks follow their measurements, and the file it writes holds
  its picks only when their streamed step was faster than the defaults',
  else the defaults, saying so;
- every bad option of ``tierstore tune`` is refused before anything is measured.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tierstore import TieredAdamW
from tierstore._config import knobs_file
from tierstore._config.knobs import Knobs
from tierstore._config.knobs_file import (
    FORMAT_NAME,
    FORMAT_VERSION,
    DriveFigure,
    KnobsFile,
    read_knobs_file,
)
from tierstore._config.registry import KNOBS
from tierstore.cli import main
from tierstore.cli import tune as tune_cli
from tierstore.cli.tune import picks, verify
from tierstore.errors import ConfigError, FormatVersionError
from tierstore.tiered_optimizer import TieredOptimizer

MiB = 1 << 20
TUNED = {"io_workers": 2, "request_bytes": 4 * MiB, "prefetch_depth": 3, "update_threads": 1}


def _write(path: Path, doc) -> Path:
    path.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
    return path


def _doc(**extra):
    return {"format": FORMAT_NAME, "version": FORMAT_VERSION, "knobs": dict(TUNED), **extra}


# -- the file ------------------------------------------------------------------------------
def test_a_knobs_file_reads_back_what_tune_writes(tmp_path):
    figure = DriveFigure(str(tmp_path), os.stat(tmp_path).st_dev, 2e9, 3e9, 6e9, "direct")
    doc = knobs_file.knobs_document(TUNED, drives=[figure], shard_numel=8 << 20, measurements={"io": {"why": "x"}},
                                    written_by="tierstore tune test")
    path = tmp_path / "tuned.json"
    path.write_bytes(knobs_file.encode_knobs_file(doc))
    tuned = read_knobs_file(path)
    assert tuned.knobs == TUNED and tuned.drives == (figure,) and tuned.shard_numel == 8 << 20
    assert tuned.fallback is False and tuned.path == str(path)
    assert tuned.bandwidths_for([tmp_path / "state"]) == [2e9]  # a directory to be made: its parent's drive
    assert read_knobs_file(str(path)).knobs == TUNED  # a str works as a Path does


def test_directories_on_one_drive_share_its_figure_from_a_knobs_file(tmp_path):
    # As the optimizer's own probe: a drive's figure is split equally between its directories, so a pair on
    # one drive places half and half, and beside another drive weighs as one directory there would.
    disk = DriveFigure(str(tmp_path / "a"), os.stat(tmp_path).st_dev, 2e9)
    (tmp_path / "a").mkdir()
    tuned = KnobsFile("k.json", drives=(disk,))
    assert tuned.bandwidths_for([tmp_path / "a", tmp_path / "b"]) == [1e9, 1e9]
    assert tuned.bandwidths_for([tmp_path / "a" / "state"]) == [2e9]
    other = "/dev/shm"
    if os.path.isdir(other) and os.stat(other).st_dev != os.stat(tmp_path).st_dev:
        both = KnobsFile("k.json", drives=(disk, DriveFigure(other, os.stat(other).st_dev, 3e9)))
        assert both.bandwidths_for([tmp_path / "a", other + "/x", tmp_path / "b"]) == [1e9, 3e9, 1e9]
    # tune measured both directories of one drive: one figure, their mean, shared
    twice = KnobsFile("k.json", drives=(disk, DriveFigure(str(tmp_path / "b"), os.stat(tmp_path).st_dev, 4e9)))
    assert twice.bandwidths_for([tmp_path / "a", tmp_path / "b"]) == [1.5e9, 1.5e9]


def test_explicit_arguments_win_even_at_the_default_value():
    tuned = KnobsFile("k.json", knobs=dict(TUNED))
    left = {name: KNOBS[name].default for name in TUNED}
    assert tuned.apply(left) == TUNED  # every knob left at its default: the file's values
    explicit = {"io_workers": 8, "request_bytes": 1 << 20, "prefetch_depth": 2, "update_threads": 4}
    assert tuned.apply(explicit) == explicit  # passed on purpose, 8 is not the default object
    assert all(type(KNOBS[n].default) is not int for n in ("io_workers", "request_bytes", "prefetch_depth"))


BAD_FILES = [
    ("not json {", "is not valid JSON"),
    (b"\xff\xfe", "is not valid JSON"),
    ('{"format": "tierstore-knobs", "version": 1, "knobs": {"io_workers": NaN}}', "is not valid JSON"),
    ("[" * 100_000 + "]" * 100_000, "is not valid JSON"),
    ({"format": "other"}, 'is not a knobs file (no "format"'),
    ([1, 2], "is not a knobs file"),
    (_doc(version=0), "has version 0"),
    (_doc(version=True), "has version True"),
    (_doc(extra=1), "has unknown keys ['extra']"),
    (_doc(knobs=[1]), "'knobs' is [1], not an object"),
    (_doc(knobs={"shard_numel": 1 << 20}), "knobs.shard_numel is part of the state's identity"),
    (_doc(knobs={"moment_dtype": "int8"}), "knobs.moment_dtype is part of the state's identity"),
    (_doc(knobs={"ram_budget": "1GiB"}), "knobs.'ram_budget' is not a knob a knobs file may set"),
    (_doc(knobs={"io_workers": 0}), "knobs.io_workers=0 must be an int >= 1"),
    (_doc(knobs={"io_workers": True}), "knobs.io_workers=True must be an int"),
    (_doc(knobs={"io_workers": 2.5}), "knobs.io_workers=2.5 must be an int"),
    (_doc(knobs={"io_workers": 100_000}), "knobs.io_workers=100000 is above 256"),
    (_doc(knobs={"request_bytes": 4097}), "knobs.request_bytes=4097 must be a multiple of 4096"),
    (_doc(knobs={"request_bytes": 1 << 40}), "is above 268435456"),
    (_doc(knobs={"prefetch_depth": 65}), "knobs.prefetch_depth=65 is above 64"),
    (_doc(knobs={"update_threads": -1}), "knobs.update_threads=-1 must be an int >= 1"),
    (_doc(drives={"a": 1}), "'drives' is {'a': 1}, not a list"),
    (_doc(drives=[{"path": "/x", "bandwidth": 1e9}] * 65), "lists 65 drives, more than 64"),
    (_doc(drives=[3]), "drives[0] is 3, not an object"),
    (_doc(drives=[{"path": "/x", "bandwidth": 1e9, "speed": 1}]), "drives[0] has unknown keys ['speed']"),
    (_doc(drives=[{"bandwidth": 1e9}]), "drives[0].path=None is not a directory's path"),
    (_doc(drives=[{"path": "/x\0y", "bandwidth": 1e9}]), "is not a directory's path"),
    (_doc(drives=[{"path": "/x", "bandwidth": -1}]), "drives[0].bandwidth=-1 must be a number of bytes per second"),
    (_doc(drives=[{"path": "/x", "bandwidth": 1e30}]), "must be a number of bytes per second above 0 and at most"),
    (_doc(drives=[{"path": "/x", "bandwidth": "fast"}]), "drives[0].bandwidth='fast' is not a number"),
    (_doc(drives=[{"path": "/x", "bandwidth": True}]), "drives[0].bandwidth=True is not a number"),
    (_doc(drives=[{"path": "/x", "bandwidth": 1e9, "read_bandwidth": 0}]), "drives[0].read_bandwidth=0 must be"),
    (_doc(drives=[{"path": "/x", "bandwidth": 1e9, "device": -1}]), "drives[0].device=-1 is not a device number"),
    (_doc(drives=[{"path": "/x", "bandwidth": 1e9, "backend": "tape"}]), "drives[0].backend='tape' is unknown"),
    (_doc(suggested=[]), "'suggested' is [], not an object"),
    (_doc(suggested={"shard": 1}), "'suggested' has unknown keys ['shard']"),
    (_doc(suggested={"shard_numel": 1 << 40}), "suggested.shard_numel=1099511627776 is above"),
    (_doc(suggested={"shard_numel": 0}), "suggested.shard_numel=0 must be an int >= 1"),
    (_doc(fallback="yes"), "'fallback' is 'yes', not true or false"),
]


@pytest.mark.parametrize(("content", "message"), BAD_FILES, ids=range(len(BAD_FILES)))
def test_a_crafted_knobs_file_is_refused_naming_the_entry_and_the_fix(tmp_path, content, message):
    path = tmp_path / "k.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        _write(path, content)
    with pytest.raises(ConfigError) as caught:
        read_knobs_file(path)
    text = str(caught.value)
    assert message in text and f"knobs file {str(path)!r}" in text, text
    assert len(text) < 600, "a crafted value is cut short in the message"


def test_a_knobs_file_from_a_newer_tierstore_is_a_version_error(tmp_path):
    path = _write(tmp_path / "k.json", _doc(version=FORMAT_VERSION + 1))
    with pytest.raises(FormatVersionError, match="upgrade tierstore"):
        read_knobs_file(path)


def test_only_a_regular_file_is_read_never_through_a_link(tmp_path):
    real = _write(tmp_path / "real.json", _doc())
    (tmp_path / "link.json").symlink_to(real)
    os.mkfifo(tmp_path / "fifo.json")
    (tmp_path / "dir.json").mkdir()
    cases = [(tmp_path / "link.json", "is a symbolic link; a knobs file is never read through one"),
             (tmp_path / "fifo.json", "is a FIFO, not a regular file"),  # refused at once, never blocks
             (tmp_path / "dir.json", "is a directory, not a regular file"),
             (tmp_path / "none.json", "does not exist"),
             (42, "must be the path of a knobs file"),
             ("", "is not a file path"),
             ("a\0b", "is not a file path")]
    for path, message in cases:
        with pytest.raises(ConfigError, match=message):
            read_knobs_file(path)


def test_a_knobs_file_too_large_is_refused_before_it_is_parsed(tmp_path, monkeypatch):
    path = _write(tmp_path / "k.json", _doc(measurements={"pad": "x" * 2048}))
    monkeypatch.setattr(knobs_file, "MAX_KNOBS_FILE_BYTES", 1024)
    with pytest.raises(ConfigError, match="more than the 1 KiB a knobs file may be"):
        read_knobs_file(path)
    with pytest.raises(ConfigError, match="would not read back"):
        knobs_file.encode_knobs_file(_doc(measurements={"pad": "x" * 2048}))
    with pytest.raises(ConfigError, match="knobs.io_workers=0"):
        knobs_file.knobs_document({"io_workers": 0})
    with pytest.raises(ConfigError, match="unknown keys"):
        knobs_file.knobs_document({}, colour="blue")


# -- the optimizer reads it ---------------------------------------------------------------
def test_the_optimizer_takes_the_files_knobs_unless_given(tmp_path):
    path = _write(tmp_path / "k.json", _doc())
    w = torch.nn.Parameter(torch.ones(8))
    with TieredAdamW([w], knobs=path) as opt:
        assert opt._knobs == Knobs(**TUNED)
    with TieredAdamW([w], knobs=str(path), io_workers=8, update_threads=2) as opt:
        assert (opt._knobs.io_workers, opt._knobs.update_threads, opt._knobs.prefetch_depth) == (8, 2, 3)
    with pytest.raises(ConfigError, match="knobs.io_workers=0"):
        TieredAdamW([w], knobs=_write(tmp_path / "bad.json", _doc(knobs={"io_workers": 0})))


def test_every_front_defaults_to_the_registrys_default_objects():
    """A front whose signature wrote a plain 8 would make every call 'explicit': the file would never apply."""
    for cls in (TieredOptimizer, TieredAdamW):
        params = inspect.signature(cls.__init__).parameters
        for name in ("io_workers", "request_bytes", "prefetch_depth"):
            assert params[name].default is KNOBS[name].default, (cls.__name__, name)
        assert params["knobs"].default is None


def _torch_steps(params, grads, steps):
    ref = [p.detach().clone().requires_grad_() for p in params]
    opt = torch.optim.AdamW(ref, lr=1e-2, fused=True)
    for k in range(steps):
        for p, g in zip(ref, grads[k]):
            p.grad = g.clone()
        opt.step()
    return ref


def test_a_state_runs_with_any_knobs_file(tmp_path):
    """Made with one knobs file, resumed with another and with none: bitwise torch's AdamW throughout."""
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(20_000, generator=gen)),
              torch.nn.Parameter(torch.randn(12_000, generator=gen))]
    grads = [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(6)]
    expected = _torch_steps(params, grads, 6)
    first = _write(tmp_path / "a.json", _doc(knobs={"io_workers": 1, "request_bytes": 4096 * 16, "prefetch_depth": 1,
                                                    "update_threads": 1}))
    second = _write(tmp_path / "b.json", _doc(knobs={"io_workers": 5, "request_bytes": 8 * MiB, "prefetch_depth": 4,
                                                     "update_threads": 2}))
    state = tmp_path / "state"
    step = 0
    for knobs, resume in ((first, False), (second, True), (None, True)):
        with TieredAdamW(params, lr=1e-2, state_dir=state, ram_budget=60_000, shard_numel=1024, knobs=knobs,
                         resume=resume) as opt:
            for _ in range(2):
                for p, g in zip(params, grads[step]):
                    p.grad = g.clone()
                opt.step()
                step += 1
    for p, ref in zip(params, expected):
        assert torch.equal(p.detach(), ref.detach())


# -- the picks ---------------------------------------------------------------------------
def _settings(points, kind="all"):
    return [{"kind": kind, "op": op, "request_bytes": r, "workers": w, "GBps": g}
            for r, w, g in points for op in ("read", "write")]


def test_the_io_pick_is_the_fastest_setting_or_the_lightest_within_tolerance():
    fast = picks.pick_io(_settings([(MiB, 4, 1.0), (16 * MiB, 8, 2.0)]), kind="all")
    assert fast.value == {"io_workers": 8, "request_bytes": 16 * MiB} and "the best of 2 settings" in fast.why
    assert "read 2.00 GB/s and write 2.00 GB/s there (read+write 1.00 GB/s)" in fast.why
    close = picks.pick_io(_settings([(MiB, 4, 1.97), (16 * MiB, 8, 2.0)]), kind="all")
    assert close.value == {"io_workers": 4, "request_bytes": MiB} and "within 5%" in close.why
    with pytest.raises(ConfigError, match="nothing to pick from"):
        picks.pick_io(_settings([(MiB, 4, 1.0)], kind="d0"), kind="all")


def test_prefetch_shard_size_and_threads_follow_their_measurements():
    even = picks.pick_prefetch([1e9, 1e9], io_workers=8, request_bytes=MiB, shard_numel=4 << 20)
    assert even.value == 2 and "one shard of every 2" in even.why
    deep = picks.pick_prefetch([1e9], io_workers=32, request_bytes=16 * MiB, shard_numel=4 << 20)
    assert deep.value == 8 and "16 bounded to 2..8" in deep.why  # 16 shards in flight would fill the queue
    assert picks.pick_prefetch([4e9, 1e9], io_workers=8, request_bytes=MiB, shard_numel=4 << 20).value == 5
    big = picks.suggest_shard_numel(io_workers=16, request_bytes=16 * MiB)
    assert big.value == 32 << 20 and "identity" in big.why
    threads = picks.pick_threads({1: [0.30, 0.31, 0.29], 2: [0.50, 0.52, 0.49]}, numel=4 << 20, updates=10)
    assert threads.value == 1 and "10 AdamW updates of a 4 Mi-element shard" in threads.why and "2 threads 0.500 s" in threads.why
    assert picks.pick_threads({1: [0.30], 2: [0.20]}).value == 2
    with pytest.raises(ConfigError, match="nothing to pick update_threads from"):
        picks.pick_threads({1: []})


# -- the command -----------------------------------------------------------------------------
@pytest.fixture
def two_dirs(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    return a, b


QUICK = ["--quick", "--size", "8MiB", "--requests", "1MiB", "--workers", "2,4", "--rounds", "1", "--threads", "1,2",
         "--step-params", "2e5", "--step-rounds", "1"]


def _comparison(ratio):
    result = verify.StepComparison(params=200_000)
    result.tuned_s, result.default_s = [ratio * 0.1, ratio * 0.1, ratio * 0.1], [0.1, 0.1, 0.1]
    return result


def test_tune_writes_its_picks_when_their_step_is_faster(two_dirs, tmp_path, capsys, monkeypatch):
    out = tmp_path / "tuned.json"
    monkeypatch.setattr(verify, "compare_steps", lambda *a, **k: _comparison(0.8))
    assert main(["tune", *map(str, two_dirs), *QUICK, "--out", str(out), "--json", str(tmp_path / "all.json")]) == 0
    text = capsys.readouterr().out
    tuned = read_knobs_file(out)
    assert not tuned.fallback and set(tuned.knobs) == set(TUNED) and len(tuned.drives) == 2
    assert tuned.knobs["io_workers"] in (2, 4) and tuned.knobs["request_bytes"] == MiB
    # both directories are on tmp_path's drive: they share one figure (the mean of tune's two), half each
    shared = (tuned.drives[0].bandwidth + tuned.drives[1].bandwidth) / 2 / 2
    assert tuned.bandwidths_for(two_dirs) == pytest.approx([shared, shared])
    for line in ("picks (each with the measurement behind it):", "  io_workers=", "  prefetch_depth=",
                 "  update_threads=", "  shard_numel=", f"  drive {two_dirs[1]}: ", "picks / defaults median 0.800x",
                 f"wrote {out}: the picks"):
        assert line in text, line
    full = json.loads((tmp_path / "all.json").read_text())
    assert full["knobs_file"]["knobs"] == tuned.knobs and full["update_threads"]["updates_per_run"] >= 1
    assert all(not list(d.iterdir()) for d in two_dirs)  # test files removed


def test_tune_writes_the_defaults_when_its_pick_is_not_faster(two_dirs, tmp_path, capsys, monkeypatch):
    out = tmp_path / "tuned.json"
    monkeypatch.setattr(verify, "compare_steps", lambda *a, **k: _comparison(1.0))  # a tie is not faster
    assert main(["tune", *map(str, two_dirs), *QUICK, "--out", str(out)]) == 0
    tuned = read_knobs_file(out)
    defaults = Knobs()
    assert tuned.fallback and tuned.drives == ()
    assert tuned.knobs == {"io_workers": defaults.io_workers, "request_bytes": defaults.request_bytes,
                           "prefetch_depth": defaults.prefetch_depth, "update_threads": None}
    assert f"wrote {out}: THE DEFAULTS, not the picks" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["measurements"]["step"]["median_ratio"] == 1.0 and len(doc["measurements"]["drives_measured"]) == 2


def test_tune_end_to_end_on_one_directory(tmp_path, capsys):
    """The real check (no stand-in): whichever way it goes, the file reads back and says which it holds."""
    drive = tmp_path / "drive"
    drive.mkdir()
    out = tmp_path / "tuned.json"
    assert main(["tune", str(drive), *QUICK, "--out", str(out), "--plot", str(tmp_path / "sweep.png")]) == 0
    tuned = read_knobs_file(out)
    text = capsys.readouterr().out
    assert ("THE DEFAULTS" in text) == tuned.fallback and (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads(out.read_text())["measurements"]["step"]["params"] == 200_000
    assert list(drive.iterdir()) == []


def _config(argv):
    parser = argparse.ArgumentParser()
    tune_cli.add_arguments(parser)
    return tune_cli.TuneConfig(parser.parse_args(argv))


@pytest.mark.parametrize(("extra", "message"), [
    (["--size", "1MiB"], "below 4 MiB"),
    (["--requests", "3000"], "multiples of 4 KiB"),
    (["--workers", "0"], ">= 1"),
    (["--threads", "two"], "whole numbers"),
    (["--rounds", "0"], "--rounds=0 must be an int >= 1"),
    (["--step-rounds", "0"], "--step-rounds=0 must be an int >= 1"),
    (["--step-params", "many"], "not a parameter count"),
    (["--backend", "tape"], "--backend='tape' is unknown"),
])  # fmt: skip
def test_tune_rejects_bad_options(two_dirs, tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        _config([*map(str, two_dirs), "--out", str(tmp_path / "k.json"), *extra])


def test_tune_refuses_an_output_it_cannot_write_and_bad_directories(two_dirs, tmp_path, capsys):
    a, b = map(str, two_dirs)
    (tmp_path / "exists.json").write_text("{}")
    (tmp_path / "link.json").symlink_to(tmp_path / "exists.json")
    cases = [([a, "--out", str(tmp_path / "exists.json")], "exists; pass --overwrite to replace it"),
             ([a, "--out", str(tmp_path)], "is a directory; pass a file path"),
             ([a, "--out", str(tmp_path / "link.json"), "--overwrite"], "is not a regular file"),
             ([a, "--out", str(tmp_path / "no" / "k.json")], "does not exist; create it"),
             ([a, str(tmp_path / "nope"), "--out", str(tmp_path / "k.json")], "is not a directory"),
             ([a, a, "--out", str(tmp_path / "k.json")], "given twice")]
    for argv, message in cases:
        with pytest.raises(ConfigError, match=message):
            _config(argv)
    assert main(["tune", a, b, "--out", str(tmp_path / "exists.json")]) == 2  # a usage error, before measuring
    assert "exists; pass --overwrite" in capsys.readouterr().err
    assert (tmp_path / "exists.json").read_text() == "{}"


def test_tune_help_imports_no_torch():
    code = ("import contextlib, io, sys\nfrom tierstore.cli import main\nwith contextlib.redirect_stdout(io.StringIO()):"
            "\n    try:\n        main(['tune', '--help'])\n    except SystemExit:\n        pass\nprint('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr


@pytest.fixture
def disk_and_fast(tmp_path):
    """A directory on the disk and one on a second drive (tmpfs): a knobs file's figures are per drive."""
    from tierstore._config.knobs_file import device_of
    from tierstore.testing.drives import second_drive

    drive = second_drive(tmp_path)
    dirs = [tmp_path / "a", drive.path / "b"]
    if device_of(dirs[0]) == device_of(dirs[1]):
        drive.close()
        pytest.skip(f"no second filesystem here ({drive.describe()}): directories on one drive share its figure")
    yield dirs
    drive.close()


def test_a_state_over_two_drives_keeps_its_placement_whatever_the_knobs_file(tmp_path, disk_and_fast):
    """Placed by one file's bandwidths, resumed with a file that says the opposite and with none: the same shards."""
    from tierstore._config.knobs_file import device_of

    dirs = disk_and_fast
    gen = torch.Generator().manual_seed(5)
    params = [torch.nn.Parameter(torch.randn(30_000, generator=gen))]
    grads = [[torch.randn(30_000, generator=gen)] for _ in range(4)]
    expected = _torch_steps(params, grads, 4)

    def knobs(name, speeds):
        figures = [DriveFigure(str(d), device_of(d), bw) for d, bw in zip(dirs, speeds)]
        path = tmp_path / name
        path.write_bytes(knobs_file.encode_knobs_file(knobs_file.knobs_document({"io_workers": 2}, drives=figures)))
        return path

    placements = []
    step = 0
    runs = ((knobs("fast-first.json", (3e9, 1e9)), False, 2), (knobs("slow-first.json", (1e9, 3e9)), True, 1),
            (None, True, 1))
    for knob, resume, steps in runs:
        with TieredAdamW(params, lr=1e-2, state_dir=[str(d) for d in dirs], ram_budget=60_000, shard_numel=1024,
                         knobs=knob, resume=resume) as opt:
            for _ in range(steps):
                for p, g in zip(params, grads[step]):
                    p.grad = g.clone()
                opt.step()
                step += 1
        placements.append(json.loads((dirs[0] / "manifest.json").read_text())["drives"]["placement"])
    assert placements[0] == placements[1] == placements[2]
    assert placements[0].count(0) > placements[0].count(1)  # the first file's 3:1 decided it
    for p, ref in zip(params, expected):
        assert torch.equal(p.detach(), ref.detach())
