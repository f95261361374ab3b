"""The compressed update in one compiled pass per block: decode -> AdamW -> encode.

A compressed shard's update (:class:`tierstore._runtime.update.ShardUpdate`) decodes
each chunk's moments into fp32 scratch, runs ``torch._fused_adamw_`` on the
chunk's parameter pieces and encodes the moments back: three passes over
memory per moment, several op launches per chunk. Where the compiled kernel
of :mod:`tierstore._compute.native` can be built, ``ts_update`` does the same work
block by block (256 elements on the stack, in L1): decode, AdamW, encode,
one pass.

Its AdamW is torch's fused CPU kernel written out operation by operation
(``codec_kernel.c`` says which). What those operations are depends on the CPU
capability torch dispatches to (``DEFAULT``, ``AVX2``, ``AVX512``; set by the
CPU and ``ATEN_CPU_CAPABILITY``): each capability's copy of torch's kernel is
compiled differently (FMAs or none, vector width, a vectorised tail). A
:class:`Recipe` describes one; :func:`kernel` picks the recipe of the
capability in use, checks it once per format against decode ->
``torch._fused_adamw_`` -> encode on pieces chosen to hit every rule (weight
decay or not, maximize, amsgrad, both ``lerp`` branches, every tail length,
first and later steps, zeros, subnormals, non-finite gradients, fp32 and
bfloat16 gradients and parameters), and tries the other known recipes where
it differs. A format uses the compiled kernel only where every bit agrees; otherwise it
keeps the torch path and the log says why, once.

Example
-------
>>> k = kernel("int8")  # None where no kernel, TIERSTORE_NATIVE=0, or a torch whose kernel differs
>>> status("int8").startswith(("fused", "torch path"))
True
"""

from __future__ import annotations

import functools
import logging
import math
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .._platform import torch_private
from . import codecs, formats, native
from .hyper import GroupHyper
from .kernel import adamw

log = logging.getLogger(__name__)

#: ``ts_piece`` (addresses and sizes, then :func:`constants`) and ``ts_field`` of
#: ``codec_kernel.c``, packed in native byte order.
_PIECE_HEAD = struct.Struct("=3Q2q2i")
_CONSTANTS = struct.Struct("=7fi")
_FLAGS, _FLAGS_AT = struct.Struct("=i"), 28  # the flags word at the end of the constants
FIELD = struct.Struct("=4Q")
FORMAT_CODES = {"bfloat16": 1, "int8": 2}
TILE_NUMEL = 256  # elements per block of a format without blocks (bfloat16): what stays in L1
_WD, _MAXIMIZE, _AMSGRAD = 1, 2, 4
GRAD_BF16, OUT_BF16, _OUT_NAN_ONES = 8, 16, 32  # Piece.dtypes: a bfloat16 gradient; a bfloat16 param_out
_UNFUSED = 64  # PIECE_UNFUSED: no FMA (torch's DEFAULT capability)

_LOCK = threading.Lock()
# "for": the native.Kernel decided for; "recipe": Recipe | None; "formats": {format name: why not, "" if used}
_STATE: dict[str, object] = {}


@dataclass(frozen=True)
class Recipe:
    """How one CPU capability's copy of torch's fused AdamW computes (what ``codec_kernel.c`` must do).

    Example
    -------
    >>> RECIPES["AVX512"].vec, RECIPES["DEFAULT"].fused
    (16, False)
    """

    name: str
    vec: int  # elements per Vectorized<float>: the body runs whole vectors, the last numel % vec the tail
    fused: bool  # multiply-adds contracted into FMAs (built with FMA) or rounded twice
    tail_vec: int = 0  # the compiler vectorised the tail this wide (its exp_avg_sq contracts as the body's)

    @property
    def flags(self) -> int:
        return 0 if self.fused else _UNFUSED


#: The recipes of torch 2.13's x86-64 builds, by capability (measured: tests/test_cpu_capabilities.py
#: runs each one the CPU has). An unknown capability (another architecture) tries them all.
RECIPES = {
    "AVX512": Recipe("AVX512", vec=16, fused=True, tail_vec=8),
    "AVX2": Recipe("AVX2", vec=8, fused=True),
    "DEFAULT": Recipe("DEFAULT", vec=8, fused=False),
}


def candidates(capability: str) -> list[Recipe]:
    """The recipes to try on ``capability``, the expected one first."""
    first = [RECIPES[capability]] if capability in RECIPES else []
    return first + [r for r in RECIPES.values() if r not in first]


def vector_width() -> int:
    """Elements per ``Vectorized<float>`` of torch's CPU kernels in this process (the tail rule's width)."""
    r = RECIPES.get(torch_private.cpu_capability())
    return r.vec if r is not None else 8


@dataclass(frozen=True)
class Fused:
    """The compiled library and the recipe its fused update runs with here (what :func:`kernel` returns)."""

    lib: native.Kernel
    recipe: Recipe

    @property
    def path(self):  # noqa: ANN201
        return self.lib.path


@functools.cache
def bf16_param_flags() -> int | None:
    """The piece flags that write bfloat16 parameters as this torch build's ``Tensor.copy_`` does,
    or None where its conversion differs from the compiled kernel's (the parameters then take torch copies).

    The kernel rounds to nearest even; NaN differs by build: the AVX2 vector
    conversion gives 0xFFFF, the scalar one 0x7FC0. Both are checked on fixed
    bit patterns (ties of either parity, signed zeros, subnormals, infinities,
    the largest finite values) at lengths that take torch's scalar, vector and
    parallel paths.
    """
    return _bf16_flags_for(lambda out, src: out.copy_(src))


def _bf16_flags_for(convert: Callable[[Tensor, Tensor], object]) -> int | None:
    """:func:`bf16_param_flags` for the fp32 -> bfloat16 conversion ``convert(out, src)``."""
    patterns = [0x3F808000, 0x3F818000, 0x3F808001, 0x3F817FFF, 0x00000000, 0x80000000, 0x00000001,
                0x807FFFFF, 0x00008000, 0x00018000, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF,
                0x7F7F7FFF, 0x3DCCCCCD]  # fmt: skip
    nans = [0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00001]
    bits = np.array(patterns + nans, dtype=np.uint32)
    expected = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint32)  # the compiled kernel's rounding
    is_nan = np.zeros(len(bits), dtype=bool)
    is_nan[len(patterns) :] = True
    seen = set()
    # Each length three times: the patterns as listed, rotated so NaNs come first, and NaNs
    # alone (so a length-1 conversion and every vector's scalar tail meet NaNs too).
    orders = [np.arange(len(bits)), np.roll(np.arange(len(bits)), -len(patterns)), np.nonzero(is_nan)[0]]
    for n in (1, 2, 7, 8, 9, 33, 80, 40_000):
        for order in orders:
            take = np.resize(order, n)
            src = torch.from_numpy(bits[take].view(np.float32).copy())
            out = torch.empty(n, dtype=torch.bfloat16)
            convert(out, src)
            got = out.view(torch.int16).numpy().view(np.uint16)
            nan_mask = is_nan[take]
            if not np.array_equal(got[~nan_mask], expected[take][~nan_mask]):
                return None
            seen.update(int(v) for v in got[nan_mask])
    if seen == {0xFFFF}:
        return OUT_BF16 | _OUT_NAN_ONES
    return OUT_BF16 if seen == {0x7FC0} else None


def constants(hyper: GroupHyper, step: float) -> bytes:
    """The per-tensor constants torch's fused kernel derives from ``hyper`` at ``step``, packed.

    As ``FusedAdamKernel.cpp`` computes them: in double, each rounded to float
    where the AdamW kernel converts it (``scalar_t(...)``).

    Example
    -------
    >>> h = GroupHyper(lr=0.1, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
    >>> len(constants(h, 1.0))
    32
    """
    lr, b1, b2, wd = hyper.lr, hyper.beta1, hyper.beta2, hyper.weight_decay
    bias_correction1 = 1 - b1**step
    bias_correction2 = 1 - b2**step
    floats = np.array(
        [1 - lr * wd, 1 - b1, b2, 1 - b2, math.sqrt(bias_correction2), hyper.eps, lr / bias_correction1],
        dtype=np.float64,
    )
    with np.errstate(over="ignore"):  # as C's conversion: out of range becomes inf
        f32 = floats.astype(np.float32)
    flags = (_WD if wd != 0 else 0) | (_MAXIMIZE if hyper.maximize else 0) | (_AMSGRAD if hyper.amsgrad else 0)
    return _CONSTANTS.pack(*f32.tolist(), flags)


@dataclass(frozen=True)
class Piece:
    """One parameter piece of a chunk, as the compiled kernel takes it (addresses of CPU memory)."""

    start: int  # first element, relative to the chunk
    numel: int
    target: int  # address of the fp32 master (or fp32 parameter) updated in place
    grad: int  # address of the gradient: fp32, or bfloat16 with GRAD_BF16 in dtypes
    param_out: int  # address of a parameter that takes the new values (fp32, or bfloat16 with OUT_BF16), or 0
    constants: bytes  # :func:`constants`
    dtypes: int = 0  # GRAD_BF16 | OUT_BF16 (| _OUT_NAN_ONES: NaN written as 0xFFFF, see bf16_param_flags)

    def pack(self, recipe: Recipe) -> bytes:
        head = _PIECE_HEAD.pack(self.target, self.grad, self.param_out, self.start, self.numel, recipe.vec,
                                recipe.tail_vec)  # fmt: skip
        extra = self.dtypes | recipe.flags
        if not extra:
            return head + self.constants
        (flags,) = _FLAGS.unpack_from(self.constants, _FLAGS_AT)
        return head + self.constants[:_FLAGS_AT] + _FLAGS.pack(flags | extra)


@functools.cache
def _table_addresses(fmt: formats.MomentFormat, field: str) -> tuple[int, int]:
    """Addresses of ``field``'s int8 tables (built once per process and kept: the addresses hold)."""
    nearest, values = formats.kernel_tables(fmt, field)
    return nearest.data_ptr(), values.data_ptr()


def fields(fmt: formats.MomentFormat, stored: Sequence[tuple[Tensor, Tensor | None]], lo: int) -> bytes:
    """The packed fields of a chunk starting at element ``lo``: ``stored`` holds (codes, scales)
    of exp_avg, exp_avg_sq and optionally max_exp_avg_sq, over the whole shard."""
    out = []
    for field, (codes, scales) in zip(formats.FIELDS, stored):
        if scales is None:
            out.append(FIELD.pack(codes.data_ptr() + lo * codes.element_size(), 0, 0, 0))
        else:
            nearest, values = _table_addresses(fmt, field)  # per chunk: looked up once per process
            out.append(FIELD.pack(codes.data_ptr() + lo, scales.data_ptr() + 4 * (lo // fmt.block_numel), nearest, values))
    return b"".join(out)


def block_numel(fmt: formats.MomentFormat) -> int:
    """Elements the compiled kernel decodes, updates and encodes at a time in ``fmt``."""
    return fmt.block_numel or TILE_NUMEL


def update_chunk(
    k: Fused,
    fmt: formats.MomentFormat,
    stored: Sequence[tuple[Tensor, Tensor | None]],
    lo: int,
    hi: int,
    pieces: Sequence[Piece],
) -> None:
    """Update chunk ``[lo, hi)`` of a shard whose fields are ``stored`` (sorted, disjoint ``pieces``)."""
    packed = b"".join(p.pack(k.recipe) for p in pieces)
    k.lib.update(FORMAT_CODES[fmt.name], hi - lo, block_numel(fmt), fields(fmt, stored, lo), len(stored), packed,
                 len(pieces))  # fmt: skip


def applies(fmt: formats.MomentFormat) -> bool:
    """Whether the compiled kernel implements ``fmt`` (the registered compressed formats, rounding to nearest)."""
    return fmt.name in FORMAT_CODES and fmt.rounding == "nearest" and block_numel(fmt) <= native.MAX_BLOCK


def _format_name(fmt: formats.MomentFormat | str) -> str:
    return fmt if isinstance(fmt, str) else fmt.name


def kernel(fmt: formats.MomentFormat | str | None = None) -> Fused | None:
    """The compiled fused update for ``fmt`` where it matches the torch path bit for bit, else None.

    ``fmt=None``: the compiled kernel only where every format it implements
    matches. Decided once per loaded library (:func:`tierstore._compute.native.library`);
    None inside :func:`tierstore._compute.native.suspended` too.
    """
    lib = native.library()
    if lib is None:
        return None
    if _STATE.get("for") is not lib:
        with _LOCK:
            if _STATE.get("for") is not lib:
                _decide(lib)
    recipe: Recipe | None = _STATE["recipe"]  # type: ignore[assignment]
    verdicts: dict[str, str] = _STATE["formats"]  # type: ignore[assignment]
    names = list(FORMAT_CODES) if fmt is None else [_format_name(fmt)]
    if recipe is None or any(verdicts.get(n, "not implemented") for n in names):
        return None
    return Fused(lib, recipe)


def _decide(lib: native.Kernel) -> None:
    """Pick the recipe that the most formats pass with (the capability's own first) and record each
    format's verdict; logs once what is not used, and a recipe other than the expected one."""
    capability = torch_private.cpu_capability()
    best: tuple[Recipe | None, dict[str, str]] | None = None
    for recipe in candidates(capability):
        verdicts = {n: _self_check(lib, recipe, formats.FORMATS[n]) or "" for n in FORMAT_CODES}
        # The first candidate (the capability's own) keeps its reasons unless another passes more.
        if best is None or sum(not v for v in verdicts.values()) > sum(not v for v in best[1].values()):
            best = (recipe, verdicts)
        if not any(verdicts.values()):
            break
    recipe, verdicts = best
    if all(verdicts.values()):
        recipe = None
    elif recipe.name != capability:
        log.info("tierstore: the fused update runs torch's %s recipe on capability %s", recipe.name, capability)
    for name, why in verdicts.items():
        if why:
            log.warning("tierstore: the fused update is not used for %s moments (torch path instead): %s (%s)",
                        name, why, lib.path)  # fmt: skip
    _STATE.update({"for": lib, "recipe": recipe, "formats": verdicts})


def status(fmt: formats.MomentFormat | str | None = None, *, decide: bool = True) -> str:
    """How compressed updates run: ``"fused kernel"``, ``"torch path (<why>)"``, or ``"undecided"``.

    ``fmt=None`` speaks for every format (``"fused kernel"`` only where all
    use it). ``decide=False`` never loads or builds anything (``repr`` and
    ``describe()`` use it): before the first compressed update it answers
    ``"undecided"``.
    """
    if not decide:
        decided, lib = native.loaded()
        if not decided or (lib is not None and _STATE.get("for") is not lib):
            return "undecided"
    if kernel(fmt) is not None:
        return "fused kernel"
    if native.library() is None:
        return f"torch path (compiled kernel: {native.status()})"
    verdicts: dict[str, str] = _STATE["formats"]  # type: ignore[assignment]
    names = list(FORMAT_CODES) if fmt is None else [_format_name(fmt)]
    whys = [f"{n}: {verdicts.get(n, 'not implemented')}" for n in names if verdicts.get(n, "not implemented")]
    return f"torch path (the fused update failed its self-check: {'; '.join(whys)})"


# -- the self-check ---------------------------------------------------------------------


def _variant(i: int, variants: int) -> int:
    """The hyperparameter set of self-check piece ``i``: every set meets every tail length and every
    output kind (the output kind is ``i % 4``, so the set is shifted by the tail, ``i // variants``)."""
    return (i + i // variants) % variants


def _case_pieces(vec: int, variants: int) -> list[tuple[int, int]]:
    """(start, numel) of pieces with every tail length 0..vec-1 for each of ``variants`` hyperparameter
    sets (piece i takes set :func:`_variant`), inside, across and at the end of blocks, with gaps
    between some (the elements of parameters without a gradient)."""
    out, at = [], 0
    for i in range(vec * variants):
        tail = i // variants
        numel = 64 * (1 + i % 3) + tail
        out.append((at, numel))
        at += -(-numel // 64) * 64 + (64 if i % 2 else 0)
    return out


def _reference(fmt, stored, n, pieces, hypers, steps, grads, targets) -> None:  # noqa: ANN001
    """decode -> torch._fused_adamw_ per piece -> encode: the torch path of one chunk."""
    moments = []
    for field, (codes, scales) in zip(formats.FIELDS, stored):
        out = torch.empty(n)
        codecs.decode_chunk(fmt, field, codes, scales, out)
        moments.append(out)
    for (start, numel), hyper, step, g, t in zip(pieces, hypers, steps, grads, targets):
        s = slice(start, start + numel)
        maxs = [moments[2][s]] if hyper.amsgrad else []
        adamw([t], [g], [moments[0][s]], [moments[1][s]], maxs, [step], **hyper.kernel_kwargs())
    for field, (codes, scales), m in zip(formats.FIELDS, stored, moments):
        codecs.encode_chunk(fmt, field, m, codes, scales, temp=m)


def _self_check(lib: native.Kernel, recipe: Recipe, fmt: formats.MomentFormat) -> str | None:
    """Why the fused update of ``fmt`` with ``recipe`` differs from the torch path (None when it does not)."""
    k = Fused(lib, recipe)
    vec = max(16, recipe.vec)  # every tail length of every width torch's builds use
    gen = torch.Generator().manual_seed(1)
    variants = [
        GroupHyper(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=1e-2, eps=1e-8, amsgrad=False, maximize=False),
        GroupHyper(lr=3e-2, beta1=0.3, beta2=0.95, weight_decay=0.0, eps=1e-6, amsgrad=True, maximize=True),
        GroupHyper(lr=1e-4, beta1=0.0, beta2=0.5, weight_decay=0.1, eps=0.0, amsgrad=True, maximize=False),
        GroupHyper(lr=0.5, beta1=0.99, beta2=0.0, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=True),
    ]
    layout = _case_pieces(vec, len(variants))
    n = -(-(layout[-1][0] + layout[-1][1]) // 256) * 256
    for round_ in range(3):  # a first step from zeros, then later steps on what it left
        if round_ == 0:  # zero bytes: zero moments
            stored_ref = [formats.split(fmt, torch.zeros(fmt.encoded_nbytes(n), dtype=torch.uint8), n)
                          for _ in formats.FIELDS]  # fmt: skip
            targets = torch.randn(n, generator=gen)
        hypers = [variants[_variant(i, len(variants))] for i in range(len(layout))]
        steps = [torch.tensor(float(1 + round_ * (7 + i))) for i in range(len(layout))]
        grads = []
        for i, (_, numel) in enumerate(layout):
            g = torch.randn(numel, generator=gen) * 10.0 ** float(-(i % 5))
            if i % 4 == 1:
                g[::5] = 0.0
            if i % 7 == 3:
                g[1] = 1e-41
            if round_ == 2 and i in (5, 9, 11, 14):  # non-finite gradients in bodies and tails
                g[2 if i == 5 else -1] = float("nan") if i != 14 else float("inf")
            if i % 3 == 2:  # a bfloat16 gradient (the torch path widens it into fp32 staging)
                g = g.to(torch.bfloat16)
            grads.append(g)
        stored = [(c.clone(), None if s is None else s.clone()) for c, s in stored_ref]
        mine = targets.clone()
        out = torch.empty(n).fill_(7.0)
        out16 = torch.empty(n, dtype=torch.bfloat16).fill_(7.0)
        pieces = []
        for i, ((start, numel), g, h, st) in enumerate(zip(layout, grads, hypers, steps)):
            dtypes = GRAD_BF16 if g.dtype == torch.bfloat16 else 0
            dest = 0
            if i % 4 == 1:
                dest = out.data_ptr() + 4 * start
            elif i % 4 == 3 and bf16_param_flags() is not None:  # a bfloat16 parameter: param.copy_(master)
                dest, dtypes = out16.data_ptr() + 2 * start, dtypes | bf16_param_flags()
            pieces.append(Piece(start, numel, mine.data_ptr() + 4 * start, g.data_ptr(), dest,
                                constants(h, float(st)), dtypes))  # fmt: skip
        update_chunk(k, fmt, stored, 0, n, pieces)
        ref_targets = [targets[s : s + c] for s, c in layout]
        _reference(fmt, stored_ref, n, layout, hypers, steps, [g.float() for g in grads], ref_targets)
        for (c, s), (rc, rs) in zip(stored, stored_ref):
            if not torch.equal(c.view(torch.uint8), rc.view(torch.uint8)) or (
                s is not None and not torch.equal(s.view(torch.int32), rs.view(torch.int32))
            ):
                return f"{fmt.name} moments differ from decode -> torch._fused_adamw_ -> encode (step {round_ + 1})"
        if not torch.equal(mine.view(torch.int32), targets.view(torch.int32)):
            return f"{fmt.name} parameters differ from torch._fused_adamw_ (step {round_ + 1})"
        # Whole buffers: each piece's output gets its new values, and nothing else is written.
        want, want16 = torch.full((n,), 7.0), torch.full((n,), 7.0, dtype=torch.bfloat16)
        for i, (start, numel) in enumerate(layout):
            if i % 4 == 1:
                want[start : start + numel] = targets[start : start + numel]
            elif i % 4 == 3 and bf16_param_flags() is not None:
                want16[start : start + numel] = targets[start : start + numel].to(torch.bfloat16)
        if not torch.equal(out.view(torch.int32), want.view(torch.int32)):
            return f"{fmt.name}: param_out does not receive the new values (or is written outside its pieces)"
        if not torch.equal(out16.view(torch.int16), want16.view(torch.int16)):
            return f"{fmt.name}: a bfloat16 param_out does not receive the rounded new values"
    return None
