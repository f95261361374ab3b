"""The compiled kernel of the compressed formats: built at install, loaded with ctypes, optional.

:mod:`tierstore._compute.codecs` runs the codecs in torch ops everywhere, and the
compressed update runs decode -> ``torch._fused_adamw_`` -> encode
(:mod:`tierstore._runtime.update`). ``codec_kernel.c`` runs the same computations
instead, with the same bytes: the int8 codec about 2x faster (one pass per
block in L1 instead of eight passes per chunk), and the whole update of a
chunk in one pass per block (:mod:`tierstore._compute.fused_update`). The kernel uses
only exactly rounded IEEE operations; each caller checks the part it uses
against the torch path once per process (:func:`checked`), and a mismatch
disables that part only.

Where the library comes from, in order:

1. **Built at install**: ``pip install`` compiles ``codec_kernel.c`` into
   ``tierstore/_compute/_codec_kernel*.so`` (``setup.py``; optional, so an install
   without a compiler still succeeds). It is used when it carries the hash of
   the shipped source (a stale in-place build is skipped).
2. **Built on first use**, where no library came with the install: once per
   source, compiler and flags (the file name carries their hash), under a
   file lock (processes starting at once build once), into a cache directory
   made with mode 0700. A cached library is loaded only if it is a regular
   file owned by this user, in a directory owned by this user, neither
   writable by group or others: a library another user planted would run
   inside the training process.

Nothing is built on ``import tierstore``, by ``repr``/``describe()`` or by the
CLI's ``--help``/``--version``: only the first compressed update or int8
codec call builds. ctypes releases the GIL during a call, so the codec
workers run it in parallel.

Environment:

``TIERSTORE_NATIVE``
    ``auto`` (default: use it when it loads), ``0`` (never: torch ops), or
    ``require`` (raise :class:`~tierstore.errors.ConfigError` when it cannot
    be loaded or built, e.g. to check a deployment).
``TIERSTORE_CC`` (else ``CC``, else ``cc``, ``gcc`` or ``clang`` on ``PATH``)
    The C compiler of the first-use build (a command, e.g. ``clang`` or
    ``/usr/bin/gcc-12``). When set, it is the compiler: one that is not found
    is reported, never replaced by another.
``TIERSTORE_CACHE_DIR`` (else ``$XDG_CACHE_HOME/tierstore``, else ``~/.cache/tierstore``)
    Where first-use builds are kept; a private temporary directory when it
    cannot be made safe (created, owned by this user, mode 0700).

Example
-------
>>> lib = library()  # None where nothing can be loaded or built, or TIERSTORE_NATIVE=0
>>> status().startswith(("compiled", "torch ops", "undecided"))
True
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import importlib.machinery
import logging
import os
import platform
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path

from torch import Tensor

from .._config.registry import env
from ..errors import ConfigError
from .build_flags import COMPILE_FLAGS, FALLBACK_FLAGS, INSTALLED_NAME, SOURCE
from .build_flags import LIBS as _LIBS

log = logging.getLogger(__name__)

ABI_VERSION = 5  # ts_codec_kernel_version() of a library this module can call
MAX_BLOCK = 4096  # elements per block the compiled kernel accepts (MAX_BLOCK in the C source)
FLAGS = ("-shared", "-fPIC", *COMPILE_FLAGS)  # the first-use build's (setup.py: the same COMPILE_FLAGS)
LIBS = tuple(f"-l{lib}" for lib in _LIBS)
COMPILE_TIMEOUT_S = 120
LOCK_NAME = ".build.lock"

_LOCK = threading.Lock()
_STATE: dict[str, object] = {}  # "library": Kernel | None, "status": str, "checks": {name: (ok, why)}
_SUSPENDED = 0  # > 0 inside suspended(): torch ops


def source_hash(source: bytes) -> str:
    """The hash a library built from ``source`` carries (``TS_SOURCE_HASH``): 16 hex digits of sha256."""
    return hashlib.sha256(source).hexdigest()[:16]


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
        self._lion = lib.ts_lion
        self._lion.argtypes = [ctypes.c_char_p, i64, c_int]
        self._lion.restype = None
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

    def lion(self, pieces: bytes, npieces: int, flags: int) -> None:
        """Lion's update of fp32 pieces: ``pieces`` are packed ``ts_lion_piece`` records
        (:mod:`tierstore._compute.lion_kernel` packs them)."""
        self._lion(pieces, npieces, flags)

    def update(self, fmt: int, numel: int, block_numel: int, fields: bytes, nfields: int, pieces: bytes, npieces: int) -> None:
        """The fused update of one chunk: ``fields`` and ``pieces`` are packed ``ts_field``/``ts_piece``
        records (:mod:`tierstore._compute.fused_update` packs them)."""
        self._update(fmt, numel, block_numel, fields, nfields, pieces, npieces)


def _mode() -> str:
    return str(env("TIERSTORE_NATIVE"))  # "auto", "off" or "require"


def _compiler() -> list[str] | None:
    """The compiler command of a first-use build, or None where none is found.

    Raises
    ------
    ConfigError
        ``TIERSTORE_CC`` is set to a command that is not found: it is never
        silently replaced by another compiler.
    """
    chosen = env("TIERSTORE_CC")  # the command line split, or None when unset
    if chosen:
        if shutil.which(chosen[0]) is None:
            raise ConfigError(
                f"TIERSTORE_CC={shlex.join(chosen)!r}: {chosen[0]!r} is not found on PATH; "
                "set it to an installed C compiler (gcc, clang, a full path) or unset it"
            )
        return list(chosen)
    for name in (os.environ.get("CC", "").strip(), "cc", "gcc", "clang"):
        if name:
            with contextlib.suppress(ValueError):
                argv = shlex.split(name)
                if argv and shutil.which(argv[0]):
                    return argv
    return None


def cache_dir() -> Path:
    """Where first-use builds are kept (see the module docs)."""
    chosen = env("TIERSTORE_CACHE_DIR")
    if chosen is not None:
        return chosen
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tierstore"


def _unsafe(st: os.stat_result, what: str, *, kind: int, root_ok: bool = False) -> str | None:
    """Why a file or directory with status ``st`` cannot be trusted with code (None when it can):
    it must be of ``kind``, owned by this user (or root, with ``root_ok``) and not writable by
    group or others."""
    if stat.S_IFMT(st.st_mode) != kind:
        return f"{what} is not a {'directory' if kind == stat.S_IFDIR else 'regular file'}"
    if st.st_uid != os.getuid() and not (root_ok and st.st_uid == 0):
        return f"{what} is owned by uid {st.st_uid}, not by this user ({os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _safe_cache_dir() -> tuple[Path, str | None]:
    """The cache directory, created with mode 0700 if missing, and why it was refused (then a private
    temporary directory instead, used by this process only)."""
    d = cache_dir()
    why = None
    try:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        why = _unsafe(os.lstat(d), f"the cache directory {d}", kind=stat.S_IFDIR)
    except OSError as e:
        why = f"the cache directory {d} cannot be created ({e.strerror or e})"
    if why is None:
        return d, None
    return Path(tempfile.mkdtemp(prefix="tierstore-native-")), why


def _source() -> bytes:
    """The kernel's C source, shipped inside the package."""
    return resources.files("tierstore._compute").joinpath(SOURCE).read_bytes()


def build_tag(cc: list[str], source: bytes) -> str:
    """16 hex digits naming a build of ``source`` by ``cc`` with this module's flags (file names carry it)."""
    version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30).stdout.split("\n")[0]
    return hashlib.sha256(
        b"\0".join([source, " ".join(cc).encode(), version.encode(), " ".join(FLAGS + LIBS).encode(),
                    platform.machine().encode()])  # fmt: skip
    ).hexdigest()[:16]


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``directory/.build.lock`` (never through a symlink)."""
    fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _compile(cc: list[str], source: bytes) -> Path:
    """The library for ``source``, compiled now unless the cache holds a trusted copy.

    Raises OSError or RuntimeError (the message says why).
    """
    directory, refused = _safe_cache_dir()
    if refused:
        log.warning("tierstore: %s; building the compiled kernel in %s instead", refused, directory)
    target = directory / f"codec-kernel-{build_tag(cc, source)}.so"
    with _build_lock(directory):  # a second process waits here, then finds the first one's build
        try:
            why = _unsafe(os.lstat(target), f"the cached library {target}", kind=stat.S_IFREG)
        except FileNotFoundError:
            why = "missing"
        if why is None:
            return target
        if why != "missing":
            # Never load it; replacing it is safe, since the directory is ours (checked above).
            log.warning("tierstore: %s; rebuilding it", why)
        with tempfile.TemporaryDirectory(dir=directory, prefix=".build-") as tmp:
            src = Path(tmp) / SOURCE
            src.write_bytes(source)
            out = Path(tmp) / "kernel.so"
            errors = []
            for extra in ((), FALLBACK_FLAGS):
                done = subprocess.run(
                    [*cc, *FLAGS, *extra, f"-DTS_SOURCE_HASH=\"{source_hash(source)}\"", "-o", str(out), str(src), *LIBS],
                    capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S,
                )
                if done.returncode == 0:
                    os.chmod(out, 0o700)
                    os.replace(out, target)  # atomic: a reader sees no file or a whole one
                    return target
                errors.append(done.stderr.strip()[-2000:])
        raise RuntimeError(f"{' '.join(cc)} failed: {errors[-1]}")


def installed_path() -> Path | None:
    """The library ``pip install`` built into the package (None where the install had no compiler)."""
    package = Path(str(resources.files("tierstore._compute")))
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = package / f"{INSTALLED_NAME}{suffix}"
        if candidate.is_file():
            return candidate
    return None


def _open(path: Path, source: bytes) -> Kernel:
    """Load the library at ``path`` and check its ABI and source. Raises OSError or RuntimeError."""
    lib = ctypes.CDLL(str(path))
    try:
        abi = lib.ts_codec_kernel_version()
        lib.ts_codec_kernel_source.restype = ctypes.c_char_p
        built_from = lib.ts_codec_kernel_source()
    except AttributeError as e:
        raise RuntimeError(f"{path} is not a tierstore kernel of this version ({e})") from e
    if abi != ABI_VERSION:
        raise RuntimeError(f"{path} has ABI {abi}, expected {ABI_VERSION}")
    if built_from != source_hash(source).encode():
        raise RuntimeError(f"{path} was built from another codec_kernel.c (source {built_from!r})")
    return Kernel(lib, path)


def _load() -> tuple[Kernel | None, str]:
    mode = _mode()
    if mode == "off":
        return None, "torch ops (TIERSTORE_NATIVE=0)"
    source = _source()
    reason = None
    installed = installed_path()
    if installed is not None:
        try:
            # As trusted as the package's own Python files: owned by this user or root, not writable
            # by group or others.
            why = _unsafe(os.lstat(installed), f"the installed library {installed}", kind=stat.S_IFREG, root_ok=True)
            if why:
                raise RuntimeError(why)
            k = _open(installed, source)
            return k, f"compiled kernel {installed} (built at install; {'AVX2+FMA' if k.fast else 'baseline'} variant)"
        except (OSError, RuntimeError) as e:
            log.info("tierstore: the compiled kernel built at install is not used: %s", e)
    try:
        cc = None if sys.platform == "win32" else _compiler()  # the build below is for POSIX compilers
    except ConfigError as e:
        if mode == "require":
            raise
        cc, reason = None, f"torch ops ({e})"
    if cc is None:
        reason = reason or "torch ops (no C compiler found: set TIERSTORE_CC or CC, or install gcc or clang)"
    else:
        try:
            path = _compile(cc, source)
            k = _open(path, source)
            return k, f"compiled kernel {path} (built on first use; {'AVX2+FMA' if k.fast else 'baseline'} variant)"
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            reason = f"torch ops (building the compiled kernel failed: {e})"
    if mode == "require":
        raise ConfigError(f"TIERSTORE_NATIVE=require but the compiled kernel is unavailable: {reason}")
    log.info("tierstore compiled kernel: %s", reason)
    return None, reason


def library() -> Kernel | None:
    """The compiled library, loaded (or built) on the first call of the process; None where unavailable.

    Callers use :func:`checked`, which adds the self-check of the part they use.
    """
    if _SUSPENDED:
        return None
    if "library" not in _STATE:
        with _LOCK:
            if "library" not in _STATE:
                k, why = _load()
                _STATE.update({"status": why, "library": k, "checks": {}})
    return _STATE["library"]  # type: ignore[return-value]


def loaded() -> tuple[bool, Kernel | None]:
    """(decided, library): whether this process has decided yet, and the library it loaded. Never builds."""
    return "library" in _STATE, _STATE.get("library")  # type: ignore[return-value]


def checked(part: str, self_check: Callable[[Kernel], str | None]) -> Kernel | None:
    """The library where ``self_check`` passes for ``part`` (decided once per process), else None.

    ``self_check(kernel)`` says why the part's results differ from the torch
    path (None when they do not). A failing part warns once and is not used;
    the other parts of the same library stay in use.
    """
    k = library()
    if k is None:
        return None
    checks: dict[str, tuple[bool, str]] = _STATE["checks"]  # type: ignore[assignment]
    if part not in checks:
        with _LOCK:
            if part not in checks:
                mismatch = self_check(k)
                if mismatch is not None:
                    why = f"the compiled {part} is not used: {mismatch} ({k.path})"
                    log.warning("tierstore: %s", why)
                    if _mode() == "require":
                        raise ConfigError(f"TIERSTORE_NATIVE=require but {why}")
                checks[part] = (mismatch is None, "" if mismatch is None else mismatch)
    ok, _ = checks[part]
    return k if ok else None


def part_status(part: str) -> str | None:
    """Why ``part`` does not use the loaded library (``""`` when it does; None while undecided)."""
    checks = _STATE.get("checks") or {}
    got = checks.get(part)  # type: ignore[union-attr]
    return None if got is None else got[1]


def status() -> str:
    """How the compiled library stands in this process: ``"compiled kernel <path> (...)"``,
    ``"torch ops (<why>)"``, or ``"undecided"`` before the first use. Never builds."""
    return str(_STATE.get("status", "undecided"))


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Torch ops for every compiled-kernel call of the process while inside (benchmarks compare both paths).

    Example
    -------
    >>> with suspended():
    ...     library() is None
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
    """Forget the loaded kernel (tests: the next :func:`library` call decides again from the environment)."""
    with _LOCK:
        _STATE.clear()


__all__ = ["ABI_VERSION", "Kernel", "MAX_BLOCK", "cache_dir", "checked", "installed_path", "library", "loaded",
           "part_status", "reset", "status", "suspended"]  # fmt: skip
