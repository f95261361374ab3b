"""Host buffers of 2 MiB and more get transparent huge pages, or none with ``TIERSTORE_HUGEPAGES=0``."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest

from tierstore._platform import hostmem
from tierstore._platform.hostmem import HostBuffer
from tierstore.errors import ConfigError

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
THP_MODE = THP.read_text().split("[")[1].split("]")[0] if THP.exists() else "absent"
ADVISABLE = hasattr(mmap, "MADV_HUGEPAGE") and THP_MODE != "absent"
needs_thp = pytest.mark.skipif(THP_MODE not in ("always", "madvise"), reason=f"transparent huge pages: {THP_MODE}")


def _smaps_field(address: int, name: str) -> int:
    """``name`` (e.g. THPeligible) of the mapping holding ``address``, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == f"{name}:":
            return int(line.split()[1])
    raise AssertionError(f"no {name} for the mapping at {address:#x}")


def test_large_buffers_ask_for_huge_pages_and_small_ones_do_not(monkeypatch):
    monkeypatch.delenv("TIERSTORE_HUGEPAGES", raising=False)
    big, small = HostBuffer(8 << 20), HostBuffer(1 << 20)
    try:
        assert big.huge == ADVISABLE and not small.huge
    finally:
        big.close()
        small.close()


@needs_thp
def test_the_kernel_takes_the_advice_and_the_switch_takes_it_back(monkeypatch):
    monkeypatch.delenv("TIERSTORE_HUGEPAGES", raising=False)
    on = HostBuffer(8 << 20)
    monkeypatch.setenv("TIERSTORE_HUGEPAGES", "0")
    off = HostBuffer(8 << 20)
    try:
        assert _smaps_field(on.address, "THPeligible") == 1  # deterministic, unlike AnonHugePages
        assert not off.huge
        assert _smaps_field(off.address, "THPeligible") == 0  # MADV_NOHUGEPAGE, even under "always"
    finally:
        on.close()
        off.close()


def test_an_unknown_switch_value_is_a_config_error_naming_it(monkeypatch):
    monkeypatch.setenv("TIERSTORE_HUGEPAGES", "Lots")
    with pytest.raises(ConfigError, match="TIERSTORE_HUGEPAGES='Lots' is unknown; use '1'"):
        HostBuffer(4096)  # checked for every buffer, small ones too
    with pytest.raises(ConfigError, match="TIERSTORE_HUGEPAGES"):
        hostmem.huge_pages_wanted()
