"""``TieredAdamW``: a drop-in ``torch.optim.AdamW`` whose state lives in tiers.

The optimizer is the stateful front: it gathers gradients, advances step
counts and hands each shard to the stateless kernel (:mod:`tierstore.kernel`)
through the streaming pipeline (:mod:`tierstore.pipeline`). The layout of the
state is fixed at construction (:mod:`tierstore.layout`); how RAM is split
between the streaming arena and resident shards is :mod:`tierstore.budget`.

Example
-------
>>> import torch
>>> from tierstore import TieredAdamW
>>> model = torch.nn.Linear(64, 64)
>>> with TieredAdamW(model.parameters(), lr=1e-3, ram_budget="64KiB", shard_numel=4096) as opt:
...     model(torch.randn(8, 64)).square().mean().backward()
...     opt.step(); opt.zero_grad()
...     opt.state_dict()["state"][0]["exp_avg"].shape
torch.Size([64, 64])
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from . import distributed
from . import manifest as manifest_mod
from .budget import TierPlan, plan_tiers
from .errors import (
    BudgetError,
    ClosedError,
    ConfigError,
    CorruptStateError,
    ParamsChangedError,
    StateExistsError,
    StepFailedError,
)
from .faults import crash_point
from .kernel import adamw
from .layout import Layout, ShardSpec
from .pipeline import RunStats, ShardPipeline
from .sizes import format_size, parse_size
from .statedir import MANIFEST, StateDir
from .store import ShardStore

log = logging.getLogger(__name__)

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEFAULT_SHARD_NUMEL = 1 << 22  # 4 Mi elements: 16 MiB per state field
RESIDENT_SHARD_NUMEL = 1 << 24  # 16 Mi elements, when all state is resident and unstaged
MIN_AUTO_SHARD_NUMEL = 1 << 10  # 4 KiB per field: tiny budgets still stream, slowly
STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
MASTER_KEY = "master_param"

# torch.optim.AdamW's group keys, so state dicts load into either optimizer.
_TORCH_GROUP_DEFAULTS = {
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": True,
    "decoupled_weight_decay": True,
}


@dataclass
class _Active:
    """One parameter that has a gradient in the current step."""

    group: int
    param: Tensor  # flat view of the parameter's data
    grad: Tensor  # flat view of its gradient
    convert: bool  # gradient must be staged (other dtype or device) before the kernel
    cuda: bool
    step: Tensor


def _check_hyper(lr: Any, betas: Any, eps: Any, weight_decay: Any, where: str = "") -> None:
    """Validate like ``torch.optim.AdamW`` does (same messages), plus the fix."""
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ConfigError(f"Tensor lr must be 1-element{where}")
    if not float(lr) >= 0.0:
        raise ConfigError(f"Invalid learning rate: {lr}{where}; lr must be >= 0")
    if not float(eps) >= 0.0:
        raise ConfigError(f"Invalid epsilon value: {eps}{where}; eps must be >= 0")
    try:
        b1, b2 = betas
    except (TypeError, ValueError):
        raise ConfigError(f"Invalid betas: {betas!r}{where}; pass a pair such as (0.9, 0.999)") from None
    if not 0.0 <= float(b1) < 1.0:
        raise ConfigError(f"Invalid beta parameter at index 0: {b1}{where}; it must be in [0, 1)")
    if not 0.0 <= float(b2) < 1.0:
        raise ConfigError(f"Invalid beta parameter at index 1: {b2}{where}; it must be in [0, 1)")
    if not float(weight_decay) >= 0.0:
        raise ConfigError(f"Invalid weight_decay value: {weight_decay}{where}; it must be >= 0")


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name}={value!r} must be an int >= {minimum}")
    return value


@contextlib.contextmanager
def _update_threads(threads: int | None) -> Iterator[None]:
    """Run with ``threads`` intra-op threads (``None``: leave torch's setting alone)."""
    before = torch.get_num_threads()
    if threads is None or threads >= before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _local(tensor: Tensor) -> Tensor:
    """The local tensor of a DTensor (FSDP2), the tensor itself otherwise."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _placed_like(local: Tensor, param: Tensor) -> Tensor:
    """``local`` as a DTensor placed like the DTensor ``param``, as torch's AdamW keeps FSDP2 state."""
    if not callable(getattr(param, "to_local", None)):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


class TieredAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) with state in RAM and on local disk.

    Results are bitwise equal to ``torch.optim.AdamW(fused=True)`` for fp32
    parameters. For bf16/fp16 parameters (or parameters on a GPU) an fp32
    master copy is kept in the state and is the authoritative value: it equals
    ``torch.optim.AdamW(fused=True)`` run on fp32 copies fed the same
    gradients cast to fp32, and the parameter receives it cast to its dtype.

    Parameters
    ----------
    params
        Parameters or param-group dicts, as for any ``torch.optim.Optimizer``.
    lr, betas, eps, weight_decay, amsgrad, maximize
        As ``torch.optim.AdamW``; per-group values are allowed.
    state_dir
        Directory for the disk tier (created if missing). ``None``: a private
        temporary directory, made only when the state does not fit in
        ``ram_budget``, removed by :meth:`close`.
    ram_budget
        Host RAM the state may use: bytes (``int``) or a string such as
        ``"512MiB"``/``"2GB"``. ``None``: all state in RAM.
    backend
        ``"auto"``, ``"direct"`` (``O_DIRECT``), ``"buffered"`` or ``"mmap"``.
    shard_numel
        Elements per shard (rounded up to a multiple of 1024). ``None`` picks
        4 Mi, or less when the budget is small. Part of the state's identity.
    prefetch_depth
        Shards read ahead of the one being updated (the arena has
        ``prefetch_depth + 2`` slots). A tuning knob: never changes results.
    io_workers, request_bytes
        I/O threads per direction (reads, writes) and the request size
        (a multiple of 4096, rounded up to whole 1 MiB checksum blocks).
        Tuning knobs; the defaults (8, 1 MiB) measured best on this project's
        reference machine (docs/tuning.md).
    keep_master
        Keep an fp32 master copy even for fp32 CPU parameters. ``None``: only
        when some parameter is not fp32 or not on the CPU.
        With it, the state directory alone can restore fp32 parameters after a crash.
    pin_memory
        Pin host buffers for CUDA; ``None`` pins exactly when CUDA is available.
    update_threads
        Intra-op threads for the update while shards stream from disk
        (``None``: all cores but one, which the I/O threads keep). Steps with
        all state in RAM use torch's own setting. A tuning knob.
    durable
        Make every step a crash-consistent checkpoint in ``state_dir`` (two
        copies of every shard, an atomically replaced manifest). ``None``:
        on when a ``state_dir`` is given. With ``durable=False`` a
        ``state_dir`` is resumable only after a clean :meth:`close`.
    resume
        Continue the state in ``state_dir``: the layout fingerprint must match
        these parameters; moments, step counts, hyperparameters and masters
        are restored. An empty directory starts fresh. :attr:`step_count`
        says which step to resume data loading and LR schedules from.
    resume_step
        Resume at this committed step instead of the last one: a durable
        directory also keeps the commit before its last (distributed
        resumes use this to meet at a common step).
    restore_params
        On resume, write the committed master weights back into the
        parameters (when the state has masters).

    Raises
    ------
    ValueError (ConfigError)
        Invalid hyperparameters or knobs.
    BudgetError
        ``ram_budget`` below what the streaming arena needs.
    StateDirError, StateDirInUseError, StateExistsError
        Unusable, busy, or already populated ``state_dir``.
    LayoutMismatchError, FormatVersionError, CorruptStateError
        On resume: state of another model, of a newer format, or damaged.

    Example
    -------
    >>> import torch
    >>> w = torch.nn.Parameter(torch.ones(3))
    >>> opt = TieredAdamW([w], lr=0.1)
    >>> w.grad = torch.ones(3); _ = opt.step(); opt.close()
    >>> [round(x, 3) for x in w.tolist()]
    [0.899, 0.899, 0.899]
    """

    # Note: unlike torch.optim.AdamW, state for every trainable parameter exists
    # from construction (it has a place in the layout); state_dict() still lists
    # only parameters that took at least one step, as torch does.

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        state_dir: str | None = None,
        ram_budget: int | str | None = None,
        backend: str = "auto",
        shard_numel: int | None = None,
        prefetch_depth: int = 2,
        io_workers: int = 8,
        request_bytes: int = 1 << 20,
        keep_master: bool | None = None,
        pin_memory: bool | None = None,
        update_threads: int | None = None,
        durable: bool | None = None,
        resume: bool = False,
        resume_step: int | None = None,
        restore_params: bool = True,
    ) -> None:
        # Note: like torch.optim.AdamW, lr..amsgrad may be passed positionally.
        self._closed = True  # until construction succeeds; makes close() safe on failure
        self._store: ShardStore | None = None
        self._statedir: StateDir | None = None
        self._failure: BaseException | None = None
        _check_hyper(lr, betas, eps, weight_decay)
        budget = None if ram_budget is None else parse_size(ram_budget, name="ram_budget")
        prefetch_depth = _check_int("prefetch_depth", prefetch_depth, 1)
        if update_threads is not None:
            update_threads = _check_int("update_threads", update_threads, 1)
        # Note: while shards stream from disk the update leaves one core to the I/O
        # threads. On few cores, OpenMP threads spin-waiting at the kernel's barrier
        # starve the I/O workers (measured here: the update ran 10x slower).
        self._update_threads = update_threads or max(1, len(os.sched_getaffinity(0)) - 1)
        io_workers = _check_int("io_workers", io_workers, 1)
        request_bytes = _check_int("request_bytes", request_bytes, 4096)
        if request_bytes % 4096:
            raise ConfigError(f"request_bytes={request_bytes} must be a multiple of 4096, e.g. 8 << 20")
        if shard_numel is not None:
            shard_numel = _check_int("shard_numel", shard_numel, 1)
        if not isinstance(backend, str):
            raise ConfigError(f"backend={backend!r} must be a string such as 'auto', 'direct' or 'mmap'")
        if backend not in ("auto", "direct", "buffered", "mmap"):
            raise ConfigError(f"backend={backend!r} is unknown; choose 'auto', 'direct', 'buffered' or 'mmap'")
        if durable and state_dir is None:
            raise ConfigError(
                "durable=True needs a state_dir to keep the committed state in; pass "
                "state_dir=... (or leave durable=None)"
            )
        if resume and state_dir is None:
            raise ConfigError("resume=True needs the state_dir to resume from; pass state_dir=...")
        defaults = dict(
            lr=lr,
            betas=tuple(float(b) for b in betas),
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=bool(amsgrad),
            maximize=bool(maximize),
            **_TORCH_GROUP_DEFAULTS,
        )
        self._building = True
        super().__init__(params, defaults)
        self._building = False
        for gi, group in enumerate(self.param_groups):
            _check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"], f" in param group {gi}")
        self._params: list[Tensor] = [p for g in self.param_groups for p in g["params"]]
        self._check_param_kinds()
        self._budget = budget
        self._durable = (state_dir is not None) if durable is None else bool(durable)
        self._knobs = dict(backend=backend, prefetch_depth=prefetch_depth, io_workers=io_workers, request_bytes=request_bytes)
        self._step_count = 0
        self._last_run: RunStats | None = None
        self._cuda_events: list[Any] = [None, None]  # one per host upload buffer
        self._upload_buffer = 0  # which of the two host upload buffers the last shard used
        self._dirty_marked = False
        self._last_manifest: dict | None = None
        try:
            saved = self._open_dir(state_dir, resume, resume_step)
            self._build_layout(shard_numel, keep_master, saved)
            self._open_store(pin_memory, saved, restore_params)
        except BaseException:
            self._release(discard=True)
            raise
        self._closed = False

    # -- construction helpers -----------------------------------------
    def _check_param_kinds(self) -> None:
        for i, p in enumerate(self._params):
            if not p.requires_grad:
                continue
            local = _local(p)
            if p.dtype not in SUPPORTED_DTYPES:
                raise ConfigError(
                    f"parameter {i} has dtype {p.dtype}; TieredAdamW supports {[str(d) for d in SUPPORTED_DTYPES]}. "
                    "Freeze it (requires_grad=False) or convert it"
                )
            if local.device.type not in ("cpu", "cuda"):
                raise ConfigError(f"parameter {i} is on device {local.device}; TieredAdamW supports cpu and cuda")
            if not local.is_contiguous():
                raise ConfigError(
                    f"parameter {i} (shape {tuple(p.shape)}) is not contiguous; make it contiguous "
                    "(param.data = param.data.contiguous()) before building the optimizer"
                )

    def _open_dir(self, state_dir: str | None, resume: bool, resume_step: int | None) -> dict | None:
        """Lock the state directory (if one was given) and read what it holds."""
        if state_dir is None:
            return None
        self._statedir = StateDir(distributed.rank_state_dir(state_dir)).open()
        where = str(self._statedir.path)
        _, world = distributed.rank_and_world()
        if resume and resume_step is None and world > 1:
            # Every rank resumes at the same step; the ranks ahead roll back one.
            mine = None
            if self._statedir.file(MANIFEST).exists():
                mine = manifest_mod.committed_steps(self._statedir.read_manifest())
            resume_step = distributed.agree_on_step(mine)
        if not self._statedir.holds_state():
            return None
        if not resume:
            raise StateExistsError(
                f"state_dir={where!r} already holds tierstore state from another run; pass "
                "resume=True to continue it, or choose an empty state_dir (delete the old one if "
                "you no longer need it)"
            )
        if not self._statedir.file(MANIFEST).exists():
            log.warning("%s holds state files but no manifest (a run died while starting); starting fresh", where)
            return None
        saved = manifest_mod.at_step(self._statedir.read_manifest(), resume_step, where)
        self._last_manifest = saved  # the next commit's "previous"
        if not saved.get("clean", True):
            raise CorruptStateError(
                f"state_dir={where!r} was written with durable=False by a run that did not close() "
                "cleanly, so its files mix several steps. Start over with an empty state_dir, and "
                "use durable=True (the default with a state_dir) to be able to resume after a crash"
            )
        return saved

    def _build_layout(self, shard_numel: int | None, keep_master: bool | None, saved: dict | None) -> None:
        trainable = [p for p in self._params if p.requires_grad]
        master = bool(keep_master) or any(p.dtype != torch.float32 or _local(p).device.type != "cpu" for p in trainable)
        amsgrad = any(g["amsgrad"] for g in self.param_groups)
        old = manifest_mod.saved_layout(saved, str(self._statedir.path)) if saved else None
        if old is not None:
            # Resuming: adopt the saved identity where the caller left it open.
            shard_numel = old.shard_numel if shard_numel is None else shard_numel
            master = master or (keep_master is None and "master" in old.fields)
            amsgrad = amsgrad or "max_exp_avg_sq" in old.fields
        fields = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
        fields += ("master",) if master else ()
        self._master = master
        self._amsgrad = amsgrad
        self._cuda = any(_local(p).device.type == "cuda" for p in trainable)
        self._convert = any(p.dtype != torch.float32 for p in trainable) or self._cuda
        staging = 4 if self._cuda else (1 if self._convert else 0)
        arena_slots = self._knobs["prefetch_depth"] + 2
        if shard_numel is None:
            shard_numel = self._auto_shard_numel(trainable, self._budget, len(fields), arena_slots, staging)
        self._layout = Layout.build(
            [[_local(p) if p.requires_grad else p for p in g["params"]] for g in self.param_groups],
            shard_numel=shard_numel,
            fields=fields,
        )
        if old is not None:
            manifest_mod.check_same_model(old, self._layout, str(self._statedir.path))
        try:
            self._plan: TierPlan = plan_tiers(
                self._layout, ram_budget=self._budget, arena_slots=arena_slots, staging_buffers=staging
            )
        except BudgetError as exc:
            if old is None:
                raise
            raise BudgetError(
                f"{exc}. Note: resuming, shard_numel={old.shard_numel} is fixed by the saved state; "
                "to stream with smaller shards, save_checkpoint() and load_checkpoint() into a new "
                "state_dir built with a smaller shard_numel"
            ) from None

    @staticmethod
    def _auto_shard_numel(trainable: list[Tensor], budget: int | None, nfields: int, slots: int, staging: int) -> int:
        """Largest power-of-two shard size up to 4 Mi whose arena fits in half the budget.

        When everything stays resident and nothing is staged, shards are 16 Mi:
        each shard piece is one call of the fused kernel, and fewer calls run
        closer to torch's one call per parameter.
        """
        numel = DEFAULT_SHARD_NUMEL
        total = sum(p.numel() for p in trainable)
        if budget is None or (total * nfields + staging * min(numel, total)) * 4 <= budget:
            return RESIDENT_SHARD_NUMEL if staging == 0 else numel
        while numel > MIN_AUTO_SHARD_NUMEL and (slots * nfields + staging) * numel * 4 > budget // 2:
            numel //= 2
        return numel

    def _open_store(self, pin_memory: bool | None, saved: dict | None, restore_params: bool) -> None:
        if self._statedir is None and self._plan.disk_shards:
            self._statedir = StateDir(None).open()  # private, removed by close()
            self._durable = False
        self._store = ShardStore(
            self._layout,
            self._plan,
            directory=self._statedir.path if self._statedir else None,
            backend=self._knobs["backend"],
            io_workers=self._knobs["io_workers"],
            request_bytes=self._knobs["request_bytes"],
            pin=pin_memory,
            durable=self._durable,
        )
        self._pipeline = ShardPipeline(self._store, prefetch_depth=self._knobs["prefetch_depth"])
        if saved is None:
            self._store.open()
            self._failure = None
            with self._mutation():
                self._init_shards()
                self._commit()
                if self._durable and self._store.persists_anything:
                    # Write the second copy too: both copies then hold verifiable
                    # bytes, and later writes overwrite allocated blocks, which
                    # runs about twice as fast as filling fresh ones.
                    self._init_shards()
                    self._commit()
            return
        self._store.open(committed=saved["shards"])
        self._step_count = int(saved["step_count"])
        for group, stored in zip(self.param_groups, saved["param_groups"]):
            for key, value in manifest_mod.decode_group(stored).items():
                group[key] = value
        for p, step in zip(self._params, saved["param_steps"]):
            if step is not None:
                self.state[p]["step"] = torch.tensor(float(step), dtype=torch.float32)
        if restore_params and self._master:
            self._restore_params()
        log.info("resumed %s at step %d", self._statedir.path, self._step_count)

    def _master_sync(self, *, to_params: Callable[[int], bool]) -> Callable[[ShardSpec, Tensor], None]:
        """A per-shard step that copies masters and parameters one way or the other.

        For each parameter piece in the shard, ``to_params(param_index)`` true
        copies the master into the parameter (cast to its dtype); false seeds
        the master from the parameter. Does nothing without master weights.
        """
        flat_params = {i: _local(p).detach().view(-1) for i, p in enumerate(self._params) if p.requires_grad}

        def sync(shard: ShardSpec, flat: Tensor) -> None:
            if not self._master:
                return
            master = self._store.field(flat, shard, "master")
            for seg in shard.segments:
                param = flat_params[seg.param][seg.param_offset : seg.param_offset + seg.length]
                piece = master[seg.shard_offset : seg.shard_offset + seg.length]
                if to_params(seg.param):
                    param.copy_(piece)
                else:
                    piece.copy_(param)

        return sync

    def _init_shards(self) -> None:
        """Zero every shard and seed the master copy from the parameters."""
        seed = self._master_sync(to_params=lambda i: False)

        def fill(shard: ShardSpec, flat: Tensor) -> None:
            flat.zero_()
            seed(shard, flat)

        self._pipeline.run(range(len(self._layout.shards)), fill, read=False)

    def _restore_params(self) -> None:
        """Give every trainable parameter its committed master value, cast to its dtype."""
        self._pipeline.run(range(len(self._layout.shards)), self._master_sync(to_params=lambda i: True), write=False)

    # -- commits ------------------------------------------------------
    def _manifest(self, *, clean: bool) -> dict:
        steps = []
        for p in self._params:
            st = self.state.get(p)
            steps.append(float(st["step"]) if st and "step" in st else None)
        return manifest_mod.build(
            layout=self._layout,
            step_count=self._step_count,
            param_steps=steps,
            groups=self.param_groups,
            shards=self._store.records(),
            durable=self._durable,
            clean=clean,
            backend=self.backend,
            ram_budget=self._budget,
            previous=self._last_manifest,
        )

    def _commit(self) -> None:
        """Make the last mutating pass durable and name it in the manifest (durable mode).

        Without durability only the first change after a clean state marks the
        manifest dirty; :meth:`close` writes the clean one.
        """
        store = self._store
        if self._statedir is None or store is None:
            return
        if self._durable:
            store.commit(self._step_count)
            body = self._manifest(clean=True)
            self._statedir.write_manifest(body)
            self._last_manifest = body
            crash_point("after-commit")
            self._statedir.end_writes()
            return
        if self._statedir.private:
            store.commit(self._step_count)
            return
        if not self._dirty_marked:
            self._statedir.write_manifest(self._manifest(clean=False))
            self._dirty_marked = True
        store.commit(self._step_count)


    # -- torch.optim.Optimizer API ------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_building", False):
            super().add_param_group(param_group)
            return
        raise ParamsChangedError(
            "TieredAdamW lays its state out when it is built, so parameters cannot be added "
            "afterwards (add_param_group). Build a new TieredAdamW with all parameters, e.g. "
            "TieredAdamW([group1, group2], ...)"
        )

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one AdamW step over every parameter that has a gradient.

        Raises
        ------
        ClosedError
            After :meth:`close`.
        ParamsChangedError
            If parameters were added, reshaped or re-typed since construction,
            or a parameter frozen at construction now has a gradient.
        """
        self._require_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        active = self._gather()
        hyper = [self._group_hyper(g) for g in self.param_groups]
        with self._mutation():
            if active:
                torch._foreach_add_([a.step for a in active.values()], 1)
                touched = sorted({shard for i in active for shard, _ in self._layout.segments_of(i)})
                self._active = active
                self._hyper = hyper
                streams = any(not self._store.is_resident(i) for i in touched)
                try:
                    with _update_threads(self._update_threads if streams else None):
                        self._last_run = self._pipeline.run(touched, self._update_shard)
                finally:
                    self._active = {}
            self._step_count += 1
            self._commit()
        return loss

    @contextlib.contextmanager
    def _mutation(self) -> Iterator[None]:
        """Run a state change; if it fails part-way, refuse further use (state is half-updated).

        The committed state on disk is untouched by a failed change, so a new
        optimizer built with ``resume=True`` continues from the last commit.
        """
        try:
            if self._durable and self._statedir is not None:
                self._statedir.begin_writes()
            yield
        except BaseException as exc:
            if self._store is not None:
                self._store.abort()
            self._pipeline.invalidate()
            self._failure = exc
            raise

    def _require_open(self) -> None:
        if self._closed:
            raise ClosedError("this TieredAdamW is closed; build a new one (with resume=True to continue its state)")
        if self._failure is not None:
            where = f" from state_dir={self.state_dir!r}" if self._durable else ""
            raise StepFailedError(
                f"an earlier step failed part-way ({type(self._failure).__name__}: {self._failure}); "
                f"this optimizer's state is half-updated. Build a new TieredAdamW with resume=True"
                f"{where} to continue from the last committed step ({self._committed_step()})"
            ) from self._failure

    def _group_hyper(self, group: dict[str, Any]) -> dict[str, Any]:
        if group["amsgrad"] and not self._amsgrad:
            raise ConfigError(
                "a param group switched to amsgrad=True after construction; the state has no "
                "max_exp_avg_sq field. Build TieredAdamW with amsgrad=True from the start"
            )
        b1, b2 = group["betas"]
        return dict(
            lr=float(group["lr"]),
            beta1=float(b1),
            beta2=float(b2),
            weight_decay=float(group["weight_decay"]),
            eps=float(group["eps"]),
            amsgrad=bool(group["amsgrad"]),
            maximize=bool(group["maximize"]),
        )

    def _gather(self) -> dict[int, _Active]:
        """Check the parameters against the layout and collect those with gradients."""
        params = [p for g in self.param_groups for p in g["params"]]
        if len(params) != len(self._layout.params) or any(a is not b for a, b in zip(params, self._params)):
            raise ParamsChangedError(
                f"the optimizer's parameters changed since construction ({len(self._layout.params)} "
                f"then, {len(params)} now); TieredAdamW's state layout is fixed: build a new optimizer "
                "for a new set of parameters"
            )
        active: dict[int, _Active] = {}
        group_of = [e.group for e in self._layout.params]
        for i, (p, entry) in enumerate(zip(params, self._layout.params)):
            grad = p.grad
            if grad is None:
                continue
            if not entry.trainable:
                if entry.numel == 0:
                    if not p.requires_grad:
                        continue
                    # An empty parameter holds no state but, as in torch, counts its steps.
                else:
                    raise ParamsChangedError(
                        f"parameter {i} (shape {entry.shape}) was frozen (requires_grad=False) when the "
                        "optimizer was built but now has a gradient; build the optimizer after unfreezing, "
                        "or set its .grad to None"
                    )
            local = _local(p)
            if tuple(local.shape) != entry.shape or str(p.dtype).removeprefix("torch.") != entry.dtype:
                raise ParamsChangedError(
                    f"parameter {i} is now {tuple(local.shape)} {p.dtype}, but the optimizer was built "
                    f"for {entry.shape} {entry.dtype}; build a new optimizer after changing the model"
                )
            if grad.is_sparse:
                raise RuntimeError("TieredAdamW does not support sparse gradients")
            g = _local(grad)
            if tuple(g.shape) != entry.shape:
                raise ParamsChangedError(
                    f"the gradient of parameter {i} has shape {tuple(g.shape)}, expected {entry.shape}"
                )
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
            cuda = local.device.type == "cuda"
            active[i] = _Active(
                group=group_of[i],
                param=local.detach().view(-1),
                grad=g.reshape(-1),
                convert=cuda or g.dtype != torch.float32 or g.device.type != "cpu",
                cuda=cuda,
                step=state["step"],
            )
        return active

    def _update_shard(self, shard: ShardSpec, flat: Tensor) -> None:
        """The per-shard update: stage gradients, run the kernel per group, write params back."""
        store = self._store
        assert store is not None
        active = self._active
        exp_avg = store.field(flat, shard, "exp_avg")
        exp_avg_sq = store.field(flat, shard, "exp_avg_sq")
        max_sq = store.field(flat, shard, "max_exp_avg_sq") if self._amsgrad else None
        master = store.field(flat, shard, "master") if self._master else None
        staging = store.staging_buffer(0) if self._convert else None
        work = [(seg, active[seg.param]) for seg in shard.segments if seg.param in active]
        if self._cuda:
            self._stage_cuda_grads(work, staging)
        lists: dict[int, tuple[list[Tensor], ...]] = {}
        for seg, a in work:
            lo, hi = seg.param_offset, seg.param_offset + seg.length
            s0, s1 = seg.shard_offset, seg.shard_offset + seg.length
            grad = a.grad[lo:hi]
            if a.convert:
                if not a.cuda:
                    staging[s0:s1].copy_(grad)
                grad = staging[s0:s1]
            target = master[s0:s1] if master is not None else a.param[lo:hi]
            bucket = lists.setdefault(a.group, ([], [], [], [], [], []))
            bucket[0].append(target)
            bucket[1].append(grad)
            bucket[2].append(exp_avg[s0:s1])
            bucket[3].append(exp_avg_sq[s0:s1])
            if max_sq is not None:
                bucket[4].append(max_sq[s0:s1])
            bucket[5].append(a.step)
        for group, (ps, gs, ms, vs, maxs, steps) in lists.items():
            hyper = self._hyper[group]
            adamw(ps, gs, ms, vs, maxs if hyper["amsgrad"] else [], steps, **hyper)
        crash_point("mid-update")
        if master is not None:
            self._write_params(work, master)

    def _stage_cuda_grads(self, work: list, staging: Tensor) -> None:
        """Copy this shard's CUDA gradients to host staging (one sync per shard)."""
        store = self._store
        raw = store.staging_buffer(1).view(torch.uint8)
        pending = []
        for seg, a in work:
            if not a.cuda:
                continue
            lo, hi = seg.param_offset, seg.param_offset + seg.length
            s0, s1 = seg.shard_offset, seg.shard_offset + seg.length
            src = a.grad[lo:hi]
            if src.dtype == torch.float32:
                staging[s0:s1].copy_(src, non_blocking=True)
            else:
                size = src.element_size()
                dst = raw[s0 * size : s1 * size].view(src.dtype)
                dst.copy_(src, non_blocking=True)
                pending.append((dst, s0, s1))
        torch.cuda.current_stream().synchronize()
        for dst, s0, s1 in pending:
            staging[s0:s1].copy_(dst)

    def _write_params(self, work: list, master: Tensor) -> None:
        """Give each parameter its updated master values, cast to its dtype."""
        cuda_work = []
        for seg, a in work:
            lo, hi = seg.param_offset, seg.param_offset + seg.length
            s0, s1 = seg.shard_offset, seg.shard_offset + seg.length
            if a.cuda:
                cuda_work.append((seg, a, lo, hi, s0, s1))
            else:
                a.param[lo:hi].copy_(master[s0:s1])
        if not cuda_work:
            return
        # Two host buffers alternate so the next shard can be cast while this one uploads.
        which = self._upload_buffer = 1 - self._upload_buffer
        event = self._cuda_events[which]
        if event is not None:
            event.synchronize()
        out = self._store.staging_buffer(2 + which).view(torch.uint8)
        for _seg, a, lo, hi, s0, s1 in cuda_work:
            size = a.param.element_size()
            host = out[s0 * size : s1 * size].view(a.param.dtype)
            host.copy_(master[s0:s1])
            a.param[lo:hi].copy_(host, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._cuda_events[which] = event

    # -- state dict ---------------------------------------------------
    def _param_index(self) -> dict[int, int]:
        return {id(p): i for i, p in enumerate(self._params)}

    @torch._disable_dynamo
    def state_dict(self) -> dict[str, Any]:
        """The state in ``torch.optim.AdamW``'s format (plus ``master_param`` with masters).

        Materialises every moment as a full CPU tensor: for models whose state
        fits in RAM. Larger states stream with ``save_checkpoint``. For DTensor
        (FSDP2) parameters the states are DTensors placed like the parameter,
        holding this rank's part, as ``torch.optim.AdamW`` keeps them (so
        ``get_optimizer_state_dict`` and DCP see each rank's shard).
        """
        self._require_open()
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        index = self._param_index()
        groups = []
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = [index[id(p)] for p in group["params"]]
            groups.append(packed)
        state: dict[int, dict[str, Tensor]] = {}
        wanted: dict[int, dict[str, Tensor]] = {}
        for i, p in enumerate(self._params):
            st = self.state.get(p)
            meta = self._layout.params[i]
            if not st or "step" not in st or (not meta.trainable and meta.numel > 0):
                continue
            entry = {"step": st["step"].clone()}
            amsgrad = self.param_groups[self._layout.params[i].group]["amsgrad"]
            for key in STATE_KEYS:
                if key != "max_exp_avg_sq" or amsgrad:
                    entry[key] = torch.empty(self._layout.params[i].shape, dtype=torch.float32)
            if self._master:
                entry[MASTER_KEY] = torch.empty(self._layout.params[i].shape, dtype=torch.float32)
            state[i] = entry
            wanted[i] = entry
        self._copy_out(wanted)
        for i, entry in state.items():
            for key in entry:
                if key != "step":
                    entry[key] = _placed_like(entry[key], self._params[i])
        result = {"state": state, "param_groups": groups}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            hook_result = post_hook(self, result)
            if hook_result is not None:
                result = hook_result
        return result

    def _field_of(self, key: str) -> str:
        return "master" if key == MASTER_KEY else key

    def _copy_out(self, wanted: dict[int, dict[str, Tensor]]) -> None:
        """Fill ``wanted[param][key]`` tensors from the shards (read-only pass)."""
        if not wanted:
            return
        flats = {i: {k: t.view(-1) for k, t in e.items() if k != "step"} for i, e in wanted.items()}
        shards = sorted({s for i in wanted for s, _ in self._layout.segments_of(i)})

        def visit(shard: ShardSpec, flat: Tensor) -> None:
            for seg in shard.segments:
                dst = flats.get(seg.param)
                if dst is None:
                    continue
                for key, t in dst.items():
                    src = self._store.field(flat, shard, self._field_of(key))
                    t[seg.param_offset : seg.param_offset + seg.length].copy_(
                        src[seg.shard_offset : seg.shard_offset + seg.length]
                    )

        self._pipeline.run(shards, visit, write=False)

    @torch._disable_dynamo
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved by ``TieredAdamW`` or ``torch.optim.AdamW``.

        Raises
        ------
        ValueError
            If its groups or parameter counts do not match, or a tensor has the wrong size.
        """
        self._require_open()
        state_dict = dict(state_dict)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            hook_result = pre_hook(self, state_dict)
            if hook_result is not None:
                state_dict = hook_result
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"loaded state dict has {len(saved_groups)} parameter groups, this optimizer has "
                f"{len(self.param_groups)}"
            )
        for gi, (mine, saved) in enumerate(zip(self.param_groups, saved_groups)):
            if len(mine["params"]) != len(saved["params"]):
                raise ValueError(
                    f"loaded state dict's parameter group {gi} has {len(saved['params'])} parameters, "
                    f"this optimizer's has {len(mine['params'])}"
                )
            _check_hyper(saved["lr"], saved["betas"], saved["eps"], saved["weight_decay"], f" in loaded group {gi}")
            if saved.get("amsgrad", False) and not self._amsgrad:
                raise ValueError(
                    f"loaded parameter group {gi} uses amsgrad but this optimizer was built without it; "
                    "build TieredAdamW with amsgrad=True"
                )
        # Map the saved ids (in group order) onto our parameter indices.
        id_map: dict[Any, int] = {}
        position = 0
        for saved in saved_groups:
            for pid in saved["params"]:
                id_map[pid] = position
                position += 1
        incoming: dict[int, dict[str, Any]] = {}
        for pid, entry in state_dict["state"].items():
            if pid not in id_map:
                raise ValueError(f"loaded state refers to parameter id {pid!r}, which no param group lists")
            i = id_map[pid]
            meta = self._layout.params[i]
            # DTensor states (FSDP2, torch's AdamW layout) hold this rank's part.
            entry = {k: _local(v) if isinstance(v, Tensor) and k != "step" else v for k, v in entry.items()}
            if not meta.trainable and meta.numel > 0:
                continue
            for key in (*STATE_KEYS, MASTER_KEY):
                if key in entry and entry[key].numel() != meta.numel:
                    raise ValueError(
                        f"loaded {key} of parameter {i} has {entry[key].numel()} elements, the parameter "
                        f"has {meta.numel} (shape {meta.shape})"
                    )
            incoming[i] = entry
        sources = {
            i: {k: v.detach().reshape(-1) for k, v in e.items() if k != "step" and isinstance(v, Tensor)}
            for i, e in incoming.items()
        }

        def fill(shard: ShardSpec, flat: Tensor) -> None:
            flat.zero_()
            for seg in shard.segments:
                lo, hi = seg.param_offset, seg.param_offset + seg.length
                s0, s1 = seg.shard_offset, seg.shard_offset + seg.length
                src = sources.get(seg.param, {})
                for key in (*STATE_KEYS, MASTER_KEY):
                    field = self._field_of(key)
                    if key in src and field in self._layout.fields:
                        self._store.field(flat, shard, field)[s0:s1].copy_(src[key][lo:hi])

        steps = {i: float(e["step"]) for i, e in incoming.items() if "step" in e}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in saved_groups]
        # Note: torch state dicts carry no global step count; the most advanced
        # parameter's step is the number of steps taken (what step_count reports).
        self._replace_shards(
            fill,
            param_steps=steps,
            groups=groups,
            masters_given={i for i, src in sources.items() if MASTER_KEY in src},
            step_count=int(max(steps.values(), default=0)),
        )
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    # -- streaming access (state_dict, checkpoints) -------------------
    def _read_shards(self, visit: Callable[[ShardSpec, Tensor], object], shards: Iterable[int] | None = None) -> None:
        """Call ``visit(shard, flat)`` with every shard's current fp32 bytes, read-only.

        Disk shards stream through the arena, so this needs no RAM beyond the budget.
        """
        self._require_open()
        order = range(len(self._layout.shards)) if shards is None else shards
        self._pipeline.run(order, visit, write=False)

    def _replace_shards(
        self,
        fill: Callable[[ShardSpec, Tensor], object],
        *,
        param_steps: dict[int, float],
        groups: list[dict[str, Any]] | None = None,
        masters_given: set[int] | None = None,
        step_count: int | None = None,
    ) -> None:
        """Overwrite the whole state, shard by shard, and commit it.

        ``fill(shard, flat)`` must set every element of ``flat`` (it arrives
        with stale bytes). Master elements of parameters not in
        ``masters_given`` are then seeded from the parameters; parameters in it
        take their (loaded) master value. ``param_steps`` replaces every step
        count (parameters absent from it have no state, as after construction).
        """
        self._require_open()
        given = masters_given or set()
        sync = self._master_sync(to_params=given.__contains__)

        def fill_and_sync(shard: ShardSpec, flat: Tensor) -> None:
            fill(shard, flat)
            sync(shard, flat)

        with self._mutation():
            if step_count is not None:
                self._step_count = int(step_count)
            self._pipeline.run(range(len(self._layout.shards)), fill_and_sync, read=False)
            for i, p in enumerate(self._params):
                if i in param_steps:
                    self.state[p] = {"step": torch.tensor(float(param_steps[i]), dtype=torch.float32)}
                else:
                    self.state.pop(p, None)
            for mine, saved in zip(self.param_groups, groups or []):
                for key, value in saved.items():
                    if key != "params":
                        mine[key] = value
                for key, value in _TORCH_GROUP_DEFAULTS.items():
                    mine.setdefault(key, value)
                mine["betas"] = tuple(float(b) for b in mine["betas"])
            self._commit()

    @classmethod
    def from_deepspeed_config(cls, params: Any, config: Any, **overrides: Any) -> TieredAdamW:
        """Build from a DeepSpeed config (a dict or a JSON path).

        Maps ``optimizer.type/params`` and ``zero_optimization.offload_optimizer``
        (``device``, ``nvme_path``, ``ratio``, ``buffer_count``, ``pin_memory``, ...);
        keys it cannot honour raise ``ConfigError``. ``overrides`` win over the
        config. See :mod:`tierstore.deepspeed_config` for the mapping table.

        Example
        -------
        >>> import torch
        >>> cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        ...        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
        >>> with TieredAdamW.from_deepspeed_config(torch.nn.Linear(4, 4).parameters(), cfg) as opt:
        ...     opt.param_groups[0]["lr"]
        0.001
        """
        from .deepspeed_config import deepspeed_kwargs, materialize_params

        params = materialize_params(params)
        kwargs, _ = deepspeed_kwargs(params, config, **overrides)
        return cls(params, **kwargs)

    def save_checkpoint(self, path: str, **options: Any) -> None:
        """Stream the state into a zarr v3 store at ``path``, one chunk per shard.

        See :func:`tierstore.checkpoint.save_checkpoint` for the layout and options.
        """
        from .checkpoint import save_checkpoint

        save_checkpoint(self, path, **options)

    def load_checkpoint(self, path: str, **options: Any) -> None:
        """Stream a zarr checkpoint written by :meth:`save_checkpoint` back into the state.

        See :func:`tierstore.checkpoint.load_checkpoint`.
        """
        from .checkpoint import load_checkpoint

        load_checkpoint(self, path, **options)

    # -- introspection ------------------------------------------------
    @property
    def layout(self) -> Layout:
        """The state's layout (parameters, shards, fields)."""
        return self._layout

    @property
    def plan(self) -> TierPlan:
        """How ``ram_budget`` was split (arena, staging, resident shards)."""
        return self._plan

    @property
    def step_count(self) -> int:
        """Number of completed :meth:`step` calls (the step to resume data and schedules from)."""
        return self._step_count

    @property
    def state_dir(self) -> str | None:
        """The state directory in use, or ``None`` when all state is in RAM without one."""
        return str(self._statedir.path) if self._statedir and self._statedir.path else None

    @property
    def backend(self) -> str | None:
        """The I/O backend in use (``None`` when nothing is on disk)."""
        return self._store.backend_name if self._store and self._store.files else None

    @property
    def ram_bytes(self) -> int:
        """Host RAM held for state: arena, staging and resident shards."""
        return self._plan.ram_nbytes

    @property
    def disk_bytes(self) -> int:
        """Bytes of state in files."""
        return self._store.disk_nbytes if self._store else 0

    @property
    def last_step_stats(self) -> RunStats | None:
        """Time split of the last :meth:`step` (read wait, update, write wait)."""
        return self._last_run

    def describe(self) -> str:
        """One line: parameters, state size, and where it lives."""
        p = self._plan
        files = ""
        if self.disk_bytes:
            copies = "2 copies, durable" if self._durable else "1 copy"
            files = f"; files {format_size(self.disk_bytes)} ({copies})"
        return (
            f"{self._layout.trainable_numel:,} trainable params, state {format_size(p.state_nbytes)} in "
            f"{len(self._layout.shards)} shards: {len(p.resident)} resident ({format_size(p.resident_nbytes)}), "
            f"{len(p.disk_shards)} streamed from disk ({format_size(p.disk_nbytes)}), arena {p.arena_slots} x "
            f"{format_size(p.slot_nbytes)}{files}"
        )

    # -- lifecycle ----------------------------------------------------
    def close(self) -> None:
        """Release memory, threads, files and the directory lock; safe to call twice.

        A private (``state_dir=None``) directory is removed. With
        ``durable=False`` and a ``state_dir``, the resident shards are written
        out and a clean manifest is committed, so the directory can be resumed.
        """
        if getattr(self, "_closed", True) and self._store is None and self._statedir is None:
            return
        try:
            if not self._closed and self._failure is None:
                self._flush_clean()
        finally:
            self._closed = True
            self._release()

    def _flush_clean(self) -> None:
        store, statedir = self._store, self._statedir
        if store is None or statedir is None or statedir.private or self._durable:
            return
        store.flush_resident()
        store.commit(self._step_count)
        statedir.write_manifest(self._manifest(clean=True))

    def _release(self, *, discard: bool = False) -> None:
        if getattr(self, "_cuda", False) and any(e is not None for e in getattr(self, "_cuda_events", [])):
            for e in self._cuda_events:
                if e is not None:
                    e.synchronize()
        store, self._store = self._store, None
        if store is not None:
            store.close()
        statedir, self._statedir = self._statedir, None
        if statedir is not None:
            statedir.close(discard=discard)

    def __enter__(self) -> TieredAdamW:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: nothing sensible left to do
            self.close()

    def _committed_step(self) -> int | str:
        if self._statedir is None or self._statedir.private:
            return "none: no state_dir"
        try:
            return int(self._statedir.read_manifest()["step_count"])
        except Exception:
            return "unknown"

    def __repr__(self) -> str:
        state = "closed" if self._closed else self.describe()
        return f"TieredAdamW({state})"


