"""Collect the Markdown documentation's code blocks as tests (see ``tests/doc_blocks.py``)."""

from __future__ import annotations

import os

import pytest

from tests.doc_blocks import format_inventory, inventory, make_sybil

pytest_collect_file = make_sybil().pytest()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Report a skipped block at its line in the page, not inside Sybil's skipper."""
    outcome = yield
    report = outcome.get_result()
    example = getattr(item, "example", None)
    if example is not None and report.skipped and isinstance(report.longrepr, tuple):
        reason = report.longrepr[2]
        report.longrepr = (os.path.relpath(example.path, item.config.rootpath), example.line, reason)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """Count the documentation's code blocks: run, run at a reduced size, skipped (with reasons)."""
    reports = [r for key in ("passed", "failed", "skipped", "error") for r in terminalreporter.stats.get(key, [])]
    if any(".md::" in getattr(report, "nodeid", "") for report in reports):
        terminalreporter.write_sep("-", "documentation code blocks (tests/README.md)")
        terminalreporter.write_line(format_inventory(inventory()))
