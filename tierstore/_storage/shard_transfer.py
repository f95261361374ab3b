"""A transfer of one shard's extent, with the check (a read) or the bookkeeping (a write) run once after it.

Example
-------
>>> import tempfile, pathlib
>>> from tierstore.backends import open_backend
>>> from tierstore._platform.hostmem import HostBuffer
>>> from tierstore._storage.transfer import IOQueue
>>> f = open_backend("buffered", pathlib.Path(tempfile.mkdtemp()) / "s.bin", 1 << 20, create=True)
>>> buf = HostBuffer(1 << 20)
>>> with IOQueue(workers=2, request_bytes=256 << 10) as io:
...     done = ShardTransfer(io.write(f, buf.view, 0), lambda: print("recorded"))
...     done.wait(); done.wait()  # several threads may wait: the bookkeeping runs once
recorded
>>> f.close(); buf.close()
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from .transfer import Transfer


class ShardTransfer:
    """A :class:`~tierstore._storage.transfer.Transfer` of one shard plus the check or bookkeeping after it.

    Several threads may wait for one transfer (a commit and the next step both
    wait for a resident shard's write): the bookkeeping runs once, and every
    waiter sees its error.
    """

    __slots__ = ("_transfer", "_after", "_done", "_error", "_lock")

    def __init__(self, transfer: Transfer, after: Callable[[], None]) -> None:
        self._transfer = transfer
        self._after = after
        self._done = False
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._transfer.nbytes

    def done(self) -> bool:
        return self._transfer.done()

    def wait(self) -> None:
        """Wait for the bytes, then verify (reads) or record the checksum (writes)."""
        self._transfer.wait()
        with self._lock:
            if not self._done:
                self._done = True
                try:
                    self._after()
                except BaseException as exc:
                    self._error = exc
            if self._error is not None:
                raise self._error
