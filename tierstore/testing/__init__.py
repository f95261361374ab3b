"""Test kits for code built on tierstore: import them from a test module.

- :mod:`tierstore.testing.backend`: :class:`~tierstore.testing.backend.BackendTests`,
  the conformance tests every I/O backend runs (subclass it and set ``backend``).
- :mod:`tierstore.testing.algorithm`: the conformance checks every optimizer
  algorithm passes against its torch class (:func:`~tierstore.testing.algorithm.check_algorithm`
  over an :class:`~tierstore.testing.algorithm.AlgorithmCase`).
- :mod:`tierstore.testing.crash`: train in a child process, SIGKILL it at a named
  crash point or a random instant inside a chosen phase, check where it landed.
- :mod:`tierstore.testing.fsrecord`: record every operation that reaches a directory.
- :mod:`tierstore.testing.fsimage`: the images a power cut could leave of it.
- :mod:`tierstore.testing.powercut`: record a training run, resume from power-cut
  images of it, compare bitwise with ``torch.optim.AdamW(fused=True)`` (a state
  over several directories too: one log, every directory in each image).
- :mod:`tierstore.testing.drives`: a second, faster "drive" for tests of a state
  over several directories (an ext4 loop device in tmpfs, or a tmpfs directory),
  saying which.
- :mod:`tierstore.testing.move_kill`: kill a ``tierstore move`` in a child at a
  crash point, say where it died.
- :mod:`tierstore.testing.ranks`: run a function in gloo ranks on the CPU, kill
  them all when one dies, say where each ended.
- :mod:`tierstore.testing.distributed`: deterministic FSDP2/ZeRO training jobs
  for those ranks, their single-process reference and the comparison.
- :mod:`tierstore.testing.dcp_ram`: peak RAM of DCP saves and loads of a state.
- :mod:`tierstore.testing.memory`: run a real optimizer scenario in a child
  process and measure its peak RSS growth and page cache against
  ``ram_budget`` (:func:`~tierstore.testing.memory.run_in_child`).

The kits need ``pytest`` and ``hypothesis`` (the ``test`` extra); importing
:mod:`tierstore` itself never imports this package.

Example
-------
>>> from tierstore.testing.backend import BackendTests
>>> class TestMmap(BackendTests):
...     backend = "mmap"
"""

__all__: list[str] = []  # the kits are the submodules above, each imported by name
