"""The compiled int8 codec kernel (:mod:`tierstore._compute.native`): same bytes as torch ops, optional, safe.

Each test decides afresh (the ``fresh`` fixture of ``tests/conftest.py``) and
leaves the process as it found it, so the other tests keep whatever this
machine can build.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore._compute import codecs, formats, fused_update, native
from tierstore.errors import ConfigError

HAVE_CC = native._compiler() is not None


def _need_kernel() -> native.Kernel:
    k = codecs.native_kernel()
    if k is None:
        pytest.skip(f"no compiled kernel here: {native.status()}")
    return k


def _encode(field: str, x: torch.Tensor, impl: str) -> torch.Tensor:
    out = torch.zeros(formats.moment_format("int8").encoded_nbytes(x.numel()), dtype=torch.uint8)
    codecs.encode("int8", field, x, out, threads=1, impl=impl)
    return out


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler on this machine")
def test_builds_into_the_cache_directory_once(fresh):
    k = codecs.native_kernel()
    assert k is not None, native.status()
    assert k.path.parent == fresh / "cache"
    assert stat.S_IMODE((fresh / "cache").stat().st_mode) == 0o700
    assert native.status() == f"compiled kernel {k.path} (built on first use; {'AVX2+FMA' if k.fast else 'baseline'} variant)"
    mtime = k.path.stat().st_mtime_ns
    native.reset()
    assert codecs.native_kernel().path == k.path and k.path.stat().st_mtime_ns == mtime, "a cached build was rebuilt"


@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 5000), scale=st.sampled_from([1e-40, 1e-20, 1.0, 1e30]),
       field=st.sampled_from(["exp_avg", "exp_avg_sq"]))
@settings(max_examples=60, deadline=None)
def test_kernel_equals_torch_ops_and_reference(seed, n, scale, field):
    _need_kernel()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.rand(n, generator=gen).pow(8) * scale
    if field == "exp_avg_sq":
        x = x.abs()
    specials = torch.randint(0, n, (n // 97,), generator=gen)
    x[specials] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0])[specials % 5]
    compiled = _encode(field, x, "fast")
    assert torch.equal(compiled, _encode(field, x, "torch"))
    assert torch.equal(compiled, _encode(field, x, "reference"))
    outs = []
    for impl in ("fast", "torch", "reference"):
        out = torch.empty(n)
        codecs.decode("int8", field, compiled, out, threads=1, impl=impl)
        outs.append(out.view(torch.int32))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_off_switch_uses_torch_ops(fresh, monkeypatch):
    monkeypatch.setenv("TIERSTORE_NATIVE", "0")
    assert codecs.native_kernel() is None
    assert native.status() == "torch ops (TIERSTORE_NATIVE=0)"
    x = torch.linspace(-1, 1, 1000)
    assert torch.equal(_encode("exp_avg", x, "fast"), _encode("exp_avg", x, "reference"))


def test_no_compiler_falls_back_and_require_raises(fresh, monkeypatch):
    monkeypatch.setattr(native, "_compiler", lambda: None)
    assert codecs.native_kernel() is None
    assert "no C compiler found" in native.status()
    native.reset()
    monkeypatch.setenv("TIERSTORE_NATIVE", "require")
    with pytest.raises(ConfigError, match="TIERSTORE_NATIVE=require.*no C compiler found"):
        codecs.native_kernel()


def test_a_failing_compiler_falls_back_with_its_message(fresh, monkeypatch):
    cc = fresh / "broken-cc"
    cc.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo broken 1.0; exit 0; fi\necho 'no luck' >&2\nexit 1\n")
    cc.chmod(cc.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("TIERSTORE_CC", str(cc))
    assert codecs.native_kernel() is None
    assert "building the compiled kernel failed" in native.status() and "no luck" in native.status()
    x = torch.rand(777)
    assert torch.equal(_encode("exp_avg_sq", x, "fast"), _encode("exp_avg_sq", x, "reference"))


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler on this machine")
@pytest.mark.parametrize(
    "good, bad, what",
    [
        # Decode doubles every value.
        (b"out[i] = values[c[i]] * s;", b"out[i] = values[c[i]] * s * 2.0f;", "decode of exp_avg"),
        # The packed encode stores its eight codes in reverse order (a big-endian packing).
        (b"<< (8 * j);", b"<< (8 * (7 - j));", "encode of exp_avg"),
    ],
)
def test_a_kernel_that_computes_wrong_bytes_is_refused(fresh, monkeypatch, caplog, good, bad, what):
    # A deliberately broken build must fail the load-time self-check.
    source = native._source()
    broken = source.replace(good, bad)
    assert broken != source
    monkeypatch.setattr(native, "_source", lambda: broken)
    with caplog.at_level(logging.WARNING, logger="tierstore._compute.native"):
        assert codecs.native_kernel() is None
    assert any(f"{what} differs" in r.getMessage() for r in caplog.records)
    assert native.part_status("int8 codec").startswith(what)
    assert native.library() is not None, "the library itself loaded"


def test_unknown_switch_value_is_a_config_error(fresh, monkeypatch):
    monkeypatch.setenv("TIERSTORE_NATIVE", "fastest")
    with pytest.raises(ConfigError, match="TIERSTORE_NATIVE='fastest' is unknown"):
        codecs.native_kernel()


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler on this machine")
def test_unusable_cache_directory_builds_in_a_temporary_one(fresh, monkeypatch):
    blocker = fresh / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TIERSTORE_CACHE_DIR", str(blocker / "cache"))  # cannot be created
    k = codecs.native_kernel()
    try:
        assert k is not None, native.status()
        assert not str(k.path).startswith(str(blocker))
    finally:
        if k is not None:
            shutil.rmtree(k.path.parent, ignore_errors=True)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler on this machine")
def test_a_failed_int8_codec_check_leaves_the_bfloat16_update_in_use(fresh, monkeypatch):
    # The review's defect: one failed check disabled every part of the library.
    broken = native._source().replace(b"*scale_out = scale;", b"*scale_out = scale * 2.0f;")
    assert broken != native._source()
    monkeypatch.setattr(native, "_source", lambda: broken)
    assert codecs.native_kernel() is None
    assert fused_update.kernel("int8") is None  # its encode writes the same wrong scales
    assert fused_update.kernel("bfloat16") is not None, fused_update.status("bfloat16")


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory) -> Path:
    """One real build of the current source for the module's tests (compiling takes seconds)."""
    if not HAVE_CC:
        pytest.skip("no C compiler on this machine")
    out = tmp_path_factory.mktemp("prebuilt") / "kernel.so"
    cc = native._compiler()
    subprocess.run([*cc, *native.FLAGS, f'-DTS_SOURCE_HASH="{native.source_hash(native._source())}"', "-o", str(out),
                    str(Path(native.__file__).with_name("codec_kernel.c")), *native.LIBS], check=True, timeout=120)
    return out


@pytest.fixture
def copying_cc(prebuilt, fresh, monkeypatch) -> Path:
    """TIERSTORE_CC set to a 'compiler' that copies the prebuilt library to its ``-o`` (for tests of what
    is loaded from where, not of compiling); each run appends a line to ``fresh / "compiles.log"``."""
    cc = fresh / "copying-cc"
    cc.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        if [ "$1" = --version ]; then echo copying-cc 1.0; exit 0; fi
        echo "$$" >> {fresh / "compiles.log"}
        sleep "${{COPY_CC_SLEEP:-0}}"
        while [ $# -gt 0 ]; do if [ "$1" = -o ]; then cp {prebuilt} "$2"; exit 0; fi; shift; done
        exit 1
        """))
    cc.chmod(0o755)
    monkeypatch.setenv("TIERSTORE_CC", str(cc))
    return cc


def _planted_library(fresh: Path) -> tuple[Path, Path]:
    """The path the first-use build of the current source would load, holding a copy of a good build."""
    built = native._compile(native._compiler(), native._source())  # through the copying compiler
    good = fresh / "good.so"
    shutil.copy(built, good)
    shutil.rmtree(fresh / "cache")
    (fresh / "cache").mkdir(mode=0o700)
    return good, fresh / "cache" / built.name


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler on this machine")
@pytest.mark.parametrize("how", ["group-writable", "symlink", "other owner", "directory"])
def test_a_planted_library_is_never_loaded(fresh, copying_cc, monkeypatch, caplog, how):
    good, target = _planted_library(fresh)
    elsewhere = fresh / "elsewhere.so"
    shutil.copy(good, elsewhere)
    if how == "group-writable":
        shutil.copy(good, target)
        target.chmod(0o775)
    elif how == "symlink":
        target.symlink_to(elsewhere)
    elif how == "other owner":
        if os.getuid() != 0:
            pytest.skip("needs root to give a file another owner")
        shutil.copy(good, target)
        os.chown(target, 4242, -1)
    else:
        target.mkdir()
        (target / "x").write_text("")
    loaded = []
    real = native._open
    monkeypatch.setattr(native, "_open", lambda path, source: (loaded.append(path), real(path, source))[1])
    with caplog.at_level(logging.WARNING, logger="tierstore._compute.native"):
        k = native.library()
    if how == "directory":  # cannot be replaced by a file: the build fails, nothing planted is loaded
        assert k is None and "building the compiled kernel failed" in native.status()
        assert loaded == []
        return
    assert k is not None, native.status()
    assert loaded == [target]
    st = os.lstat(target)
    assert stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022, "rebuilt in place"
    assert any("rebuilding" in r.getMessage() for r in caplog.records)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler on this machine")
@pytest.mark.parametrize("how", ["group-writable", "other owner", "symlink"])
def test_an_unsafe_cache_directory_is_not_used(fresh, copying_cc, monkeypatch, caplog, how):
    cache = fresh / "cache"
    if how == "symlink":
        (fresh / "real").mkdir(mode=0o700)
        cache.symlink_to(fresh / "real")
    else:
        cache.mkdir(mode=0o700)
        if how == "group-writable":
            cache.chmod(0o770)
        elif os.getuid() != 0:
            pytest.skip("needs root to give a directory another owner")
        else:
            os.chown(cache, 4242, -1)
    with caplog.at_level(logging.WARNING, logger="tierstore._compute.native"):
        k = native.library()
    try:
        assert k is not None, native.status()
        assert cache not in k.path.parents and fresh / "real" not in k.path.parents
        assert any(str(cache) in r.getMessage() for r in caplog.records)
    finally:
        if k is not None:
            shutil.rmtree(k.path.parent, ignore_errors=True)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler on this machine")
def test_two_processes_starting_at_once_build_once(fresh, copying_cc):
    """TIERSTORE_CC names the compiler (here one that logs each build and takes a second); the build lock
    lets one process build while the other waits, then finds that build."""
    env = {**os.environ, "TIERSTORE_CACHE_DIR": str(fresh / "cache"), "COPY_CC_SLEEP": "1"}
    code = ("from tierstore import native; native.installed_path = lambda: None; "
            "k = native.library(); print(k is not None, k.path if k else native.status())")
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert all(o[0] == "True" for o in outs), outs
    assert outs[0][1] == outs[1][1], "both loaded the same library"
    assert len((fresh / "compiles.log").read_text().split()) == 1, "the kernel was built more than once"


def test_tierstore_cc_that_is_not_found_is_reported_not_replaced(fresh, monkeypatch):
    monkeypatch.setenv("TIERSTORE_CC", str(fresh / "no-such-cc"))
    assert native.library() is None
    assert "TIERSTORE_CC=" in native.status() and "no-such-cc" in native.status() and "not found" in native.status()
    native.reset()
    monkeypatch.setenv("TIERSTORE_NATIVE", "require")
    with pytest.raises(ConfigError, match="TIERSTORE_CC=.*no-such-cc.*not found"):
        native.library()


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler on this machine")
def test_the_library_built_at_install_is_used_and_a_stale_one_is_not(fresh, prebuilt, monkeypatch):
    good = prebuilt
    stale = native._compile(native._compiler(), native._source() + b"\n/* another version */\n")
    (fresh / "pkg").mkdir()
    installed = {}
    for name, built in (("good", good), ("stale", stale), ("writable", good)):
        # A new file each (overwriting a loaded library in place would crash this process).
        installed[name] = fresh / "pkg" / f"{name}.so"
        shutil.copy(built, installed[name])
    installed["writable"].chmod(0o666)
    shutil.rmtree(fresh / "cache")
    monkeypatch.setattr(native, "installed_path", lambda: installed["good"])
    k = native.library()
    assert k is not None and k.path == installed["good"] and "built at install" in native.status()
    assert not (fresh / "cache").exists(), "nothing was built"
    # A library from another version of the source (an in-place build left from an older checkout),
    # and a group-writable one: neither is loaded, the first-use build runs instead.
    monkeypatch.setenv("TIERSTORE_CC", str(fresh / "copying-cc"))  # the fallback build: a copy of `good`
    (fresh / "copying-cc").write_text(f"#!/bin/sh\n[ \"$1\" = --version ] && exit 0\n"
                                      f"while [ $# -gt 1 ]; do [ \"$1\" = -o ] && exec cp {good} \"$2\"; shift; done\n")
    (fresh / "copying-cc").chmod(0o755)
    for name in ("stale", "writable"):
        monkeypatch.setattr(native, "installed_path", lambda n=name: installed[n])
        native.reset()
        k = native.library()
        assert k is not None and k.path.parent == fresh / "cache" and "built on first use" in native.status(), name


def test_nothing_is_built_on_import_help_or_version(tmp_path):
    env = {**os.environ, "TIERSTORE_CACHE_DIR": str(tmp_path / "cache")}
    code = textwrap.dedent("""
        import contextlib, io, tierstore
        from tierstore import cli
        from tierstore._compute import fused_update, native
        assert native.status() == "undecided", native.status()
        assert fused_update.status(decide=False) == "undecided"
        for args in (["--version"], ["--help"], ["inspect", "--help"], ["verify", "--help"]):
            with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
                cli.main(args)
        assert native.status() == "undecided", native.status()
        """)
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    assert not (tmp_path / "cache").exists()


def _libasan() -> str | None:
    cc = native._compiler()
    if cc is None or "gcc" not in Path(cc[0]).name and Path(cc[0]).name != "cc":
        return None
    found = subprocess.run([cc[0], "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    return found if found and Path(found).is_file() else None


ASAN_CHILD = """
import sys, torch
from tierstore import TieredAdamW
from tierstore._compute import codecs, fused_update, native
native.installed_path = lambda: None
src = native._source()
if len(sys.argv) > 1:  # the deliberately broken build: one element written past the decode's output
    good = b"for (int64_t i = 0; i < len; ++i) out[i] = values[c[i]] * s;"
    assert src.count(good) == 1
    src = src.replace(good, good.replace(b"i < len", b"i <= len"))
    native._source = lambda: src
assert codecs.native_kernel() is not None, native.status()
assert fused_update.status() == "fused kernel", fused_update.status()
gen = torch.Generator().manual_seed(0)
for fmt in ("int8", "bfloat16"):
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen).to(torch.bfloat16)) for s in ((37, 29), (1001,), (5,))]
    with TieredAdamW(ps, lr=1e-2, amsgrad=True, moment_dtype=fmt, ram_budget="96KiB") as opt:
        for _ in range(3):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
            opt.step()
print("clean")
"""


@pytest.mark.slow
@pytest.mark.skipif(_libasan() is None, reason="needs gcc with AddressSanitizer (libasan)")
@pytest.mark.parametrize("broken", [False, True])
def test_the_kernel_is_clean_under_address_sanitizer(tmp_path, broken):
    """The kernel built with -fsanitize=address runs its self-checks and streamed steps without a report;
    the same build with one out-of-bounds write is caught (so the check can fail)."""
    env = {**os.environ, "TIERSTORE_CC": f"{native._compiler()[0]} -fsanitize=address -fno-omit-frame-pointer",
           "TIERSTORE_CACHE_DIR": str(tmp_path / "cache"), "LD_PRELOAD": _libasan(),
           "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0", "TIERSTORE_NATIVE": "require"}
    done = subprocess.run([sys.executable, "-c", ASAN_CHILD, *(["broken"] if broken else [])], env=env,
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    if broken:
        assert done.returncode != 0 and "AddressSanitizer: heap-buffer-overflow" in done.stderr, done.stderr[-2000:]
    else:
        assert done.returncode == 0 and "AddressSanitizer" not in done.stderr, done.stderr[-3000:]
        assert done.stdout.strip().endswith("clean")


# -- the library's name: a hash of source, compiler and flags ------------------------------------


def _fake_cc(path: Path, version: str) -> list[str]:
    """A 'compiler' that only answers ``--version`` (build_tag runs nothing else)."""
    path.write_text(f"#!/bin/sh\necho '{version}'\necho 'second line, ignored'\n")
    path.chmod(0o755)
    return [str(path)]


def test_the_library_name_changes_with_the_compiler_its_version_and_the_flags(tmp_path, monkeypatch):
    source = native._source()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    cc = _fake_cc(tmp_path / "a" / "cc", "cc (Fake) 12.2.0")
    tag = native.build_tag(cc, source)
    assert len(tag) == 16 and int(tag, 16) >= 0
    assert native.build_tag(cc, source) == tag, "the same inputs must name the same library"
    assert native.build_tag(list(cc), bytes(source)) == tag
    other_path = _fake_cc(tmp_path / "b" / "cc", "cc (Fake) 12.2.0")  # same version, another compiler
    assert native.build_tag(other_path, source) != tag
    assert native.build_tag([*cc, "-m32"], source) != tag  # the command line is the compiler too
    _fake_cc(tmp_path / "a" / "cc", "cc (Fake) 12.3.0")  # upgraded in place: same path, new version
    assert native.build_tag(cc, source) != tag
    _fake_cc(tmp_path / "a" / "cc", "cc (Fake) 12.2.0")
    assert native.build_tag(cc, source) == tag, "back to the first compiler: its name again"
    monkeypatch.setattr(native, "FLAGS", (*native.FLAGS, "-ffast-math"))
    assert native.build_tag(cc, source) != tag
    monkeypatch.undo()
    assert native.build_tag(cc, source + b"\n") != tag


# -- the library built at install: who may have written it --------------------------------------


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler on this machine")
@pytest.mark.parametrize("how", ["other owner", "group-writable", "other-writable"])
def test_an_installed_library_another_user_could_have_written_is_not_loaded(fresh, prebuilt, copying_cc, monkeypatch,
                                                                             how):  # fmt: skip
    (fresh / "pkg").mkdir()
    planted = fresh / "pkg" / "_codec_kernel.so"
    shutil.copy(prebuilt, planted)  # the real kernel: only its owner and mode make it unsafe
    planted.chmod(0o755)
    if how == "other owner":
        if os.getuid() != 0:
            pytest.skip("needs root to give a file another owner")
        os.chown(planted, 1, -1)  # uid 1 (daemon): neither this user nor root
    elif how == "group-writable":
        planted.chmod(0o775)
    else:
        planted.chmod(0o757)
    monkeypatch.setattr(native, "installed_path", lambda: planted)
    loaded = []
    real = native._open
    monkeypatch.setattr(native, "_open", lambda path, source: (loaded.append(path), real(path, source))[1])
    k = native.library()
    assert planted not in loaded, f"the installed library ({how}) was loaded"
    assert k is not None and k.path.parent == fresh / "cache" and "built on first use" in native.status(), native.status()


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler on this machine")
def test_where_a_compiler_is_present_the_install_built_the_library_and_it_is_used(tmp_path):
    """pip install (setup.py's optional extension) built the kernel here, and a fresh process loads that
    build without compiling anything (a process of its own: the other tests' ``fresh`` hides the install)."""
    assert native.installed_path() is not None, (
        "a C compiler is on this machine but the package holds no tierstore/_compute/_codec_kernel*.so: the "
        "install did not build it (reinstall with `pip install -e .` and read its output)"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERSTORE_")}
    env["TIERSTORE_CACHE_DIR"] = str(tmp_path / "cache")
    code = "from tierstore._compute import native; k = native.library(); print(native.status())"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    status = done.stdout.strip()
    assert status.startswith(f"compiled kernel {native.installed_path()} (built at install"), status
    assert not (tmp_path / "cache").exists(), "a first-use build ran although the install built the kernel"
