#!/usr/bin/env python
"""What durability costs a training loop, all state in RAM (see tierstore/cli/bench/durability.py).

Needs about 1.6 GB of RAM and 1 GB of disk at the default 5e7 parameters (three
durable or on-disk contenders keep two copies of 400 MB each, one at a time on
disk per contender).

Example
-------
    python bench/durability.py --params 5e7 --json /tmp/durability.json
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from tierstore.cli.bench.durability import main

    sys.exit(main(sys.argv[1:]))
