#!/usr/bin/env python
"""Run ``tierstore bench step`` from a checkout and keep its results.

Same options as ``tierstore bench step`` (see ``bench/README.md``). Without
``--json``/``--plot`` the results go to ``bench/results/step.json`` and
``bench/results/step.png``.

Example
-------
    python bench/step.py --params 2e8 --ram-budget 1/8 --dir /mnt/nvme
"""

from __future__ import annotations

import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str]) -> int:
    from tierstore.cli import main as cli

    args = list(argv)
    if not any(a == "--json" or a.startswith("--json=") for a in args):
        args += ["--json", str(RESULTS / "step.json")]
    if not any(a == "--plot" or a.startswith("--plot=") for a in args):
        args += ["--plot", str(RESULTS / "step.png")]
    return cli(["bench", "step", *args])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
