#!/usr/bin/env python
"""Run ``tierstore bench step`` from a checkout (the same options; see ``bench/README.md``).

Results go where ``--json`` and ``--plot`` say, and nowhere without them:
the committed results in ``bench/results/`` are never written by default.

Example
-------
    python bench/step.py --params 2e8 --ram-budget 1/8 --dir /mnt/nvme/scratch --json step-2e8.json
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    from tierstore.cli import main as cli

    return cli(["bench", "step", *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
