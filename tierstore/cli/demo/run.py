"""``tierstore demo``: train a small language model with most of its optimizer state on disk.

The demo builds :class:`~tierstore.cli.demo.model.TinyGPT` (about 0.83 M
parameters, 6.4 MiB of AdamW state) and trains it on the shipped text with
:class:`~tierstore.TieredAdamW` under a ``ram_budget`` of one eighth of the
state, so most shards live in a file and stream through the arena each step.
In the same process and in lockstep, a copy of the model with the same
initial weights is trained on the same batches with
``torch.optim.AdamW(fused=True)``. The demo passes when the two loss curves
and the final parameters are bitwise equal.

State directory: each run writes to a new subdirectory
``<state-dir>/run-<time>-<pid>`` (so running twice never meets the state of
an earlier run) and removes that subdirectory when it ends, unless
``--keep-state`` is given; it never deletes anything it did not create.

Example
-------
>>> result = train(steps=2, state_dir=None, config=ModelConfig(d_model=64, n_layer=1), batch_size=2)
>>> result.equal, len(result.losses), result.ram_bytes <= result.ram_budget
(True, 2, True)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import resource
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..._layout.layout import Layout
from ...errors import ConfigError
from ...optimizer import TieredAdamW
from ...sizes import budget_request, format_size, resolve_budget
from .model import BatchStream, ModelConfig, TinyGPT, load_corpus

DEFAULT_STEPS = 150
DEFAULT_STATE_DIR = "tierstore-demo-state"
BUDGET_FRACTION = 8  # default ram_budget: state size / 8
PREFETCH_DEPTH = 2  # the arena then has PREFETCH_DEPTH + 2 slots
LR = 3e-3
WEIGHT_DECAY = 0.1
CLIP_NORM = 1.0

StepHook = Callable[[int, float, float], None]


@dataclass
class DemoResult:
    """What one demo run measured (sizes in bytes, times in seconds)."""

    steps: int
    params: int
    state_bytes: int
    ram_budget: int
    ram_bytes: int
    disk_bytes: int
    shard_numel: int
    backend: str | None
    describe: str
    losses: list[float]
    reference_losses: list[float]
    params_equal: bool
    start_rss_bytes: int
    peak_rss_bytes: int
    seconds: float
    tiered_step_seconds: float
    reference_step_seconds: float
    state_dir: str | None
    # Where TieredAdamW's step time went, summed over the steps (tierstore._runtime.runtime.StepStats).
    streamed_read_bytes: int = 0  # state read from the drive (streamed shards)
    streamed_written_bytes: int = 0  # state written to the drive: streamed shards, and resident ones at commits
    drive_wait_seconds: float = 0.0  # the steps' waits for reads and writes (what the prefetch did not hide)
    update_seconds: float = 0.0  # the AdamW arithmetic itself

    def timing_explained(self) -> str:
        """Why TieredAdamW's steps took the time they did, against torch's, in one sentence.

        >>> r = DemoResult(2, 1, 4 << 20, 1 << 20, 1 << 20, 8 << 20, 1024, "direct", "", [], [], True, 0, 0,
        ...                1.0, 0.5, 0.05, "s", 6 << 20, 8 << 20, 0.3, 0.1)
        >>> r.timing_explained().split(";")[0]
        'TieredAdamW took 10x the time of torch AdamW, whose state is all in RAM'
        """
        ratio = self.tiered_step_seconds / self.reference_step_seconds if self.reference_step_seconds > 0 else float("inf")
        steps = max(1, self.steps)
        moved = self.streamed_read_bytes + self.streamed_written_bytes
        secs = max(self.tiered_step_seconds, 1e-9)
        where = f"the {self.backend} state files in {self.state_dir}" if self.state_dir else "its state files"
        return (
            f"TieredAdamW took {ratio:.0f}x the time of torch AdamW, whose state is all in RAM; each of its steps "
            f"read {format_size(self.streamed_read_bytes // steps)} and wrote "
            f"{format_size(self.streamed_written_bytes // steps)} of state from and to {where} "
            f"({moved / secs / 1e9:.2f} GB/s over the steps' time), waited {self.drive_wait_seconds / steps * 1e3:.1f} ms "
            f"for the drive and computed {self.update_seconds / steps * 1e3:.1f} ms; with the state in RAM "
            "(a larger ram_budget) or on a faster drive the gap shrinks"
        )

    @property
    def first_mismatch(self) -> int | None:
        """1-based step of the first differing loss, or ``None``."""
        for i, (a, b) in enumerate(zip(self.losses, self.reference_losses)):
            if a != b:
                return i + 1
        return None

    @property
    def equal(self) -> bool:
        """True when every loss and every final parameter is bitwise equal."""
        return (
            self.first_mismatch is None
            and self.params_equal
            and len(self.losses) == len(self.reference_losses)
        )


def state_nbytes(model: torch.nn.Module) -> int:
    """Bytes of AdamW state (fp32 ``exp_avg`` and ``exp_avg_sq``) TieredAdamW keeps for ``model``."""
    layout = Layout.build(
        [list(model.parameters())], shard_numel=1 << 20, fields=("exp_avg", "exp_avg_sq")
    )
    return layout.state_nbytes


def reference_optimizer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The optimizer the tiered one must match, bit for bit."""
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)


def rss_bytes() -> int:
    """Current resident set size of this process."""
    import psutil

    return psutil.Process().memory_info().rss


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def train(
    *,
    steps: int,
    state_dir: str | os.PathLike | None,
    ram_budget: int | float | str | None = None,
    seed: int = 0,
    config: ModelConfig | None = None,
    batch_size: int = 16,
    on_step: StepHook | None = None,
) -> DemoResult:
    """Train the model with ``TieredAdamW`` and with ``torch.optim.AdamW(fused=True)`` in lockstep.

    Parameters
    ----------
    steps
        Training steps (each optimizer takes this many).
    state_dir
        Empty or new directory for the disk tier; ``None``: a private temporary one.
    ram_budget
        RAM for the tiered optimizer's state, in any form ``TieredAdamW`` takes
        (bytes, ``"1MiB"``, or a share of the state: ``"1/8"``, ``"12.5%"``,
        ``0.125``); ``None``: the state size / 8.
    seed
        Seeds the initial weights and the batches.
    config, batch_size
        Model shape (default :class:`ModelConfig`) and sequences per batch.
    on_step
        Called after every step with ``(step, loss, reference_loss)``.

    Returns
    -------
    DemoResult
        Losses of both runs, sizes, peak RSS and timings.

    Raises
    ------
    BudgetError
        If ``ram_budget`` cannot hold the streaming arena.
    ConfigError
        If ``ram_budget`` is neither a size nor a share (``tierstore.sizes.budget_request``).
    StateExistsError
        If ``state_dir`` already holds tierstore state.

    Example
    -------
    >>> r = train(steps=1, state_dir=None, config=ModelConfig(d_model=64, n_layer=1), batch_size=2)
    >>> r.losses == r.reference_losses
    True
    """
    t_start = time.perf_counter()
    start_rss = rss_bytes()
    config = config or ModelConfig()
    torch.manual_seed(seed)
    model = TinyGPT(config)
    reference = copy.deepcopy(model)  # same initial bits, tied head included
    state = state_nbytes(model)
    # The API's one parser (tierstore.sizes): a share is of this model's state, as TieredAdamW reads it.
    budget = state // BUDGET_FRACTION if ram_budget is None else resolve_budget(budget_request(ram_budget), state_bytes=state)
    batches = BatchStream(load_corpus(), context=config.context, batch_size=batch_size, seed=seed)
    params = list(model.parameters())
    ref_opt = reference_optimizer(list(reference.parameters()))
    opt = TieredAdamW(
        params,
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        state_dir=None if state_dir is None else str(state_dir),
        ram_budget=budget,  # shard_numel=None: the optimizer picks shards whose arena takes half of it
        prefetch_depth=PREFETCH_DEPTH,
    )
    # LR schedules work on TieredAdamW as on any torch optimizer; both follow the same one.
    scheds = [
        torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=steps, eta_min=LR / 10)
        for o in (opt, ref_opt)
    ]
    losses: list[float] = []
    ref_losses: list[float] = []
    step_time = [0.0, 0.0]
    traffic, waits = [0, 0], [0.0, 0.0]  # TieredAdamW's bytes read/written; drive waits, update time
    layout_text = opt.describe()  # before training: the tiers, and the commit record as it starts
    with opt:
        for i in range(steps):
            x, y = batches.batch(i)
            for k, (net, o, sched, out) in enumerate(
                ((model, opt, scheds[0], losses), (reference, ref_opt, scheds[1], ref_losses))
            ):
                o.zero_grad(set_to_none=True)
                loss = net.loss(x, y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP_NORM)
                t0 = time.perf_counter()
                o.step()
                step_time[k] += time.perf_counter() - t0
                if o is opt and opt.last_step_stats is not None:
                    st = opt.last_step_stats
                    traffic[0] += st.bytes_read
                    traffic[1] += st.drive_bytes
                    waits[0] += st.read_wait + st.write_wait + st.persist_wait + st.commit_wait
                    waits[1] += st.update
                sched.step()
                out.append(loss.detach().item())
            if on_step is not None:
                on_step(i + 1, losses[-1], ref_losses[-1])
        result = DemoResult(
            steps=steps,
            params=sum(p.numel() for p in params),
            state_bytes=state,
            ram_budget=budget,
            ram_bytes=opt.ram_bytes,
            disk_bytes=opt.disk_bytes,
            shard_numel=opt.layout.shard_numel,
            backend=opt.backend,
            describe=layout_text,
            losses=losses,
            reference_losses=ref_losses,
            params_equal=all(
                torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters())
            ),
            start_rss_bytes=start_rss,
            peak_rss_bytes=peak_rss_bytes(),
            seconds=0.0,
            tiered_step_seconds=step_time[0],
            reference_step_seconds=step_time[1],
            state_dir=opt.state_dir,
            streamed_read_bytes=traffic[0],
            streamed_written_bytes=traffic[1],
            drive_wait_seconds=waits[0],
            update_seconds=waits[1],
        )
    result.seconds = time.perf_counter() - t_start
    return result


# -- command line ---------------------------------------------------------
def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's flags to ``parser``."""
    parser.add_argument(
        "--steps",
        type=_positive_int,
        default=DEFAULT_STEPS,
        help=f"training steps (default {DEFAULT_STEPS})",
    )
    parser.add_argument(
        "--state-dir",
        default=DEFAULT_STATE_DIR,
        help="parent of this run's state directory; each run uses a new run-<time>-<pid> inside it "
        f"(default ./{DEFAULT_STATE_DIR})",
    )
    parser.add_argument(
        "--keep-state",
        action="store_true",
        help="keep this run's state directory instead of removing it",
    )
    parser.add_argument(
        "--ram-budget",
        default=None,
        help="RAM for optimizer state: a size (1MiB) or a share of the state (1/8, 12.5%%, 0.125); "
        "default: state size / 8",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the initial weights and batches (default 0)"
    )
    parser.add_argument(
        "--threads",
        type=_positive_int,
        default=1,
        help="torch intra-op threads (default 1: the matrices are small, and one thread is "
        "fastest and steadiest on a busy 2-core machine)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print a JSON summary instead of the report (no progress bar)",
    )


def _check_state_parent(parent: Path) -> None:
    """Refuse a ``--state-dir`` that cannot hold run directories, before anything is built.

    The nearest part of ``parent`` that exists must be a directory (the rest
    is created); a regular file there would otherwise end in ``File exists``.

    Raises
    ------
    ConfigError
        If ``parent`` or a folder above it is not a directory; names the path and the fix.

    Example
    -------
    >>> import tempfile; f = Path(tempfile.mkdtemp()) / "notes.txt"; _ = f.write_text("x")
    >>> _check_state_parent(f / "sub")
    Traceback (most recent call last):
    ...
    tierstore.errors.ConfigError: --state-dir ...: .../notes.txt is a regular file, not a directory; ...
    """
    from ..paths import blocking_file  # the check export and to-torch make of their output's folder

    blocked = blocking_file(parent)
    if blocked is not None:
        above, kind = blocked
        raise ConfigError(
            f"--state-dir {str(parent)!r}: {above} is {kind}, not a directory; the demo makes a run-<time>-<pid> "
            "directory inside --state-dir, so pass a directory (or a path to create), e.g. --state-dir "
            f"{DEFAULT_STATE_DIR}"
        )


def _new_run_dir(parent: Path) -> tuple[Path, bool]:
    """A fresh ``run-<time>-<pid>`` directory in ``parent``; also says whether ``parent`` was made now."""
    _check_state_parent(parent)
    made_parent = not parent.exists()
    parent.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        path = (
            parent / f"run-{stamp}-{os.getpid()}"
            if n == 0
            else parent / f"run-{stamp}-{os.getpid()}-{n}"
        )
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path, made_parent
    raise FileExistsError(f"could not make a new run directory in {parent}")


def run(args: argparse.Namespace) -> int:
    """Run the demo from parsed flags; 0 when the curves are equal, 1 otherwise."""
    from tqdm import tqdm

    # Checked before anything is built, with the API's parser and errors; a share is resolved by train().
    budget = None if args.ram_budget is None else budget_request(args.ram_budget, name="--ram-budget")
    parent = Path(args.state_dir).expanduser()
    _check_state_parent(parent)  # before the slow part, so a bad path fails at once
    torch.set_num_threads(args.threads)  # the comparison holds for any count: both runs share it
    run_dir, made_parent = _new_run_dir(parent)
    bar = tqdm(
        total=args.steps, unit="step", disable=args.json, file=sys.stderr, dynamic_ncols=True
    )

    def on_step(step: int, loss: float, ref: float) -> None:
        bar.set_postfix_str(
            f"loss {loss:.4f}  AdamW {ref:.4f}  {'equal' if loss == ref else 'DIFFERENT'}",
            refresh=False,
        )
        bar.update(1)

    try:
        result = train(
            steps=args.steps, state_dir=run_dir, ram_budget=budget, seed=args.seed, on_step=on_step
        )
    finally:
        bar.close()
        if not args.keep_state:
            shutil.rmtree(run_dir, ignore_errors=True)
            if made_parent:
                with contextlib.suppress(OSError):  # only if it is empty and this run made it
                    parent.rmdir()
    if args.json:
        summary = {**asdict(result), "equal": result.equal, "first_mismatch": result.first_mismatch}
        summary["state_dir_kept"] = bool(args.keep_state)
        print(json.dumps(summary, indent=1))
    else:
        print(_report(result, kept=args.keep_state))
    return 0 if result.equal else 1


def _report(r: DemoResult, *, kept: bool) -> str:
    marks = sorted(
        {1, max(1, r.steps // 4), max(1, r.steps // 2), max(1, 3 * r.steps // 4), r.steps}
    )
    lines = [
        f"model: byte-level transformer, {r.params:,} parameters; optimizer state {format_size(r.state_bytes)}",
        f"TieredAdamW: {r.describe}",
        "loss  (step: TieredAdamW / torch AdamW fused)",
        *(f"  {s:>5}: {r.losses[s - 1]:.6f} / {r.reference_losses[s - 1]:.6f}" for s in marks),
        f"state in RAM: {format_size(r.ram_bytes)} (ram_budget {format_size(r.ram_budget)}, "
        f"{100 * r.ram_bytes / r.state_bytes:.0f}% of the state); state files on disk: "
        f"{format_size(r.disk_bytes)}, all copies (backend {r.backend or 'none'})",
        f"state dir: {r.state_dir}" + ("" if kept else " (removed)"),
        f"peak RSS: {format_size(r.peak_rss_bytes)} for the whole process ({format_size(r.start_rss_bytes)} "
        "before the models were built; then both models, the reference AdamW's state, activations)",
        f"time: {r.seconds:.1f} s; optimizer steps {r.tiered_step_seconds:.2f} s TieredAdamW, "
        f"{r.reference_step_seconds:.2f} s torch AdamW",
        f"why: {r.timing_explained()}",
    ]
    if r.equal:
        lines.append(
            f"PASS: all {r.steps} losses and the final parameters are bitwise equal to torch.optim.AdamW(fused=True)"
        )
    elif r.first_mismatch is not None:
        s = r.first_mismatch
        lines.append(
            f"FAIL: the losses differ from step {s} on ({r.losses[s - 1]!r} != {r.reference_losses[s - 1]!r})"
        )
    else:
        lines.append("FAIL: the losses are equal but the final parameters differ")
    return "\n".join(lines)
