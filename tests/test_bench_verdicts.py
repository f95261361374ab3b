"""Benchmark verdicts: a target judged from given per-round numbers, and the report that prints it.

No benchmark runs here: the rounds are made up, so each test takes milliseconds.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from tierstore.cli.bench import io_report
from tierstore.cli.bench.verdict import Target, format_verdict, format_verdicts, judge, overall

TARGET = Target("direct_vs_raw[read]", "reads: direct / raw", ">=", 0.9, source="README.md (Performance)")


@pytest.mark.parametrize(
    ("rounds", "verdict"),
    [
        ([0.95, 1.01, 0.92], "PASS"),  # median 0.95 meets >= 0.9
        ([0.95, 0.80, 0.85, 0.88], "FAIL"),  # median 0.865 misses it, though one round meets it
        ([0.99, 1.2], "UNDECIDED"),  # two rounds: too few for a verdict, however good
        ([], "UNDECIDED"),
    ],
)
def test_verdict_is_decided_on_the_median_of_at_least_three_rounds(rounds, verdict):
    v = judge(TARGET, rounds)
    assert v["verdict"] == verdict
    assert v["repeats"] == len(rounds)
    if rounds:
        assert v["min"] == min(rounds) and v["max"] == max(rounds)


def test_a_failing_median_with_a_passing_round_says_the_range_crosses_the_target():
    v = judge(TARGET, [0.95, 0.80, 0.85, 0.88])
    assert v["spread_crosses_target"] is True
    assert "the range crosses the target" in format_verdict(v)


def test_printed_verdict_names_the_target_the_verdict_and_the_spread():
    line = format_verdict(judge(TARGET, [0.95, 1.01, 0.92]))
    assert line.startswith("PASS")
    assert "reads: direct / raw" in line and "target >= 0.90x" in line and "[README.md (Performance)]" in line
    assert "median 0.95x" in line and "range 0.92-1.01" in line and "over 3 repeats" in line
    undecided = format_verdict(judge(TARGET, [0.99, 1.2]))
    assert undecided.startswith("UNDECIDED") and "at least 3 interleaved repeats" in undecided
    block = format_verdicts([judge(TARGET, [0.95, 1.0, 0.97]), judge(TARGET, [0.5, 0.6, 0.55])])
    assert block.splitlines()[0].startswith("targets: 1 PASS, 1 FAIL")


def test_overall_is_fail_before_undecided_before_pass():
    assert overall([judge(TARGET, [1, 1, 1]), judge(TARGET, [0.1, 0.1, 0.1])]) == "FAIL"
    assert overall([judge(TARGET, [1, 1, 1]), judge(TARGET, [1])]) == "UNDECIDED"
    assert overall([judge(TARGET, [1, 1, 1])]) == "PASS"


# -- bench io, from made-up trials ------------------------------------------------
def _trials(direct_seconds: list[float]) -> list[SimpleNamespace]:
    """Raw takes 1 s per GB in every round; the direct backend the given seconds per round (two settings)."""
    out = []
    for rnd, seconds in enumerate(direct_seconds):
        for request in (1 << 20, 16 << 20):
            for op in ("read", "write"):
                for kind, s in (("raw", 1.0), ("direct", seconds), ("dd", 2.0)):
                    out.append(SimpleNamespace(kind=kind, op=op, request_bytes=request, workers=4, nbytes=10**9,
                                               seconds=s, round=rnd))
    return out


@pytest.mark.parametrize(
    ("direct_seconds", "verdict"),
    [([1.0, 1.05, 1.02], "PASS"), ([1.25, 1.3, 1.0], "FAIL"), ([1.0, 1.0], "UNDECIDED")],
)
def test_bench_io_judges_direct_vs_raw_round_by_round(direct_seconds, verdict):
    result = io_report.summarize(_trials(direct_seconds), memory_GBps=[10.0] * len(direct_seconds), direct=True)
    found = io_report.verdicts(result)
    assert [v["key"] for v in found] == ["direct_vs_raw[read]", "direct_vs_raw[write]"]
    assert {v["verdict"] for v in found} == {verdict}
    ratios = result["summary"]["ratios"]["direct_vs_raw_per_setting"]["read"]
    assert ratios["samples"] == pytest.approx([1 / s for s in direct_seconds])  # one ratio per round


def test_bench_io_summary_holds_the_fields_its_json_documents():
    result = io_report.summarize(_trials([1.0, 1.1, 1.2]), memory_GBps=[9.0, 10.0, 11.0], direct=True)
    s = result["summary"]
    for key in ("best_read_GBps", "best_write_GBps", "memory_GBps", "best", "rounds", "ratios",
                "direct_vs_raw_per_setting", "spread", "memory_GBps_spread"):
        assert key in s, key
    assert s["rounds"] == 3 and s["memory_GBps"] == 11.0 and s["memory_GBps_spread"]["min"] == 9.0
    assert s["ratios"]["direct_vs_dd"]["read"]["median"] == pytest.approx(2 / 1.1)  # the peer ratio, per round
    assert s["spread"]["dd_read"] == {"min_GBps": 0.5, "max_GBps": 0.5}
    cell = next(c for c in result["settings"] if c["kind"] == "direct" and c["op"] == "read")
    assert cell["runs"] == 3 and cell["min_GBps"] == pytest.approx(1 / 1.2) and cell["max_GBps"] == 1.0
    assert not any(isinstance(v, float) and math.isnan(v) for v in s["direct_vs_raw_per_setting"].values())


def test_bench_io_report_prints_hardware_ratios_with_spread_and_verdicts():
    result = io_report.summarize(_trials([1.0, 1.25, 1.3]), memory_GBps=[10.0] * 3, direct=True)
    machine = {"cpu_model": "Test CPU", "cpus": 2, "cores_usable": 2, "torch": "2.x", "cpu_capability": "AVX2"}
    text = io_report.render(result, ["raw", "direct"], machine=machine)
    lines = text.splitlines()
    assert lines[0].startswith("hardware: Test CPU, 2 cores")
    assert "3 interleaved rounds" in lines[1]
    assert "direct / raw at the same setting: read 0.80x (0.77-1.00)" in text
    assert "direct / dd (at its best setting): read" in text
    assert "targets: 2 FAIL" in text
    assert "FAIL  reads: tierstore's direct backend / raw O_DIRECT" in text and "target >= 0.90x" in text
