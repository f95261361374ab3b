"""The compiled int8 codec kernel: built on first use, loaded with ctypes, optional.

:mod:`tierstore.codecs` runs the int8 codec in torch ops everywhere; where a
C compiler is available it runs the same computation from
``codec_kernel.c`` instead, about 2-3x faster (one pass per block in L1
instead of eight passes per chunk), with the same bytes: the kernel uses
only exactly rounded IEEE operations, and a self-check against the torch
path runs on every load (a mismatch disables the kernel and warns).

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
>>> k = kernel()  # None where no compiler is found or TIERSTORE_NATIVE=0
>>> status().startswith(("compiled", "torch ops"))
True
"""

from __future__ import annotations

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
from importlib import resources
from pathlib import Path

import torch
from torch import Tensor

from .errors import ConfigError

log = logging.getLogger(__name__)

SOURCE = "codec_kernel.c"
ABI_VERSION = 1  # ts_codec_kernel_version() of a library this module can call
MAX_BLOCK = 4096  # elements per block the kernel accepts (MAX_BLOCK in the C source)
FLAGS = ("-O3", "-shared", "-fPIC", "-fno-strict-aliasing", "-std=c99")
FALLBACK_FLAGS = ("-DTS_NO_CLONES",)  # for compilers without target_clones (one baseline build)
COMPILE_TIMEOUT_S = 120

_LOCK = threading.Lock()
_STATE: dict[str, object] = {}  # "kernel": Kernel | None, "status": str


class Kernel:
    """The loaded library's two entry points, on tensors (arguments are not checked)."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._encode = lib.ts_int8_encode
        self._encode.argtypes = [p, i64, i64, ctypes.c_int, p, p, p]
        self._encode.restype = None
        self._decode = lib.ts_int8_decode
        self._decode.argtypes = [p, p, i64, i64, p, p]
        self._decode.restype = None

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
        b"\0".join([source, cc.encode(), version.encode(), " ".join(FLAGS).encode(), platform.machine().encode()])
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
                [cc, *FLAGS, *extra, "-o", str(out), str(src)], capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S
            )
            if done.returncode == 0:
                os.replace(out, target)  # atomic: concurrent builders leave one whole file
                return target
            errors.append(done.stderr.strip()[-2000:])
        raise RuntimeError(f"{cc} failed: {errors[-1]}")


def _self_check(k: Kernel) -> str | None:
    """Why ``k`` does not match the torch path (None when it does), on values chosen to hit every rule."""
    from . import codecs  # codecs imports this module lazily; no cycle at import time

    gen = torch.Generator().manual_seed(0)
    n = 4 * 256 + 77  # whole blocks and a partial one
    x = torch.randn(n, generator=gen) * torch.rand(n, generator=gen).pow(6)
    x[3], x[300], x[301], x[600] = float("nan"), float("inf"), -float("inf"), -0.0
    x[768:1024] = 0.0  # a zero block
    x[1024:1030] = torch.tensor([1e-42, -1e-44, 3e38, -3e38, 1e-39, 0.0])
    fmt = codecs.moment_format("int8")
    for field, data in (("exp_avg", x), ("exp_avg_sq", x.abs().square() * torch.sign(x + 0.4))):
        torch_codes = torch.empty(n, dtype=torch.uint8)
        torch_scales = torch.empty(fmt.num_blocks(n))
        codecs.encode_chunk(fmt, field, data, torch_codes, torch_scales, native=False)
        codes, scales = torch.empty_like(torch_codes), torch.empty_like(torch_scales)
        tables = codecs._tables(codecs._map_kind(fmt, field))
        k.int8_encode(data, codes, scales, fmt.block_numel, field == "exp_avg", tables.nearest)
        if not (torch.equal(codes, torch_codes) and torch.equal(scales.view(torch.int32), torch_scales.view(torch.int32))):
            return f"encode of {field} differs from the torch path"
        want, got = torch.empty(n), torch.empty(n)
        codecs.decode_chunk(fmt, field, codes, scales, want, native=False)
        k.int8_decode(codes, scales, got, fmt.block_numel, tables.decode.view(torch.float32))
        if not torch.equal(want.view(torch.int32), got.view(torch.int32)):
            return f"decode of {field} differs from the torch path"
    return None


def _load() -> tuple[Kernel | None, str]:
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
            mismatch = _self_check(k)
            if mismatch is None:
                return k, f"compiled kernel {path}"
            warnings.warn(f"tierstore: the compiled int8 codec is not used: {mismatch} ({path})", stacklevel=3)
            reason = f"torch ops (the compiled kernel failed its self-check: {mismatch})"
        except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
            reason = f"torch ops (building the compiled kernel failed: {e})"
    if mode == "require":
        raise ConfigError(f"TIERSTORE_NATIVE=require but the int8 codec kernel is unavailable: {reason}")
    log.info("tierstore int8 codec: %s", reason)
    return None, reason


def kernel() -> Kernel | None:
    """The compiled kernel, built on the first call of the process; None where it cannot be used."""
    if "kernel" not in _STATE:
        with _LOCK:
            if "kernel" not in _STATE:
                k, why = _load()
                _STATE["status"] = why
                _STATE["kernel"] = k
    return _STATE["kernel"]  # type: ignore[return-value]


def status() -> str:
    """How the int8 codec runs in this process: ``"compiled kernel <path>"`` or ``"torch ops (<why>)"``."""
    kernel()
    return str(_STATE["status"])


def reset() -> None:
    """Forget the loaded kernel (tests: the next :func:`kernel` call decides again from the environment)."""
    with _LOCK:
        _STATE.clear()

