"""Benchmark verdicts: a target judged from given per-round numbers, and the report that prints it.

No benchmark runs here: the rounds are made up, so each test takes milliseconds.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from tierstore.cli.bench import io_report
from tierstore.cli.bench.verdict import Target, format_verdict, format_verdicts, judge, overall

ROOT = Path(__file__).resolve().parent.parent
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


# -- bench step's report and plot, from made-up rounds -------------------------------
def _step_document(*, torch_s=(0.94, 1.0, 0.9), peer_s=(3.3, 3.0, 3.6), bandwidth_off=1.0, commit_wait=0.0):
    """A bench step document of three rounds: RAM 1 s a step, disk 2.2 s, floors about 2 s."""
    from tierstore.cli.bench import step

    results = {
        "tierstore-ram": [{"seconds": 1.0}] * 3,
        "torch-fused": [{"seconds": s} for s in torch_s],
        "tierstore-disk": [{"seconds": 2.2, "read_wait": 0.5, "update": 0.5, "write_wait": 0.4,
                            "commit_wait": commit_wait}] * 3,
        "peer-pipelined-swap": [{"seconds": s, "read_wait": 1.0, "update": 0.5, "write_wait": 1.0} for s in peer_s],
        # serial floor: 1 s read + 1 s write of 1 GB (bandwidth floor 2 s x bandwidth_off), stream floor 2 s
        "floor-serial 8.00 MiBx4": [{"seconds": 2.0 * bandwidth_off, "read_s": bandwidth_off,
                                     "write_s": bandwidth_off}] * 3,
        "floor-stream 8.00 MiBx4": [{"seconds": 2.0, "read_s": float("nan"), "write_s": float("nan")}] * 3,
    }
    doc = step.summarize(results, numel=1000, disk_bytes=10**9)
    doc["config"] = {"params": 1000, "durable": [True], "ram_budget": 100, "dir": "/x"}
    doc["machine"] = {"cpu_model": "Test CPU", "cpus": 2, "cores_usable": 2, "torch": "2.x", "cpu_capability": "AVX2"}
    return doc


def test_bench_step_report_gives_each_ratio_as_the_verdict_uses_it_with_its_range():
    from tierstore.cli.bench import step_report

    doc = _step_document()
    text = step_report.render(doc, step_report.verdicts(doc))
    # One number per ratio: the median of per-round ratios (what the verdict judges), with its range;
    # not a ratio of medians beside it.
    assert "all in RAM: TieredAdamW's params/s / torch.optim.AdamW(fused=True)'s 0.94x (median of 3 per-round " \
           "ratios, range 0.90-1.00)" in text
    assert "as the median of per-round ratios" not in text
    assert "DeepSpeed-style swapper's step / ours 1.50x (median of 3 per-round ratios, range 1.36-1.64)" in text
    assert "step / I/O floor 1.10x (median of 3 per-round ratios, range 1.10-1.10)" in text
    assert "FAIL  all in RAM" in text and "median 0.94x" in text  # the verdict's own number, against >= 0.95x


def _captured_figure(monkeypatch, module):
    figures = []

    def keep(fig, path):
        figures.append(fig)
        return path

    monkeypatch.setattr(module, "save_figure", keep)
    return figures


def test_bench_step_plot_draws_floors_within_5_percent_as_one_line(monkeypatch):
    from tierstore.cli.bench import step_report

    for off, lines in ((1.03, 1), (1.2, 2)):  # bandwidth floor 3% / 20% above the measured floor
        figures = _captured_figure(monkeypatch, step_report)
        step_report.plot(_step_document(bandwidth_off=off), "unused.png", title="t")
        top = figures[0].axes[0]
        floors = [line for line in top.get_lines() if "floor" in str(line.get_label())]
        assert len(floors) == lines, off
        if lines == 1:
            assert "within 5%" in floors[0].get_label()


def test_bench_step_plot_commit_wait_is_reddish_purple_and_parts_without_time_are_not_in_the_legend(monkeypatch):
    from matplotlib.colors import to_hex

    from tierstore.cli.bench import step_report
    from tierstore.cli.bench.palette import OKABE_ITO

    figures = _captured_figure(monkeypatch, step_report)
    step_report.plot(_step_document(commit_wait=0.3), "unused.png", title="t")
    bottom = figures[0].axes[1]
    colours = {to_hex(p.get_facecolor()).upper() for p in bottom.patches}
    assert OKABE_ITO["reddish purple"] in colours and OKABE_ITO["yellow"] not in colours
    figures.clear()
    step_report.plot(_step_document(commit_wait=0.0), "unused.png", title="t")
    labels = [t.get_text() for t in figures[0].axes[1].get_legend().get_texts()]
    assert step_report.SPLIT_LABELS["commit_wait"] not in labels and step_report.SPLIT_LABELS["update"] in labels


@pytest.mark.parametrize(
    ("heights", "moved"),
    [([100.0, 104.0], True), ([100.0, 101.0, 103.0], True), ([10.0, 50.0], False), ([50.0, 10.0, 30.0], False)],
)
def test_bench_io_plot_value_labels_are_nudged_apart_only_where_they_would_overlap(heights, moved):
    offsets = io_report.label_offsets(heights)
    placed = sorted(h + o for h, o in zip(heights, offsets))
    assert all(b - a >= io_report.LABEL_GAP_PT - 1e-6 for a, b in zip(placed, placed[1:]))
    assert any(offsets) is moved


# -- bench/overlap.py: the step behind the loop --------------------------------------
def _overlap_doc(attached, unattached, *, ram_budget=None):
    # F + B + S - 0.7 H = 1.0 + 1.0 + 0.5 - 0.7 x 0.5 = 2.15 s
    return {"config": {"ram_budget": ram_budget, "block": 3}, "phases": {"F": 1.0, "B": 1.0, "S": 0.5, "H": 0.5},
            "summary": {"target_s": 2.15}, "per_round_s": {"attached": attached, "unattached": unattached}}


@pytest.mark.parametrize(
    ("attached", "unattached", "verdicts"),
    [
        ([2.0, 2.1, 2.05], [2.1, 2.2, 2.1], ["PASS", "PASS"]),  # within 2.15 s, and faster than unattached
        ([2.3, 2.0, 2.2], [2.1, 2.1, 2.1], ["FAIL", "FAIL"]),  # median 2.2 s > 2.15 s; 1.05x > 1.00x
        ([2.0, 2.0], [2.1, 2.1], ["UNDECIDED", "UNDECIDED"]),  # two rounds: too few
    ],
)
def test_overlap_judges_attached_time_and_ratio_round_by_round(attached, unattached, verdicts):
    from tierstore.cli.bench import overlap

    found = overlap.verdicts(_overlap_doc(attached, unattached))
    assert [v["key"] for v in found] == ["attached_within_target", "attached_vs_unattached"]
    assert [v["verdict"] for v in found] == verdicts
    assert found[1]["samples"] == pytest.approx([a / u for a, u in zip(attached, unattached)])
    streamed = overlap.verdicts(_overlap_doc(attached, unattached, ram_budget=1 << 20))
    assert [v["key"] for v in streamed] == ["attached_within_target"]  # the ratio is stated for all-in-RAM only


def test_overlap_json_from_before_per_round_times_is_judged_per_round():
    from tierstore.cli.bench import overlap

    doc = _overlap_doc([], [])
    del doc["per_round_s"]
    doc["iterations"] = {"attached": [2.0, 2.2, 2.1, 2.1, 2.0, 2.0], "unattached": [2.1] * 6}  # block 3: 2 counted
    assert overlap.rounds_of(doc)["attached"] == pytest.approx([2.1, 2.1, 2.0])
    assert overlap.verdicts(doc)[0]["verdict"] == "PASS"


def test_overlap_script_prints_hardware_spread_and_verdicts_and_writes_them(tmp_path, capsys):
    from tierstore.cli.bench import overlap

    out = tmp_path / "o.json"
    rc = overlap.main(["--layers", "1", "--width", "256", "--batch", "2", "--rounds", "2", "--block", "2",
                       "--ram-budget", "none", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert text.startswith("hardware: ") and "2 interleaved rounds" in text and "(range " in text
    assert "targets: 2 UNDECIDED" in text and "at least 3 interleaved repeats" in text
    doc = json.loads(out.read_text())
    assert doc["verdict"] == "UNDECIDED" and doc["hardware"].startswith("hardware: ")
    assert len(doc["per_round_s"]["attached"]) == 2 and len(doc["summary"]["attached_vs_unattached_rounds"]) == 2


# -- bench/convergence.py: final eval loss per format, one repeat per batch seed ------------
def _convergence(finals_by_seed):
    """Results of the demo model, one run per seed: {seed: {contender: final eval loss}} (fp32 at 2.0)."""
    from tierstore.cli.bench import convergence

    models = {}
    for seed, finals in finals_by_seed.items():
        contenders = {name: {"final_eval": f, "best_eval": f, "eval": [(1, 2.5), (2, f)], "optimizer_seconds": 1.0}
                      for name, f in {"torch-adamw-fp32": 2.0, **finals}.items()}
        run = {"params": 1000, "batch_size": 2, "context": 8, "batch_seed": seed, "contenders": contenders}
        convergence.relative_to_baseline(run)
        models["demo" if seed == 0 else f"demo@seed{seed}"] = run
    return {"models": models}


@pytest.mark.parametrize(
    ("int8_finals", "verdict"),
    [
        ([2.01, 2.03, 1.98], "PASS"),  # +0.5%, +1.5%, -1%: median +0.5% <= +1%
        ([2.01, 2.03, 2.04], "FAIL"),  # median +1.5%
        ([2.01, 2.01], "UNDECIDED"),  # two seeds
    ],
)
def test_convergence_judges_each_format_on_the_median_over_batch_seeds(int8_finals, verdict):
    from tierstore.cli.bench import convergence

    results = _convergence({seed: {"ours-int8": f, "ours-bfloat16": 1.9} for seed, f in enumerate(int8_finals)})
    found = {v["key"]: v for v in convergence.verdicts(results)}
    assert set(found) == {"final_vs_fp32[demo/bfloat16]", "final_vs_fp32[demo/int8]"}
    v = found["final_vs_fp32[demo/int8]"]
    assert v["verdict"] == verdict and v["samples"] == pytest.approx([100 * (f / 2.0 - 1) for f in int8_finals])
    assert found["final_vs_fp32[demo/bfloat16]"]["verdict"] == ("UNDECIDED" if len(int8_finals) < 3 else "PASS")
    if verdict == "UNDECIDED":
        assert "--seeds" in format_verdict(v)


def test_convergence_labels_are_plain_words():
    from tierstore.cli.bench import convergence

    for name in [*convergence.STYLES, "ours-bfloat16-nearest"]:
        text = convergence.contender_label(name)
        assert not any(word in text for word in ("ours-", "bnb", "adamw8bit", "-raw", "fp32-")), text


def test_convergence_plot_puts_every_legend_below_its_axes(tmp_path, monkeypatch):
    from tierstore.cli.bench import convergence, report

    figures = []
    monkeypatch.setattr(report, "save_figure", lambda fig, path: figures.append(fig) or path)
    results = _convergence({0: {"ours-int8": 2.01, "bnb-adamw8bit": 2.05}, 1: {"ours-int8": 2.02}})
    convergence.plot(results, str(tmp_path / "c.png"))
    fig = figures[0]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        legend = ax.get_legend()
        assert legend is not None
        assert legend.get_window_extent(renderer).y1 <= ax.get_window_extent(renderer).y0  # below, over no data
        assert ax.get_xlabel() and ("%" in ax.get_xlabel() or "step" in ax.get_xlabel())


def test_convergence_script_merges_runs_and_writes_its_verdicts(tmp_path, capsys):
    import importlib.util

    parts = []
    for seed, finals in enumerate([2.01, 2.03, 1.98]):
        path = tmp_path / f"seed{seed}.json"
        doc = _convergence({seed: {"ours-int8": finals, "ours-bfloat16": 1.99}})
        doc["machine"] = {"cpu_model": "Test CPU", "cpus": 2, "torch": "2.x"}
        path.write_text(json.dumps(doc))
        parts.append(str(path))
    spec = importlib.util.spec_from_file_location("bench_convergence", ROOT / "bench" / "convergence.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "all.json"
    assert script.main(["--merge", *parts, "--json", str(out), "--plot", str(tmp_path / "all.png")]) == 0
    doc = json.loads(out.read_text())
    assert doc["verdict"] == "PASS" and {v["repeats"] for v in doc["verdicts"]} == {3}
    text = capsys.readouterr().out
    assert text.startswith("hardware: Test CPU") and "targets: 2 PASS" in text and "range +0.50% to" not in text
    assert (tmp_path / "all.png").read_bytes()[:4] == b"\x89PNG"


# -- bench/durability.py: durable=True in a training loop vs durable=False -------------------
@pytest.mark.parametrize(
    ("auto", "verdict"),
    [([1.0, 1.04, 1.02, 1.2], "PASS"), ([1.0, 1.08, 1.07], "FAIL"), ([1.0, 1.0], "UNDECIDED")],
)
def test_durability_judges_durable_over_not_durable_round_by_round(auto, verdict):
    from tierstore.cli.bench import durability

    rounds = {n: [1.0] * len(auto) for n in durability.CONTENDERS} | {"durable-auto": auto}
    doc = {"config": {"params": 1000, "state_bytes": 8000, "rounds": len(auto), "block": 3},
           "calibration": {"state_write_s": 0.1, "compute_s": 0.12, "compute_reps": 3},
           "contenders": [{"contender": n, "iteration_s": 1.0} for n in durability.CONTENDERS],
           "per_round_s": rounds,
           "machine": {"cpu_model": "Test CPU", "cpus": 2, "torch": "2.x"}}
    (v,) = durability.verdicts(doc)
    assert v["verdict"] == verdict and v["samples"] == pytest.approx(auto) and v["target"]["bound"] == 1.05
    text = durability.render(doc)
    assert text.startswith("hardware: Test CPU") and f"{verdict:<5} all in RAM" in text
    assert f"durable-auto / not-durable: {v['median']:.3f}x (median of {len(auto)} per-round ratios" in text


# -- bench/formats_step.py: each format's streamed step / float32's ---------------------------
def _bench_script(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("int8_s", "verdict"),
    [([0.55, 0.62, 0.58], "PASS"), ([0.55, 0.66, 0.64], "FAIL"), ([0.5, 0.5], "UNDECIDED")],
)
def test_formats_step_judges_each_format_against_float32_round_by_round(int8_s, verdict):
    fs = _bench_script("formats_step")
    rows = [{"moment_dtype": "float32", "steps_s": [1.0] * len(int8_s)},
            {"moment_dtype": "int8", "steps_s": int8_s},
            {"moment_dtype": "int8@torch", "steps_s": [1.0] * len(int8_s)},  # a diagnostic: no target
            {"moment_dtype": "bfloat16", "steps_s": [0.7] * len(int8_s)}]
    found = fs.verdicts(rows, keep_master=True, params=2 * 10**8)
    assert [v["key"] for v in found] == ["vs_float32[int8]", "vs_float32[bfloat16]"]
    assert found[0]["verdict"] == verdict and found[0]["samples"] == pytest.approx(int8_s)
    assert found[0]["target"]["bound"] == 0.60 and found[1]["target"]["bound"] == 0.72
    assert "note" not in found[0]  # at the stated size, with masters: nothing to warn about
    assert "fp32 masters" in fs.verdicts(rows, keep_master=False, params=2 * 10**8)[0]["note"]
    assert fs.verdicts(rows[1:], keep_master=True) == []  # no float32 run first: nothing to compare with


@pytest.mark.parametrize(("value", "share"), [("1/8", 1 / 8), ("12.5%", 1 / 8), ("0.125", 1 / 8), ("1/2", 1 / 2)])
def test_formats_step_reads_its_budget_with_the_apis_parser(value, share, tmp_path, capsys):
    fs = _bench_script("formats_step")
    out = tmp_path / "f.json"
    assert fs.main(["--params", "2e5", "--dir", str(tmp_path), "--rounds", "1", "--shard-numel", "4096",
                    "--formats", "float32", "--budget", value, "--no-durable", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["ram_budget"] == int(2e5 * 12 * share) and doc["durable"] is False


def test_formats_step_refuses_a_bad_budget_with_the_apis_error(tmp_path, capsys):
    fs = _bench_script("formats_step")
    with pytest.raises(SystemExit) as done:
        fs.main(["--params", "1e5", "--dir", str(tmp_path), "--budget", "2/1"])
    assert done.value.code == 2
    assert "--budget='2/1' is a share of 2 of the state; give a share in (0, 1]" in capsys.readouterr().err


# -- bench/ab_step.py: configurations against the first ----------------------------------------
@pytest.mark.parametrize(
    ("rounds", "target", "verdict"),
    [([0.9, 0.95, 1.02], "<=1.0", "PASS"), ([1.1, 1.2, 0.98], "<=1.0", "FAIL"), ([0.9, 0.95, 1.02], "<0.9", "FAIL"),
     ([0.9, 0.95], "<=1.0", "UNDECIDED")],
)
def test_ab_step_judges_each_configuration_against_the_first_round_by_round(rounds, target, verdict):
    ab = _bench_script("ab_step")
    rows = [{"config": {}, "paired_rounds": [1.0] * len(rounds)}, {"config": {"io_workers": 2}, "paired_rounds": rounds}]
    (v,) = ab.verdicts(rows, ab.parse_target(target))
    assert v["verdict"] == verdict and v["samples"] == pytest.approx(rounds) and '{"io_workers": 2}' in v["target"]["what"]


@pytest.mark.parametrize("bad", ["1.0", "=<1", "<= one", ""])
def test_ab_step_refuses_a_target_without_operator_and_ratio(bad):
    ab = _bench_script("ab_step")
    with pytest.raises(ValueError, match="write an operator and a ratio"):
        ab.parse_target(bad)


def test_ab_step_runs_durable_by_default_reads_its_budget_with_the_apis_parser_and_writes_verdicts(tmp_path, capsys):
    ab = _bench_script("ab_step")
    out = tmp_path / "ab.json"
    hugepages = os.environ.get("TIERSTORE_HUGEPAGES")
    assert ab.main(["--params", "1e5", "--dir", str(tmp_path), "--rounds", "2", "--budget", "90%",
                    "--configs", '[{}, {"durable": false}]', "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["ram_budget"] == int(1e5 * 8 * 0.9)
    assert "durable" not in doc["results"][0]["config"] and doc["results"][1]["config"]["durable"] is False
    assert len(doc["results"][1]["paired_rounds"]) == 2 and doc["verdict"] == "UNDECIDED"
    text = capsys.readouterr().out
    assert text.startswith("hardware: ") and "(2 copies, durable)" in text and "targets: 1 UNDECIDED" in text
    assert [p.name for p in tmp_path.iterdir()] == ["ab.json"]
    assert os.environ.get("TIERSTORE_HUGEPAGES") == hugepages  # the process is left as it was
    with pytest.raises(SystemExit) as done:
        ab.main(["--params", "1e5", "--dir", str(tmp_path), "--configs", "[{}]", "--budget", "1/0"])
    assert done.value.code == 2 and "--budget='1/0' divides by zero" in capsys.readouterr().err


# -- bench/codec.py: the compiled update against the same update in torch ops --------------------
@pytest.mark.parametrize(
    ("torch_s", "verdict"),
    [([2.0, 2.2, 0.9], "PASS"), ([0.9, 1.1, 0.95], "FAIL"), ([2.0, 2.0], "UNDECIDED")],
)
def test_codec_judges_the_compiled_update_against_torch_ops_round_by_round(torch_s, verdict):
    from tierstore.cli.bench import codec_speed

    result = {"compiled": {"int8": True, "bfloat16": False},  # bfloat16: no compiled kernel here, no target
              "seconds": {"update/int8": [1.0] * len(torch_s), "update/int8@torch": torch_s,
                          "update/bfloat16": [1.0] * len(torch_s), "update/bfloat16@torch": torch_s}}
    (v,) = codec_speed.verdicts(result)
    assert v["key"] == "compiled_vs_torch[int8]" and v["verdict"] == verdict
    assert v["samples"] == pytest.approx(torch_s)


def test_codec_script_prints_hardware_and_verdicts_and_writes_per_round_seconds(tmp_path, capsys):
    codec = _bench_script("codec")
    out = tmp_path / "c.json"
    assert codec.main(["--numel", "16Ki", "--rounds", "2", "--formats", "int8,int8@torch", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert all(len(v) == 2 for v in doc["seconds"].values()) and doc["hardware"].startswith("hardware: ")
    text = capsys.readouterr().out
    assert text.startswith("hardware: ")
    if doc["compiled"]["int8"]:
        assert doc["verdict"] == "UNDECIDED" and "targets: 1 UNDECIDED" in text
    else:  # no C compiler: the comparison does not apply
        assert doc["verdicts"] == [] and "no compiled kernel here" in text


# -- bench/ram_budget.py: peak RSS growth per mode against the budget + 16 MiB ------------------
def test_ram_budget_judges_each_mode_against_budget_plus_the_fixed_overhead():
    rb = _bench_script("ram_budget")
    from tierstore.testing.memory import OVERHEAD_BYTES

    budget = 96 << 20
    rows = [{"mode": "direct", "ram_budget": budget, "peak_growth": budget + OVERHEAD_BYTES},
            {"mode": "mmap", "ram_budget": budget, "peak_growth": budget + OVERHEAD_BYTES + 1}]
    assert [(v["key"], v["verdict"]) for v in rb.verdicts(rows)] == [("peak_rss[direct]", "PASS"),
                                                                     ("peak_rss[mmap]", "FAIL")]
    assert all(v["target"]["min_repeats"] == 1 for v in rb.verdicts(rows))  # a peak over a run: one measurement


@pytest.mark.parametrize(("value", "expected"), [("96MiB", 96 << 20), ("1/8", 10**6), ("12.5%", 10**6), ("0.125", 10**6)])
def test_ram_budget_reads_its_budget_with_the_apis_parser(value, expected, tmp_path, capsys, monkeypatch):
    rb = _bench_script("ram_budget")
    ran = []
    monkeypatch.setattr(rb, "_run", lambda name, scenario, config, reports: ran.append(config) or {
        "mode": name, "ram_budget": config["ram_budget"], "peak_growth": 1 << 20, "within": True})
    out = tmp_path / "rb.json"
    assert rb.main(["--params", "1e6", "--ram-budget", value, "--only", "direct", "--dir", str(tmp_path),
                    "--json", str(out)]) == 0
    assert [c["ram_budget"] for c in ran] == [expected]
    doc = json.loads(out.read_text())
    assert doc["ram_budget"] == expected and doc["verdict"] == "PASS" and doc["hardware"].startswith("hardware: ")
    assert capsys.readouterr().out.startswith("hardware: ")


@pytest.mark.parametrize(("argv", "message"), [
    (["--ram-budget", "150%"], "--ram-budget='150%' is a share of 1.5 of the state"),
    (["--ram-budget", "1/0"], "--ram-budget='1/0' divides by zero"),
    (["--only", "direct,floppy"], "--only lists unknown ['floppy']"),
])  # fmt: skip
def test_ram_budget_refuses_bad_options_before_it_makes_anything(argv, message, tmp_path, capsys):
    rb = _bench_script("ram_budget")
    with pytest.raises(SystemExit) as done:
        rb.main([*argv, "--dir", str(tmp_path)])
    assert done.value.code == 2 and message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_bench_step_plot_title_wraps_so_many_targets_do_not_widen_the_figure(monkeypatch):
    from tierstore.cli.bench import step_report

    figures = _captured_figure(monkeypatch, step_report)
    step_report.plot(_step_document(), "unused.png", title="tierstore bench step: " + "many words " * 40)
    lines = figures[0]._suptitle.get_text().splitlines()
    assert len(lines) > 2 and all(len(line) <= step_report.TITLE_CHARS for line in lines)
    assert figures[0].get_size_inches()[0] == pytest.approx(10.0)
