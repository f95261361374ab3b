"""``ram_budget`` is a hard limit, measured: peak RSS growth of real runs, each in a fresh process.

Every test runs a scenario of :mod:`tierstore.testing.memory` in a child
Python process: the model and its gradients are built, torch's one-time
optimizer cost (the ``torch._dynamo`` import any ``torch.optim`` optimizer
triggers) is paid, the baseline RSS is taken, and then the real thing runs.
The promise checked: the peak RSS growth over the baseline is at most
``ram_budget + OVERHEAD_BYTES`` (16 MiB, whatever the model size), and with
``backend="direct"`` the state files take no page cache. The state is at
least 10x the budget (8 MiB budget, 80 MiB of state), so a buffer the size of
the state, or of a fraction of it, cannot hide in the overhead.

A mode that cannot keep the promise yet is marked ``xfail(strict=True)``
with the measured figures and the code to blame (none is today), so the
test flips to a failure ("XPASS strict") when the fix lands.
"""

from __future__ import annotations

import functools
import json

import pytest

from tierstore.testing.memory import OVERHEAD_BYTES, MemoryProbe, MemoryReport, run_in_child

MiB = 1 << 20
BUDGET = 8 * MiB
FP32_PARAMS = 10_500_000  # 80 MiB of fp32 moments: 10x the budget
BF16_PARAMS = 7_000_000  # 80 MiB of fp32 masters and moments
COMPRESSED_PARAMS = {"bfloat16": 21_000_000, "int8": 42_000_000}  # 80 MiB of bf16 / int8 moments (no masters)
DIRECT_CACHE_SLACK = 1 * MiB  # page cache the direct backend's state files may hold (none expected)
RETAINED_SLACK = 1 * MiB  # RSS a finished phase may leave behind (Python objects, library pages)
CHUNK_SCRATCH_SLACK = 2 * MiB  # RSS a checkpoint phase may add while it runs: a 1 MiB scratch buffer and objects

child = pytest.mark.slow  # starts a Python process: several seconds on a busy 2-core machine


@functools.cache
def _run(scenario: str, frozen: str) -> MemoryReport:
    return run_in_child(scenario, json.loads(frozen))


def measured(scenario: str, *, state_over_budget: float = 10, **config: object) -> MemoryReport:
    """The report of ``scenario`` under ``config`` (runs once per distinct config in this session).

    Checks the premise (the state is ``state_over_budget`` times the budget)
    with ``pytest.fail``, not ``assert``: an ``xfail(raises=AssertionError)``
    must not pass because of a wrong premise.
    """
    config = {"ram_budget": BUDGET, **config}
    if scenario not in ("verify", "export"):
        config.setdefault("params", FP32_PARAMS)
    report = _run(scenario, json.dumps(config, sort_keys=True))
    if config.get("params") and report.info["state_bytes"] < state_over_budget * report.ram_budget:
        pytest.fail(f"the state is not {state_over_budget}x the budget\n{report.summary()}")
    return report


def assert_within_budget(report: MemoryReport) -> None:
    assert report.within(OVERHEAD_BYTES), (
        f"peak RSS growth {report.peak_growth / MiB:.2f} MiB > budget {report.ram_budget / MiB:.2f} MiB "
        f"+ overhead {OVERHEAD_BYTES / MiB:.0f} MiB\n{report.summary()}"
    )


def assert_no_page_cache(report: MemoryReport) -> None:
    assert report.cache_peak is not None, "mincore is unavailable here"
    assert report.cache_peak <= DIRECT_CACHE_SLACK, (
        f"the direct backend's state files took {report.cache_peak / MiB:.2f} MiB of page cache\n{report.summary()}"
    )


# -- training ------------------------------------------------------------------------


@child
@pytest.mark.parametrize(
    ("backend", "durable", "io_workers"),
    [
        ("direct", False, 8),
        ("direct", True, 8),
        ("direct", True, 1),
        ("buffered", False, 8),
        ("buffered", True, 8),
        ("mmap", False, 8),
        ("mmap", True, 8),
    ],
)
def test_steps_stay_within_budget(backend, durable, io_workers):
    report = measured("steps", backend=backend, durable=durable, io_workers=io_workers, steps=2)
    assert_within_budget(report)
    if backend == "direct":
        assert_no_page_cache(report)


@child
def test_bf16_params_with_fp32_masters_stay_within_budget():
    report = measured("steps", dtype="bfloat16", params=BF16_PARAMS, durable=True, steps=2)
    assert report.info["state_bytes"] >= 12 * BF16_PARAMS  # fp32 masters and two moments
    assert_within_budget(report)
    assert_no_page_cache(report)


@child
@pytest.mark.parametrize(("moment_dtype", "params"), [("bfloat16", COMPRESSED_PARAMS["bfloat16"]), ("int8", COMPRESSED_PARAMS["int8"])])
def test_compressed_moments_stay_within_budget(moment_dtype, params):
    # The decode scratch and the codec workers' temporaries are inside the budget too.
    report = measured("steps", moment_dtype=moment_dtype, params=params, durable=True, steps=2)
    assert_within_budget(report)
    assert_no_page_cache(report)


@child
@pytest.mark.parametrize("moment_dtype", ["bfloat16", "int8"])
def test_zarr_checkpoint_of_compressed_moments_stays_within_budget(moment_dtype):
    report = measured("checkpoint", moment_dtype=moment_dtype, params=COMPRESSED_PARAMS[moment_dtype], durable=True, steps=1)
    assert_within_budget(report)


@child
def test_the_first_optimizer_of_a_fresh_process_stays_within_budget():
    report = measured("steps", durable=True, steps=2, warm_torch_optim=False)
    assert_within_budget(report)


@child
def test_many_small_shards_stay_within_budget():
    report = measured("steps", durable=False, steps=1, shard_numel=1024)
    assert report.info["shards"] >= 10_000
    assert_within_budget(report)


@child
def test_building_a_state_over_two_directories_stays_within_budget(tmp_path, monkeypatch):
    # A state over two directories probes its drive when it is built (no figures given): the probe moves
    # each directory's share of the state, up to 64 MiB (40 MiB here, more than the budget and its
    # overhead together), so it must move them through a small buffer, not hold them.
    from tierstore._storage.drive_speed import probe_nbytes

    monkeypatch.delenv("TIERSTORE_DRIVE_BANDWIDTHS", raising=False)
    dirs = [str(tmp_path / "one"), str(tmp_path / "two")]  # one drive: probed once
    report = measured("steps", state_dir=dirs, durable=False, steps=1)
    assert "over 2 drives" in report.info["describe"], report.info["describe"]
    assert probe_nbytes(report.info["state_bytes"], 2) > BUDGET + OVERHEAD_BYTES
    assert report.phase("construct").peak_growth <= BUDGET + OVERHEAD_BYTES, report.summary()
    assert_within_budget(report)


# -- checkpoints ------------------------------------------------------------------------


@child
def test_zarr_checkpoint_save_and_load_stay_within_budget():
    report = measured("checkpoint", durable=True, steps=1)
    assert_within_budget(report)
    assert_no_page_cache(report)


@child
@pytest.mark.parametrize(
    ("checksum", "load_shard_numel"),
    [("xxh3", None), ("crc32c", None), ("xxh3", 384 << 10)],
    ids=["xxh3", "crc32c", "other-shard-cuts"],
)
def test_zarr_checkpoint_save_and_load_keep_no_chunk_buffers(checksum, load_shard_numel):
    """Chunk files go straight between the arena and the drive (through zarr, save kept one 2 MiB
    chunk and load one per zarr thread: +10 MiB here, up to min(32, cores + 4) x 16 MiB with
    default shards). ``other-shard-cuts`` loads into an optimizer cut into 1.5 MiB shards: chunks
    are then read partly, through 1 MiB of scratch (a whole chunk per field before)."""
    # 2 MiB chunks (shard_numel 512 Ki); the budget must hold four 4 MiB arena slots. What is
    # measured is what a phase leaves behind, so the state need not be 10x the budget.
    report = measured(
        "checkpoint", state_over_budget=3, ram_budget=20 * MiB, shard_numel=512 << 10, durable=False, steps=1,
        checksum=checksum, load_shard_numel=load_shard_numel,
    )
    assert_within_budget(report)
    for previous, phase in zip(report.phases, report.phases[1:]):
        if phase.name in ("save_checkpoint", "load_checkpoint"):
            left = phase.end_growth - previous.end_growth
            assert left <= RETAINED_SLACK, f"{phase.name} left {left / MiB:.2f} MiB behind\n{report.summary()}"
            extra = phase.peak_growth - previous.end_growth  # a chunk per field would be 4 MiB
            assert extra <= CHUNK_SCRATCH_SLACK, f"{phase.name} took {extra / MiB:.2f} MiB more\n{report.summary()}"


MANY_TENSORS = dict(matrix_numel=256 << 10, durable=True, steps=1)  # 40 tensors of 1 MiB: a transformer has hundreds


@child
def test_dcp_save_stays_within_budget():
    """DCP's default writer (one file per rank) keeps the last tensor written under every key until
    the file is complete; the blocks it gets are views of one reused 2 MiB buffer per writer thread,
    so what it keeps is no copy of the state (+84 MiB here when every block was a new tensor)."""
    report = measured("dcp", **MANY_TENSORS, load=True)
    assert report.phase("dcp_save").peak_growth <= report.ram_budget + OVERHEAD_BYTES, report.summary()


@child
def test_dcp_save_with_one_file_per_item_stays_within_budget():
    report = measured("dcp", **MANY_TENSORS, single_file_per_rank=False)
    assert_within_budget(report)


@child
@pytest.mark.parametrize("single_file_per_rank", [True, False])
def test_dcp_save_and_load_with_large_shards_stay_within_budget(single_file_per_rank):
    """8 MiB arena slots (shard_numel 1 Mi, two fields): what the budget's auto shard size gives
    at a 64 MiB budget. Blocks are at most 2 MiB whatever the shard, and shards are read through
    the arena (a two-slot shard cache outside the budget and a tensor per block were +43 MiB).
    The state is 3x the budget to keep the test short; what is measured does not scale with it."""
    report = measured(
        "dcp",
        state_over_budget=3,
        ram_budget=40 * MiB,
        params=16_000_000,
        shard_numel=1 << 20,
        matrix_numel=1 << 20,
        durable=False,
        steps=1,
        single_file_per_rank=single_file_per_rank,
        load=True,
    )
    assert_within_budget(report)


@child
def test_dcp_load_stays_within_budget():
    """DCP's reader fills a staging map of the rank's state (a file), whose pages leave RSS once
    filled and once streamed into the shards (growth was the state size, 80 MiB here)."""
    report = measured("dcp", **MANY_TENSORS, load=True)
    assert report.phase("dcp_load").peak_growth <= report.ram_budget + OVERHEAD_BYTES, report.summary()


# -- the planner's totals against a real run ---------------------------------------------------


@child
@pytest.mark.parametrize(("dtype", "params"), [("float32", FP32_PARAMS), ("bfloat16", BF16_PARAMS)])
def test_the_plan_holds_against_measured_rss(dtype, params):
    """``tierstore plan`` for the very tensors the child builds (same sizes, on the meta device)
    predicts the optimizer's RAM exactly and bounds the measured peak RSS growth, which comes
    within the overhead of the planned total."""
    import torch

    from tierstore.cli.bench.workload import param_sizes
    from tierstore.planner import plan_memory

    tensors = [torch.empty(n, device="meta", dtype=getattr(torch, dtype), requires_grad=True) for n in param_sizes(params)]
    plan = plan_memory(tensors, host_ram=64 << 30, ram_budget=BUDGET, durable=True)
    report = measured("steps", dtype=dtype, params=params, durable=True, steps=2)
    assert plan.verdict == "needs the disk tier" and plan.state == report.info["state_bytes"]
    assert plan.host.ram_nbytes == report.info["optimizer_ram_bytes"]
    planned = plan.host.tierstore_total  # ram_nbytes + OVERHEAD_BYTES
    assert planned - OVERHEAD_BYTES <= report.peak_growth <= planned, (
        f"planned {planned / MiB:.2f} MiB, measured {report.peak_growth / MiB:.2f} MiB\n{report.summary()}"
    )


# -- offline tools on a state directory ------------------------------------------------------


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory) -> str:
    """A durable direct-backend state directory of 80 MiB of state, written by a child process."""
    path = str(tmp_path_factory.mktemp("ram-budget") / "state")
    run_in_child("steps", {"params": FP32_PARAMS, "ram_budget": BUDGET, "durable": True, "steps": 1, "state_dir": path})
    return path


@child
@pytest.mark.parametrize("command", ["verify", "export"])
def test_offline_commands_stay_within_budget(state_dir, command):
    report = measured(command, state_dir=state_dir)
    assert_within_budget(report)


@child
@pytest.mark.parametrize("command", ["verify", "export"])
def test_offline_commands_leave_direct_state_out_of_page_cache(state_dir, command):
    assert_no_page_cache(measured(command, state_dir=state_dir))


# -- the kit itself ------------------------------------------------------------------------


@child
def test_the_kit_catches_64_mib_beyond_the_budget():
    report = measured("steps", durable=False, steps=1, extra_bytes=64 * MiB)
    assert report.phase("construct").peak_growth >= BUDGET + 64 * MiB
    assert not report.within(OVERHEAD_BYTES)
    assert "construct" in report.summary()
    assert MemoryReport.from_json(json.loads(json.dumps(report.to_json()))).peak_growth == report.peak_growth


def test_the_probe_sees_a_transient_peak_that_is_gone_by_the_end():
    from tierstore._platform.hostmem import HostBuffer

    size = 16 * MiB
    probe = MemoryProbe()
    probe.baseline()
    with probe.phase("transient"):
        HostBuffer(size, pin=False).close()  # mapped, touched, unmapped: independent of malloc's state
    phase = probe.phases[0]
    assert phase.peak_growth >= size - MiB
    assert phase.end_growth < size // 2


@pytest.mark.parametrize("request_bytes", [1 * MiB, 8 * MiB])
def test_mmap_backend_maps_little_per_request_in_flight(tmp_path, request_bytes):
    """8 workers per direction, as the optimizer runs them; before the fix the file pages mapped
    at peak were 12-16 MiB with 1 MiB requests (the kernel's read-around on the first fault)
    and 52 MiB with 8 MiB requests (whole requests copied at once)."""
    from tierstore._platform.hostmem import HostBuffer
    from tierstore._storage.transfer import IOQueue
    from tierstore.backends import open_backend

    nbytes = 96 * MiB
    buf = HostBuffer(8 * MiB, pin=False)
    file = open_backend("mmap", tmp_path / "s.bin", nbytes, create=True)
    file.allocate(0, nbytes)
    probe = MemoryProbe(lambda: [tmp_path / "s.bin"])
    try:
        for kind in ("write", "read"):
            probe.baseline()  # drops the file's cached pages: reads fault in from the drive
            with probe.phase(kind), IOQueue(workers=8, request_bytes=request_bytes) as io:
                transfers = [getattr(io, kind)(file, buf.view, offset) for offset in range(0, nbytes, 8 * MiB)]
                for t in transfers:
                    t.wait()
            file.sync()
    finally:
        file.close()
        buf.close()
    for phase in probe.phases:
        assert phase.peak_growth <= 6 * MiB, f"{phase.name}: {phase.peak_growth / MiB:.2f} MiB"


@child
def test_the_child_reports_a_failure_with_its_output():
    with pytest.raises(RuntimeError, match="unknown scenario"):
        run_in_child("no-such-scenario", {"ram_budget": BUDGET})
