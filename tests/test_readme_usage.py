"""The README's Usage block runs twice in a row in the same directory, the second run resuming the first.

A newcomer copies the block into a file and runs it, then runs it again: the
second run must continue from the state the first committed (its step count
and, with ``keep_master=True``, its weights), not fail on the directory the
first left behind.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
STEPS = 5  # the block trains 100 steps per run; 5 show the same on a 2-core CI machine


def _usage_block() -> str:
    text = README.read_text()
    usage = text[text.index("## Usage"):]
    block = re.search(r"```python\n(.*?)```", usage, re.S)
    if block is None:
        raise AssertionError("README.md's Usage section has no python block")
    code = block.group(1)
    if code.count("start + 100") != 1:
        raise AssertionError("the Usage block no longer trains 'start + 100' steps: update this test")
    return code.replace("start + 100", f"start + {STEPS}")


def test_the_usage_block_runs_twice_and_the_second_run_resumes(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text(_usage_block())
    runs = [subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    for i, run in enumerate(runs):
        assert run.returncode == 0, f"run {i + 1} failed:\n{run.stderr[-3000:]}"
    first, second = (re.search(r"^step (\d+): loss ([0-9.]+)", r.stdout, re.M) for r in runs)
    assert first and second, [r.stdout for r in runs]
    assert int(first.group(1)) == STEPS and int(second.group(1)) == 2 * STEPS
