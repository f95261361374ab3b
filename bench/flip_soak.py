"""Flip random bytes of every kind of state file and count how many are detected.

Builds a durable state directory (a few steps, some shards resident, some
streamed), then for each flip: XOR one random bit of one random byte of a
random state file (``shards.0.bin``, ``shards.1.bin``, ``manifest.json``),
check the directory (``StateReader.verify``, which also reads the manifest),
and undo the flip. Every flip must be detected.

Usage::

    python bench/flip_soak.py --flips 1000 --json bench/results/flip_soak.json
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from tierstore import CorruptStateError, TieredAdamW
from tierstore._state.reader import StateReader

FILES = ("shards.0.bin", "shards.1.bin", "manifest.json")


def build(state: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(300, 7), (1000, 33), (5,), (4099,)]]
    with TieredAdamW(params, state_dir=str(state), ram_budget="200KiB", shard_numel=2048, keep_master=True) as opt:
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()


def detected(state: Path) -> bool:
    try:
        with StateReader(state) as reader:
            return bool(reader.verify())
    except CorruptStateError:
        return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flips", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="tierstore-flips-"))
    state = root / "state"
    tried: Counter = Counter()
    caught: Counter = Counter()
    missed = []
    try:
        build(state)
        if detected(state):
            raise SystemExit("the fresh state directory already fails verification")
        for _ in tqdm(range(args.flips), desc="byte flips"):
            name = rng.choice(FILES)
            path = state / name
            data = bytearray(path.read_bytes())
            offset = rng.randrange(len(data))
            bit = 1 << rng.randrange(8)
            data[offset] ^= bit
            path.write_bytes(bytes(data))
            tried[name] += 1
            if detected(state):
                caught[name] += 1
            else:
                missed.append({"file": name, "offset": offset, "bit": bit})
            data[offset] ^= bit
            path.write_bytes(bytes(data))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary = {
        "flips": args.flips,
        "detected": sum(caught.values()),
        "per_file": {n: {"tried": tried[n], "detected": caught[n]} for n in FILES},
        "missed": missed,
        "command": f"python bench/flip_soak.py --flips {args.flips} --seed {args.seed}",
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
