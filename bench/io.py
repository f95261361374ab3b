#!/usr/bin/env python
"""Run ``tierstore bench io`` from a checkout (the same options; see ``bench/README.md``).

Results go where ``--json`` and ``--plot`` say, and nowhere without them:
the committed results in ``bench/results/`` are never written by default.

Example
-------
    python bench/io.py --dir /mnt/nvme/scratch --size 2GiB --json io.json
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    from tierstore.cli import main as cli

    return cli(["bench", "io", *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
