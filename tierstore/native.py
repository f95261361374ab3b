"""The compiled kernel of the compressed formats: built on first use, loaded with ctypes, optional.

:mod:`tierstore.codecs` runs the codecs in torch ops everywhere, and the
compressed update runs decode -> ``torch._fused_adamw_`` -> encode
(:mod:`tierstore.update`). Where a C compiler is available,
``codec_kernel.c`` runs the same computations instead, with the same bytes:
the int8 codec about 2x faster (one pass per block in L1 instead of eight
passes per chunk), and the whole update of a chunk in one pass per block
(:mod:`tierstore.fused_update`). The kernel uses only exactly rounded IEEE
operations; its callers check it against the torch path on every load (a
mismatch disables that part and warns).

The shared library is compiled once per source version, compiler and flags
into a cache directory and reused by every process after. ctypes releases
the GIL during the call, so the codec workers run it in parallel.

Environment:

``TIERSTORE_NATIVE``
    ``auto`` (default: use it when it builds), ``0`` (never: torch ops), or
    ``require`` (raise :class:`~tierstore.errors.ConfigError` when it cannot
    be built, e.g. to check a deployment).
``TIERSTORE_CC`` (else ``CC``, else ``cc``, ``gcc`` or ``clang`` on ``PATH``)
    The C compiler.
``TIERSTORE_CACHE_DIR`` (else ``$XDG_CACHE_HOME/tierstore``, else ``~/.cache/tierstore``)
    Where the library is kept; a temporary directory when it is not writable.

Example
-------
>>> from tierstore import codecs
>>> k = codecs.native_kernel()  # None where no compiler is found or TIERSTORE_NATIVE=0
>>> status().startswith(("compiled", "torch ops"))
True
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path

from torch import Tensor

from .errors import ConfigError

log = logging.getLogger(__name__)

SOURCE = "codec_kernel.c"
ABI_VERSION = 3  # ts_codec_kernel_version() of a library this module can call
MAX_BLOCK = 4096  # elements per block the kernel accepts (MAX_BLOCK in the C source)
# -ffp-contract=off: no FMA the source does not write (clang contracts by default);
# -fno-math-errno: sqrtf as one instruction, so the update's loops vectorise.
FLAGS = ("-O3", "-shared", "-fPIC", "-fno-strict-aliasing", "-std=c99", "-ffp-contract=off", "-fno-math-errno")
LIBS = ("-lm",)  # fmaf in the baseline variant
FALLBACK_FLAGS = ("-DTS_NO_CLONES",)  # for compilers without target attributes (one baseline build)
COMPILE_TIMEOUT_S = 120

_LOCK = threading.Lock()
_STATE: dict[str, object] = {}  # "kernel": Kernel | None, "status": str
_SUSPENDED = 0  # > 0 inside suspended(): torch ops


class Kernel:
    """The loaded library's entry points, on tensors and packed records (arguments are not checked)."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._encode = lib.ts_int8_encode
        self._encode.argtypes = [p, i64, i64, c_int, p, p, p]
        self._encode.restype = None
        self._decode = lib.ts_int8_decode
        self._decode.argtypes = [p, p, i64, i64, p, p]
        self._decode.restype = None
        self._update = lib.ts_update
        self._update.argtypes = [c_int, i64, i64, ctypes.c_char_p, c_int, ctypes.c_char_p, i64]
        self._update.restype = None
        #: Whether the AVX2+FMA variants run in this process (else the baseline build).
        self.fast = bool(lib.ts_codec_kernel_fast())

    def int8_encode(
        self, src: Tensor, codes: Tensor, scales: Tensor, block_numel: int, signed: bool, table: Tensor
    ) -> None:
        """Codes (uint8) and per-block scales (fp32) of the fp32 ``src``; ``table`` is the 2**20 lookup."""
        self._encode(
            src.data_ptr(), src.numel(), block_numel, int(signed), table.data_ptr(), codes.data_ptr(), scales.data_ptr()
        )

    def int8_decode(self, codes: Tensor, scales: Tensor, out: Tensor, block_numel: int, values: Tensor) -> None:
        """``values[code] * scale`` into the fp32 ``out``; ``values`` holds 256 fp32."""
        self._decode(codes.data_ptr(), scales.data_ptr(), out.numel(), block_numel, values.data_ptr(), out.data_ptr())

    def update(self, fmt: int, numel: int, block_numel: int, fields: bytes, nfields: int, pieces: bytes, npieces: int) -> None:
        """The fused update of one chunk: ``fields`` and ``pieces`` are packed ``ts_field``/``ts_piece``
        records (:mod:`tierstore.fused_update` packs them)."""
        self._update(fmt, numel, block_numel, fields, nfields, pieces, npieces)


def _mode() -> str:
    mode = os.environ.get("TIERSTORE_NATIVE", "auto").strip().lower()
    if mode in ("", "auto", "1", "on"):
        return "auto"
    if mode in ("0", "off", "no", "false"):
        return "off"
    if mode == "require":
        return "require"
    raise ConfigError(f"TIERSTORE_NATIVE={mode!r} is unknown; use 'auto' (default), '0' or 'require'")


def _compiler() -> str | None:
    for name in (os.environ.get("TIERSTORE_CC"), os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def cache_dir() -> Path:
    """Where compiled libraries are kept (see the module docs)."""
    if os.environ.get("TIERSTORE_CACHE_DIR"):
        return Path(os.environ["TIERSTORE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tierstore"


def _writable_dir() -> Path:
    try:
        d = cache_dir()
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=d, prefix=".probe-"):
            return d
    except OSError:
        return Path(tempfile.mkdtemp(prefix="tierstore-native-"))


def _source() -> bytes:
    """The kernel's C source, shipped inside the package."""
    return resources.files("tierstore").joinpath(SOURCE).read_bytes()


def _compile(cc: str, source: bytes) -> Path:
    """The library for ``source``, compiled now unless the cache holds it. Raises OSError or RuntimeError."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout.split("\n")[0]
    tag = hashlib.sha256(
        b"\0".join([source, cc.encode(), version.encode(), " ".join(FLAGS + LIBS).encode(), platform.machine().encode()])
    ).hexdigest()[:16]
    directory = _writable_dir()
    target = directory / f"codec-kernel-{tag}.so"
    if target.exists():
        return target
    with tempfile.TemporaryDirectory(dir=directory, prefix=".build-") as tmp:
        src = Path(tmp) / SOURCE
        src.write_bytes(source)
        out = Path(tmp) / "kernel.so"
        errors = []
        for extra in ((), FALLBACK_FLAGS):
            done = subprocess.run(
                [cc, *FLAGS, *extra, "-o", str(out), str(src), *LIBS], capture_output=True, text=True,
                timeout=COMPILE_TIMEOUT_S,
            )
            if done.returncode == 0:
                os.replace(out, target)  # atomic: concurrent builders leave one whole file
                return target
            errors.append(done.stderr.strip()[-2000:])
        raise RuntimeError(f"{cc} failed: {errors[-1]}")


def _load(self_check: Callable[[Kernel], str | None]) -> tuple[Kernel | None, str]:
    mode = _mode()
    if mode == "off":
        return None, "torch ops (TIERSTORE_NATIVE=0)"
    cc = None if sys.platform == "win32" else _compiler()  # the build below is for POSIX compilers
    if cc is None:
        reason = "torch ops (no C compiler found: set TIERSTORE_CC or CC, or install gcc or clang)"
    else:
        try:
            path = _compile(cc, _source())
            lib = ctypes.CDLL(str(path))
            if lib.ts_codec_kernel_version() != ABI_VERSION:
                raise RuntimeError(f"{path} has ABI {lib.ts_codec_kernel_version()}, expected {ABI_VERSION}")
            k = Kernel(lib, path)
            mismatch = self_check(k)
            if mismatch is None:
                return k, f"compiled kernel {path} ({'AVX2+FMA' if k.fast else 'baseline'} variant)"
            warnings.warn(f"tierstore: the compiled int8 codec is not used: {mismatch} ({path})", stacklevel=3)
            reason = f"torch ops (the compiled kernel failed its self-check: {mismatch})"
        except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
            reason = f"torch ops (building the compiled kernel failed: {e})"
    if mode == "require":
        raise ConfigError(f"TIERSTORE_NATIVE=require but the int8 codec kernel is unavailable: {reason}")
    log.info("tierstore int8 codec: %s", reason)
    return None, reason


def kernel(self_check: Callable[[Kernel], str | None]) -> Kernel | None:
    """The compiled kernel, built on the first call of the process; None where it cannot be used.

    ``self_check(kernel)`` runs once after loading and says why the kernel's
    results differ from the torch path (None when they do not); a kernel that
    fails it is not used. :func:`tierstore.codecs.native_kernel` is the caller.
    """
    if _SUSPENDED:
        return None
    if "kernel" not in _STATE:
        with _LOCK:
            if "kernel" not in _STATE:
                k, why = _load(self_check)
                _STATE["status"] = why
                _STATE["kernel"] = k
    return _STATE["kernel"]  # type: ignore[return-value]


def status() -> str:
    """How the int8 codec runs in this process: ``"compiled kernel <path>"``, ``"torch ops (<why>)"``,
    or ``"undecided"`` before the first int8 codec call."""
    return str(_STATE.get("status", "undecided"))


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Torch ops for every int8 codec call of the process while inside (benchmarks compare both paths).

    Example
    -------
    >>> with suspended():
    ...     from tierstore import codecs
    ...     codecs.native_kernel() is None
    True
    """
    global _SUSPENDED
    with _LOCK:
        _SUSPENDED += 1
    try:
        yield
    finally:
        with _LOCK:
            _SUSPENDED -= 1


def reset() -> None:
    """Forget the loaded kernel (tests: the next :func:`kernel` call decides again from the environment)."""
    with _LOCK:
        _STATE.clear()

