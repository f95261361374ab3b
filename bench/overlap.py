#!/usr/bin/env python
"""How much of the optimizer step hides behind the next forward (see tierstore/cli/bench/overlap.py).

Needs about 3 GB of RAM and 1 GB of disk at the defaults (three copies of a
5e7-parameter MLP with gradients; the streamed state in a private temporary
directory: set TMPDIR to put it on the drive to measure).

Example
-------
    python bench/overlap.py --layers 12 --width 2048 --ram-budget 1/8 --json /tmp/overlap.json
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from tierstore.cli.bench.overlap import main

    sys.exit(main(sys.argv[1:]))
