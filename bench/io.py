#!/usr/bin/env python
"""Run ``tierstore bench io`` from a checkout and keep its results.

Same options as ``tierstore bench io`` (see ``bench/README.md``). Without
``--json``/``--plot`` the results go to ``bench/results/io.json`` and
``bench/results/io.png``.

Example
-------
    python bench/io.py --dir /mnt/nvme --size 2GiB
"""

from __future__ import annotations

import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str]) -> int:
    from tierstore.cli import main as cli

    args = list(argv)
    if not any(a == "--json" or a.startswith("--json=") for a in args):
        args += ["--json", str(RESULTS / "io.json")]
    if not any(a == "--plot" or a.startswith("--plot=") for a in args):
        args += ["--plot", str(RESULTS / "io.png")]
    return cli(["bench", "io", *args])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
