"""One shard's record in the store: its tier, its extent in the state files, its committed copy.

The record is shared by the threads of a running optimizer; which thread may
touch which field is written on :class:`ShardEntry` itself, and
:class:`~tierstore._storage.store.ShardStore` keeps to it.

Example
-------
>>> e = ShardEntry(index=0, tier="disk", nbytes=8192, offset=0)
>>> e.record()
{'copy': 0, 'checksum': None, 'stale_checksum': None, 'written_step': -1}
"""

from __future__ import annotations

from dataclasses import dataclass

from .shard_transfer import ShardTransfer


@dataclass(slots=True)
class ShardEntry:
    """One shard: its tier, its extent in the state files, and its committed copy.

    Who may touch which field (the threads: the *step side*, i.e. whichever
    thread runs the step or a whole-state visit, one at a time, handed over
    by the overlap's synchronisation; the *commit thread* of
    :class:`~tierstore._state.journal.Journal`; the I/O workers, which never touch
    an entry):

    - ``index``, ``tier``, ``nbytes``, ``offset``, ``drive``: fixed when the
      store is built; any thread reads them.
    - ``copy``, ``checksum``, ``written_step``, ``stale_checksum`` (the
      committed record) and ``pending`` (the newest write since the last
      commit): *the books*, shared by the step side (reads pick the newest
      copy, writes pick the uncommitted one, a failed change forgets
      ``pending``) and the commit thread (it adopts ``pending`` and records
      the books in the manifest). Every read and write of them holds
      :attr:`ShardStore.books` (:meth:`ShardStore.books_of` reads them
      together, so no thread ever sees a copy with another copy's checksum).
    - ``dirty``, ``persist``: resident shards' write bookkeeping, owned by the
      step side (a step claims a shard, a commit's start writes it); the
      commit thread only waits for the transfers it was handed and never
      reads or writes these fields (checked: :meth:`ShardStore.claim_resident`
      and :meth:`ShardStore.persist_resident` refuse the commit thread).
    """

    index: int
    tier: str  # "ram" or "disk"
    nbytes: int
    offset: int  # byte offset of the extent in every state file of its drive
    drive: int = 0  # the drive (directory) whose state files hold its copies
    copy: int = 0  # books: the file holding the committed bytes
    checksum: str | None = None  # books: checksum of the committed bytes (None: nothing committed)
    written_step: int = -1  # books: the step_count whose commit wrote the committed bytes
    stale_checksum: str | None = None  # books: checksum of the other copy (the previous commit), if intact
    pending: tuple[int, str] | None = None  # books: (copy, checksum) written since the last commit: the newest bytes
    dirty: bool = False  # step side: resident, changed since its bytes were last written
    persist: ShardTransfer | None = None  # step side: resident, its write for a commit (done or in flight)

    def record(self) -> dict:
        """What the manifest keeps of this shard (call with the store's books lock held)."""
        return {
            "copy": self.copy,
            "checksum": self.checksum,
            "stale_checksum": self.stale_checksum,
            "written_step": self.written_step,
        }
