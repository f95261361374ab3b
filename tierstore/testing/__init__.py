"""Test kits for code built on tierstore: import them from a test module.

- :mod:`tierstore.testing.backend`: :class:`~tierstore.testing.backend.BackendTests`,
  the conformance tests every I/O backend runs (subclass it and set ``backend``).

The kits need ``pytest`` and ``hypothesis`` (the ``test`` extra); importing
:mod:`tierstore` itself never imports this package.

Example
-------
>>> from tierstore.testing.backend import BackendTests
>>> class TestMmap(BackendTests):
...     backend = "mmap"
"""
