"""Builds the compiled kernel at install (optional: without a compiler the install still succeeds,
and tierstore builds it on first use instead; see tierstore/_compute/native.py)."""

import hashlib
import runpy
from pathlib import Path

from setuptools import Extension, setup

HERE = Path(__file__).parent
flags = runpy.run_path(str(HERE / "tierstore" / "_compute" / "build_flags.py"))
source = HERE / "tierstore" / "_compute" / flags["SOURCE"]
digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]  # native.source_hash: a stale build is not loaded

setup(
    ext_modules=[
        Extension(
            f"tierstore._compute.{flags['INSTALLED_NAME']}",
            sources=[str(source.relative_to(HERE))],
            extra_compile_args=list(flags["COMPILE_FLAGS"]),
            define_macros=[("TS_SOURCE_HASH", f'"{digest}"')],
            libraries=list(flags["LIBS"]),
            optional=True,
        )
    ]
)
