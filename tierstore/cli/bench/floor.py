"""The I/O floor of a step: read and write the state's on-disk bytes with no update at all.

A step on disk cannot beat moving its bytes. :class:`RawFloor` moves the same
number of bytes as the optimizer's state file, in its own preallocated and
written file, the fastest raw ways found:

- ``serial``: read all of it, then write all of it, each with ``depth``
  ``O_DIRECT`` requests in flight into pre-touched aligned buffers; its
  phases also give the read and write bandwidth measured in the same run
  (``bytes / read bandwidth + bytes / write bandwidth``);
- ``stream``: each of ``depth`` threads reads a request and writes it back,
  so reads and writes overlap as in a pipeline with an instant update.

Example
-------
>>> import tempfile, pathlib
>>> floor = RawFloor(pathlib.Path(tempfile.mkdtemp()) / "f.bin", 4 << 20, request_bytes=1 << 20,
...                  depth=2, mode="stream", direct=False).open()
>>> sorted(floor.step())
['read_s', 'seconds', 'write_s']
>>> floor.close()
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from ..._platform.hostmem import HostBuffer
from ...errors import ClosedError, ConfigError
from . import rawio

MODES = ("serial", "stream")


class RawFloor:
    """A file of ``nbytes`` read and written once per :meth:`step`, nothing else.

    Parameters
    ----------
    path
        The floor's own file (created, preallocated and written by :meth:`open`,
        removed by :meth:`close`).
    nbytes
        Bytes per direction per step: the optimizer's on-disk state size.
    request_bytes, depth
        Request size and requests in flight.
    mode
        ``"serial"`` or ``"stream"``.
    direct
        Use ``O_DIRECT`` (``False`` only where the filesystem refuses it).

    Raises
    ------
    ConfigError
        For an unknown ``mode`` or sizes that are not multiples of 4 KiB.
    """

    def __init__(self, path: Path | str, nbytes: int, *, request_bytes: int, depth: int, mode: str, direct: bool = True) -> None:
        if mode not in MODES:
            raise ConfigError(f"floor mode={mode!r} must be one of {MODES}")
        if nbytes <= 0 or nbytes % 4096 or request_bytes <= 0 or request_bytes % 4096:
            raise ConfigError(f"floor sizes must be positive multiples of 4 KiB (nbytes={nbytes}, request_bytes={request_bytes})")
        self.path = Path(path)
        self.nbytes = nbytes
        self.request_bytes = request_bytes
        self.depth = depth
        self.mode = mode
        self.direct = direct
        self.name = f"floor-{mode}"
        self._fd = -1
        self._buffer: HostBuffer | None = None

    def open(self) -> RawFloor:
        """Create, preallocate and write the file; fault the buffers in."""
        self._fd = rawio.open_file(self.path, direct=self.direct, create=True)
        os.posix_fallocate(self._fd, 0, self.nbytes)
        self._buffer = HostBuffer(self.depth * self.request_bytes, pin=False)
        rawio.fill(self._fd, self.nbytes, buffer=self._buffer, request_bytes=self.request_bytes, depth=self.depth)
        return self

    def step(self) -> dict[str, float]:
        """Move the bytes once each way; seconds in all and per phase (serial) or ``nan``."""
        if self._buffer is None:
            raise ClosedError(f"{self.name} is not open; call open() first")
        if self.mode == "serial":
            kw = dict(buffer=self._buffer, request_bytes=self.request_bytes, depth=self.depth)
            read_s = rawio.parallel(self._fd, "read", self.nbytes, **kw)
            write_s = rawio.parallel(self._fd, "write", self.nbytes, **kw)
            return {"seconds": read_s + write_s, "read_s": read_s, "write_s": write_s}
        return {"seconds": self._stream(), "read_s": float("nan"), "write_s": float("nan")}

    def _stream(self) -> float:
        requests = iter(range(0, self.nbytes, self.request_bytes))
        lock = threading.Lock()
        errors: list[BaseException] = []
        buffer = self._buffer
        assert buffer is not None

        def worker(k: int) -> None:
            view = buffer.view[k * self.request_bytes : (k + 1) * self.request_bytes]
            while not errors:
                with lock:
                    start = next(requests, None)
                if start is None:
                    return
                part = view[: min(self.request_bytes, self.nbytes - start)]
                try:
                    rawio.transfer_all(self._fd, "read", part, start)
                    rawio.transfer_all(self._fd, "write", part, start)
                except BaseException as exc:  # re-raised once every thread stopped
                    errors.append(exc)
                    return

        return rawio.timed_threads(worker, self.depth, errors, name="tierstore-floor")

    def close(self) -> None:
        """Close and remove the file, free the buffers; safe to call twice."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self.path.unlink(missing_ok=True)
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None
