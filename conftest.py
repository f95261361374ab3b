"""Collect the Markdown documentation's code blocks as tests (see ``tests/doc_blocks.py``)."""

from __future__ import annotations

from tests.doc_blocks import format_inventory, inventory, make_sybil

pytest_collect_file = make_sybil().pytest()


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """Count the documentation's code blocks: run, run at a reduced size, skipped (with reasons)."""
    reports = [r for key in ("passed", "failed", "skipped", "error") for r in terminalreporter.stats.get(key, [])]
    if any(".md::" in getattr(report, "nodeid", "") for report in reports):
        terminalreporter.write_sep("-", "documentation code blocks")
        terminalreporter.write_line(format_inventory(inventory()))
