"""Host buffers of 2 MiB and more ask for transparent huge pages (``TIERSTORE_HUGEPAGES``)."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest

from tierstore import hostmem
from tierstore.errors import ConfigError
from tierstore.hostmem import HostBuffer

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
THP_MODE = THP.read_text().split("[")[1].split("]")[0] if THP.exists() else "absent"
CAN_ADVISE = hasattr(mmap, "MADV_HUGEPAGE")


def _anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping holding ``address`` (/proc/self/smaps)."""
    inside, total = False, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(not CAN_ADVISE, reason="no MADV_HUGEPAGE on this platform")
def test_large_buffers_are_advised_and_small_ones_not(monkeypatch):
    monkeypatch.delenv("TIERSTORE_HUGEPAGES", raising=False)
    big, small = HostBuffer(8 << 20), HostBuffer(1 << 20)
    try:
        assert big.huge and not small.huge
        if THP_MODE in ("always", "madvise"):
            # A hint the kernel may refuse when memory is badly fragmented; 8 MiB on a test
            # machine is granted in practice.
            assert _anon_huge_kib(big.address) >= 2048, "an advised 8 MiB buffer got no huge page"
    finally:
        big.close()
        small.close()


def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv("TIERSTORE_HUGEPAGES", "0")
    buf = HostBuffer(8 << 20)
    try:
        assert not buf.huge
        if THP_MODE == "madvise":  # with "always" the kernel gives huge pages unasked
            assert _anon_huge_kib(buf.address) == 0
    finally:
        buf.close()


def test_an_unknown_switch_value_is_a_config_error_naming_it(monkeypatch):
    monkeypatch.setenv("TIERSTORE_HUGEPAGES", "lots")
    with pytest.raises(ConfigError, match="TIERSTORE_HUGEPAGES='lots' is unknown; use '1'"):
        hostmem.huge_pages_wanted()
