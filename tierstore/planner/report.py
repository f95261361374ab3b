"""The text ``tierstore plan`` prints for a :class:`~tierstore.planner.results.MemoryPlan`: :func:`format_plan`.

Example
-------
>>> both_units(3 << 30), both_units(16 << 20), seconds_text(0.000004), days_text(0.01)
('3.00 GiB (3.22 GB)', '16.00 MiB (16.78 MB)', '4.0 µs', '14.4 min')
"""

from __future__ import annotations

from .._compute.algorithms import algorithm_named
from .._compute.codecs import FORMATS
from .._layout.layout import MASTER, PAGE_NUMEL, STATE_ITEMSIZE
from ..sizes import format_size
from .results import GB, MemoryPlan

__all__ = ["format_plan", "drive_lines", "both_units", "count_text", "seconds_text", "days_text", "padding_text", "MOMENT_BYTES"]

MOMENT_BYTES = {name: fmt.bytes_per_element for name, fmt in FORMATS.items()}  # per moment element, scales included


def both_units(nbytes: int) -> str:
    """Binary and decimal units side by side: people check both by hand (MB below a GB: never "0.00 GB")."""
    if nbytes < 1 << 20:
        return format_size(nbytes)
    if nbytes < GB:
        return f"{format_size(nbytes)} ({nbytes / 10**6:,.2f} MB)"
    return f"{format_size(nbytes)} ({nbytes / GB:,.2f} GB)"


def count_text(n: int) -> str:
    """A parameter count the way people say it: ``7B``, ``125M``, ``350k``."""
    for unit, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def seconds_text(value: float | None) -> str:
    """Seconds, in the unit that shows their digits (``7.00 s``, ``13.7 ms``, ``4.0 µs``)."""
    if value is None:
        return "unknown"
    if value >= 1 or value == 0:
        return f"{value:.2f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.1f} ms"
    if value >= 1e-6:
        return f"{value * 1e6:.1f} µs"
    return f"{value * 1e9:.1f} ns"


def days_text(days: float | None) -> str:
    """A span of days: ``2.5 days``, ``1,826.3 days (5.0 years)``; below a tenth of a day in hours, minutes or seconds."""
    if days is None:
        return "unknown"
    if days >= 730:
        return f"{days:,.1f} days ({days / 365.25:,.1f} years)"
    if days >= 0.1:
        return f"{days:,.1f} days"
    seconds = days * 86_400
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} hours"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return seconds_text(seconds)


def padding_text(plan: MemoryPlan) -> str | None:
    """Why the stored state is larger than bytes per param x params, when the padding is worth a line (>= 1%).

    Example
    -------
    >>> from tierstore.planner import plan_memory
    >>> padding_text(plan_memory(110, host_ram=1 << 30)).split(":")[0]
    '880 B unpadded, stored as 8.00 KiB'
    """
    unpadded = round(plan.trainable_params * plan.state_bytes_per_param)
    if plan.state - unpadded < plan.state / 100:
        return None
    return (
        f"{format_size(unpadded)} unpadded, stored as {format_size(plan.state)}: {plan.padded_numel:,} elements per "
        f"field, as each parameter starts at a multiple of {plan.param_align} elements and a shard holds whole "
        f"{PAGE_NUMEL:,}-element pages (4 KiB of fp32, as O_DIRECT needs)"
    )


def _budget_how(plan: MemoryPlan) -> str:
    h = plan.host
    parts = []
    if h.budget_given > h.budget:
        parts.append(("" if h.budget_is_default else f"asked {format_size(h.budget_given)}, ")
                     + "capped at what the whole state takes in RAM")  # fmt: skip
    elif h.budget_given < h.budget:
        parts.append(f"{'leaves' if h.budget_is_default else 'asked'} {format_size(h.budget_given)}, "
                     "below the minimum: shown at the minimum")  # fmt: skip
    if h.budget_is_default:
        default = "default: 90% of host RAM" + (" minus the model" if h.model else "")
        return f" ({default}" + "".join(f"; {part}" for part in parts) + ")"
    return "".join(f"; {part}" for part in parts)


def _smallest(plan: MemoryPlan) -> str:
    """What the smallest ram_budget is: one that streams, or (a state no larger than the arena) the whole state."""
    h = plan.host
    if h.stream_floor is None:
        return (
            f"the whole state is no larger than a {plan.prefetch_depth + 2}-slot streaming arena of its shards, so "
            f"it never streams: the smallest ram_budget is all of it, {format_size(h.min_budget)}"
        )
    if not plan.disk.disk_shards:
        return "every shard resident: the budget holds the whole state"
    return f"the smallest ram_budget that streams: {format_size(h.stream_floor)}"


def _every(steps: float) -> str:
    return f"{steps:,.0f}" if steps == int(steps) else f"{steps:,.1f}"


def format_plan(plan: MemoryPlan) -> str:
    """The human-readable report ``tierstore plan`` prints.

    Example
    -------
    >>> from tierstore.planner import plan_memory
    >>> print(format_plan(plan_memory(125_000_000, host_ram=16 << 30)).splitlines()[0])
    tierstore plan: 125M trainable params (0 frozen), fp32, AdamW
    """
    p, g, h, d, t, s, e, tb = plan, plan.gpu, plan.host, plan.disk, plan.traffic, plan.step_time, plan.endurance, plan.torch
    b = both_units
    precision = "fp32" if p.precision == "fp32" else f"{p.precision} mixed precision (fp32 master)"
    algorithm = algorithm_named(p.optimizer)
    moment_bytes = MOMENT_BYTES[p.moment_dtype]
    # A moment format stores the algorithm's compressible fields; the master and the others stay fp32.
    stored = {f: moment_bytes if f != MASTER and algorithm.field(f).compressible else STATE_ITEMSIZE for f in p.fields}
    parts = " + ".join(f"{f} {nbytes:.4g}" for f, nbytes in stored.items())
    moments = "" if p.moment_dtype == "float32" else f", {p.moment_dtype} moments"
    padded = padding_text(p)
    short = algorithm.torch_class.rsplit(".", 1)[-1]  # AdamW, SGD, Adagrad, Lion
    lines = [
        f"tierstore plan: {count_text(p.trainable_params)} trainable params ({count_text(p.frozen_params)} frozen), "
        f"{precision}, {short}{''.join(' ' + o for o in p.options)}{moments}",
        f"  optimizer state: {p.state_bytes_per_param:.3g} B/param ({parts})"
        + (f" x {p.trainable_params:,} params = {padded}" if padded else f" = {b(p.state)}"),
        f"  shards: {p.shards:,} x {p.shard_numel:,} elements ({format_size(h.slot)} each)",
        "",
    ]
    if g.used:
        mem = "memory unknown" if g.memory is None else b(g.memory)
        fits = "" if g.fits is None else ("  fits" if g.fits else "  DOES NOT FIT")
        lines += [
            f"GPU: {mem}; activations not included",
            f"  weights ({p.precision})       {b(g.weights)}",
            f"  grads ({p.precision})         {b(g.grads)}",
            f"  total                {b(g.total)}{fits}",
        ]
    else:
        lines += ["GPU: none (the model trains on the CPU)"]
    lines += [
        f"host RAM: {b(h.ram)}; ram_budget {b(h.budget)}{_budget_how(p)}",
        "  arena                "
        + (f"{h.arena_slots} slots x {format_size(h.slot)} = {b(h.arena)}" if h.arena_slots else "none (all state resident)"),
        "  staging              "
        + (f"{h.staging_buffers} x {format_size(h.staging // h.staging_buffers)} = {b(h.staging)}" if h.staging_buffers else "none (fp32 on the CPU)"),
        *([f"  decode scratch       {b(h.scratch)} ({p.moment_dtype} shards decode into fp32)"] if h.scratch else []),
        f"  resident state       {b(h.resident)} ({h.resident_shards:,} of {p.shards:,} shards)",
        f"  = ram_budget's part  {b(h.ram_nbytes)} ({_smallest(p)})",
        f"  fixed overhead       {format_size(h.overhead)} (interpreter, I/O threads, checkpoint and DCP buffers"
        + (f", {format_size(h.grad_buckets)} of gradient buckets" if h.grad_buckets else "") + ")",
        f"  tierstore total      {b(h.tierstore_total)} (peak RSS growth, measured by the tests)",
    ]
    if h.pinned:
        lines.append(f"  pinned (page-locked) {b(h.pinned)} of it: RLIMIT_MEMLOCK (ulimit -l) must allow that much")
    if h.model:
        lines.append(f"  model (CPU training) {b(h.model)} (weights + grads)")
    lines.append(f"  total                {b(h.total)}" + ("  fits" if h.fits else "  DOES NOT FIT"))
    free = "free space unknown" if d.free is None else f"{b(d.free)} free"
    lines += [
        f"disk: {free}; {'durable: two copies of every shard' if p.durable else 'not durable'}",
        f"  state files          {b(d.primary)} ({'every shard' if p.durable else f'{d.disk_shards:,} shards on disk'})",
        f"  durability copy      {b(d.durability)}",
        f"  total                {b(d.total)}" + ("" if d.fits is None else ("  fits" if d.fits else "  DOES NOT FIT")),
        *(drive_lines(p) if p.drives else []),
        "",
        "per step",
        "  PCIe                 "
        + (f"down {b(t.pcie_down)} (grads), up {b(t.pcie_up)} (params)" if g.used else "none (no GPU)"),
        f"  disk                 read {b(t.disk_read)}, write {b(t.streamed_write)}",
    ]
    if t.resident_write and t.steps_per_commit is not None:
        keep_up = ""
        if p.bandwidth.write_gbps:
            keep_up = f"; keeps up when forward+backward takes >= {seconds_text(t.commit_write / (p.bandwidth.write_gbps * GB))}"
        policy = "" if t.commit_every in ("'auto'", _every(t.steps_per_commit)) else f" (commit_every={t.commit_every})"
        lines.append(
            f"  commits              write {b(t.resident_write)} (resident shards) every {_every(t.steps_per_commit)} "
            f"step(s){policy}, in the background{keep_up}"
        )
    bw = p.bandwidth
    known = lambda v, unit="GB/s": "?" if v is None else f"{v:.3g} {unit}"  # noqa: E731
    lines += [
        f"  step time >= {seconds_text(s.lower_bound)} (bound by {s.bound_by})",
        f"    = max(disk {seconds_text(s.disk)}, PCIe {seconds_text(s.pcie)}, CPU update {seconds_text(s.update)}, "
        f"memory {seconds_text(s.memory)}, fixed {seconds_text(s.fixed)})",
        ("    disk = the slowest drive's share (drives, above)" if p.drives else
         f"    disk = read/{known(bw.read_gbps)} + write/{known(bw.write_gbps)}") + "; PCIe = max(down, up)/"
        f"{known(bw.pcie_gbps)}; update = params/{known(bw.update_gparams, 'Gparam/s')}; "
        f"memory = state/{known(bw.memory_gbps)} (copy); fixed = a step's own cost, at least",
        *_endurance_lines(p),
    ]
    opt_per_param = tb.optimizer // max(p.trainable_params, 1)
    fits = "" if tb.fits is None else (" - fits" if tb.fits else " - does not fit")
    budget = "all state in RAM" if h.proposed_budget is None else format_size(h.proposed_budget)
    commit = f", commit_every={t.commit_every}" if p.durable and t.commit_every != "'auto'" else ""
    lines += [
        "",
        f"plain {algorithm.torch_class} ({tb.where}): weights {b(tb.weights)} + grads {b(tb.grads)} + "
        f"optimizer {b(tb.optimizer)} ({opt_per_param} B/param) = {b(tb.total)}"
        f" ({tb.total // max(p.trainable_params, 1)} B/param){fits}",
        f"{algorithm.front}(..., ram_budget={h.proposed_budget}, shard_numel={p.shard_numel}, "
        f"prefetch_depth={p.prefetch_depth}{', durable=True' if p.durable else ''}{commit}"
        f"{'' if p.moment_dtype == 'float32' else f', moment_dtype={p.moment_dtype!r}'})"
        f"  # ram_budget = {budget}",
    ]
    lines += [f"note: {n}" for n in p.notes]
    lines.append(f"verdict: {p.verdict}; {p.wear}" if p.wear else f"verdict: {p.verdict}")
    for short in p.shortfalls:
        lines.append(f"  {short.resource}: need {b(short.need)}, have {b(short.have)}")
        lines.append(f"    fix: {short.fix}")
    if e.fix:
        lines.append(f"  drive wear: need {e.tbw_for_lifetime:,.0f} TBW for {e.lifetime_months:g} months, have {e.drive_tbw:g} TBW")
        lines.append(f"    fix: {e.fix}")
    return "\n".join(lines)


def drive_lines(p: MemoryPlan) -> list[str]:
    """The drives section of a plan over several drives: each one's share, and the step's disk time over them."""
    b, striped = both_units, p.striped
    lines = [f"drives: {len(p.drives)}, shards placed by {striped.placed_by}"
             + ("; each holds two copies of its shards (durable)" if p.durable else "; each holds its streamed shards")]
    width = max(len(s.name) for s in p.drives)
    for s in p.drives:
        speed = ("bandwidth unknown" if s.bandwidth_gbps is None else
                 f"read {s.read_gbps:.3g} + write {s.write_gbps:.3g} GB/s: {s.bandwidth_gbps:.3g} GB/s read+write")
        free = "" if s.free is None else f" of {b(s.free)} free" + ("  fits" if s.fits else "  DOES NOT FIT")
        lines.append(f"  {s.name:<{width}}  {s.shards:,} shards, {b(s.state)} of state; files {b(s.files)}{free}")
        lines.append(f"  {'':<{width}}  {speed}; streams {s.streamed_shards:,} shards ({b(s.streamed)}) a step"
                     + ("" if s.step_seconds is None else f" in {seconds_text(s.step_seconds)}"))
    if striped.floor_seconds is not None:
        lines.append(
            f"  streamed step on disk >= {seconds_text(striped.placement_seconds)} (the slowest drive's share); striped "
            f"floor {seconds_text(striped.floor_seconds)} = {b(striped.streamed)} / {striped.combined_gbps:.3g} GB/s "
            f"combined read+write; the fastest drive alone: {seconds_text(striped.fastest_alone_seconds)}"
        )
    else:
        lines.append("  step time unknown: give every drive's bandwidth (--drive PATH:SIZE:READ/WRITE, or --io-json "
                     "from `tierstore bench io DIR...`, or --knobs from `tierstore tune`)")
    return lines


def _endurance_lines(p: MemoryPlan) -> list[str]:
    t, e, s = p.traffic, p.endurance, p.step_time
    b = both_units
    policy = ""
    if t.steps_per_commit is not None:
        policy = f" (commit_every={t.commit_every}{', assumed every step' if t.commit_assumption else ''})"
    lines = [
        "SSD endurance",
        f"  writes               {b(e.writes_per_step)} per step, {b(e.writes_per_1000_steps)} per 1,000 steps{policy}",
    ]
    months = f"{e.lifetime_months:g} months"
    if e.drive_tbw is None:
        if e.writes_per_step:
            per_day = e.writes_per_step * 86_400 / s.lower_bound
            lines.append(f"  {b(round(per_day))} a day of back-to-back steps; the drive's life needs its rating (--drive-tbw)")
        return lines
    if e.steps_to_exhaust is None:
        lines.append(f"  rated {e.drive_tbw:g} TBW: no writes, no wear")
        return lines
    lines.append(
        f"  rated {e.drive_tbw:g} TBW: exhausted after {e.steps_to_exhaust:,.0f} steps = "
        f"{days_text(e.endurance_days)} of back-to-back steps at {seconds_text(s.lower_bound)}"
    )
    n = e.commit_every_for_lifetime
    if e.lasts:
        smallest = f" (commit_every={n} is the smallest that does)" if n is not None and n > 1 else ""
        lines.append(f"  lifetime {months}: lasts{smallest}")
    else:
        how = (f"commit_every={n} makes it last {months}" if n is not None else
               "no commit_every makes it last: the streamed shards alone wear it out")  # fmt: skip
        lines.append(
            f"  lifetime {months}: WEARS OUT; "
            + (f"{how}; " if p.durable else "the streamed shards alone wear it out; ")
            + f"these writes need a drive rated {e.tbw_for_lifetime:,.0f} TBW"
        )
    return lines
