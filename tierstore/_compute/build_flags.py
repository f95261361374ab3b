"""How ``codec_kernel.c`` is compiled: one home for the install-time and the first-use build.

``setup.py`` reads this file without importing the package (torch is not in
the build environment), so it imports nothing.

Example
-------
>>> "-ffp-contract=off" in COMPILE_FLAGS
True
"""

SOURCE = "codec_kernel.c"
INSTALLED_NAME = "_codec_kernel"  # the extension setup.py builds: tierstore/_compute/_codec_kernel<suffix>
# -ffp-contract=off: no FMA the source does not write (clang contracts by default; the compiled kernel
# must round exactly where torch's does); -fno-math-errno: sqrtf as one instruction, so the
# update's loops vectorise. Never -ffast-math.
COMPILE_FLAGS = ("-O3", "-fno-strict-aliasing", "-std=c99", "-ffp-contract=off", "-fno-math-errno")
LIBS = ("m",)  # fmaf in the baseline variant
FALLBACK_FLAGS = ("-DTS_NO_CLONES",)  # for compilers without target attributes (one baseline build)
