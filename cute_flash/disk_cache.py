"""Compiled kernels on disk, so that a fresh process does not compile again.

Layout: <cache dir>/<fingerprint>/<key hash>-<content hash>.o, one object file per compiled
kernel, exported by the CuTe DSL (`export_to_c`), and beside it, when a C compiler is on the
PATH ($CC, else cc), <key hash>-<content hash>.so: the same object linked into a shared
library against the DSL's runtime and TVM-FFI.

Loading prefers the shared library: `tvm_ffi.load_module` opens it without importing the
DSL, whose import alone takes seconds (~1 s here, 2.6-3.6 s on the H100 machine), so a
process whose kernels are all cached never imports it. Without the library (no compiler, or
a library that will not load) the object file is loaded through the DSL
(`cute.runtime.load_module`, TVM-FFI) and the library is linked then for the next process.

* The fingerprint hashes everything that changes a binary without being in the key: the
  source of the kernel package and the compile modules, the versions of the installed CuTe
  DSL and TVM-FFI distributions (read from their metadata, not by importing them) and the
  Python version. Editing a kernel or upgrading the DSL starts a new directory, so a
  stale binary is never loaded.
* The key (dtype, head dim, causal, tile config, arch, ...) picks the file inside it.
* A file is written to a temporary name and renamed into place (atomic on POSIX), and its
  name carries the hash of its content: a half-written, truncated or corrupted file fails
  the check (or the load), is deleted and the kernel is compiled again (a broken library
  falls back to its object file). Two processes that compile the same key write the same
  name; whichever rename lands last wins, both valid.

Directory: $CUTE_FLASH_CACHE_DIR, else $XDG_CACHE_HOME/cute_flash, else ~/.cache/cute_flash.
CUTE_FLASH_DISK_CACHE=0 turns it off.
"""

import ctypes
import functools
import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

EXPORTED_NAME = "kernel"
_PACKAGE = Path(__file__).resolve().parent
# Sources whose text shapes the generated code (the torch-side modules do not).
_FINGERPRINT_SOURCES = ("kernels/*.py", "compile_cache.py", "compile_bwd.py")
# Distributions whose version changes the generated code or the runtime it links against.
_FINGERPRINT_DISTRIBUTIONS = (
    "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-core",
    "nvidia-cutlass-dsl-libs-cu12", "nvidia-cutlass-dsl-libs-cu13", "apache-tvm-ffi",
)
# Loaded shared libraries stay open for the life of the process (their functions run code
# in them); keyed by path.
_loaded_libraries = {}


def enabled() -> bool:
    return os.environ.get("CUTE_FLASH_DISK_CACHE", "1") != "0"


def cache_root() -> Path:
    override = os.environ.get("CUTE_FLASH_CACHE_DIR")
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "cute_flash"


@functools.lru_cache(maxsize=1)
def fingerprint() -> str:
    digest = hashlib.sha256()
    digest.update(f"python {sys.version_info.major}.{sys.version_info.minor}\n".encode())
    for name in _FINGERPRINT_DISTRIBUTIONS:
        try:
            digest.update(f"{name} {importlib.metadata.version(name)}\n".encode())
        except importlib.metadata.PackageNotFoundError:
            pass
    for pattern in _FINGERPRINT_SOURCES:
        for path in sorted(_PACKAGE.glob(pattern)):
            digest.update(path.relative_to(_PACKAGE).as_posix().encode() + b"\n")
            digest.update(path.read_bytes())
    return digest.hexdigest()[:20]


def key_hash(key) -> str:
    """A stable hash of a key made of str/int/bool/tuples/dataclasses (repr is stable for
    these; objects without a value repr must not be put in a key)."""
    return hashlib.sha256(repr(key).encode()).hexdigest()[:32]


def _directory() -> Path:
    return cache_root() / fingerprint()


def _content_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def _load_runtime_libraries():
    """The DSL runtime must be loaded globally before a loaded module can launch kernels."""
    import cutlass.cute as cute

    for library in cute.runtime.find_runtime_libraries(enable_tvm_ffi=False):
        if Path(library).exists():
            ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)


def _check_content(path: Path) -> None:
    if _content_hash(path) != path.stem.rsplit("-", 1)[1]:
        raise ValueError("content does not match its hash")


def _discard(path: Path, exc: Exception) -> None:
    print(f"cute_flash: discarding broken cache entry {path} ({type(exc).__name__}: {exc})", file=sys.stderr)
    path.unlink(missing_ok=True)


def _load_shared_library(path: Path):
    """The exported function of a linked kernel library, opened without the DSL."""
    _check_content(path)
    import tvm_ffi

    module = _loaded_libraries.get(path)
    if module is None:
        module = _loaded_libraries[path] = tvm_ffi.load_module(str(path))
    return getattr(module, EXPORTED_NAME)


def load(key):
    """The compiled function stored for `key`, or None (missing, or found broken and removed)."""
    if not enabled():
        return None
    directory = _directory()
    name = key_hash(key)
    for path in sorted(directory.glob(f"{name}-*.so")):
        try:
            return _load_shared_library(path)
        except Exception as exc:  # the object file below is the fallback
            _discard(path, exc)
    for path in sorted(directory.glob(f"{name}-*.o")):
        try:
            _check_content(path)
            import cutlass.cute as cute

            _load_runtime_libraries()
            module = cute.runtime.load_module(str(path), enable_tvm_ffi=True)
            function = getattr(module, EXPORTED_NAME)
        except Exception as exc:  # a broken entry is rebuilt, never trusted
            _discard(path, exc)
            continue
        link_shared_library(path)
        return function
    return None


def _compiler():
    return shutil.which(os.environ.get("CC") or "cc")


def link_shared_library(object_path: Path) -> Path | None:
    """Link a cached object file into <key hash>-<content hash>.so beside it (atomically);
    returns the library, or None when there is no C compiler or linking failed (the object
    file keeps working; loading it just imports the DSL)."""
    compiler = _compiler()
    if compiler is None:
        return None
    import cutlass.cute as cute

    tmp = None
    try:
        libraries = [Path(p) for p in cute.runtime.find_runtime_libraries(enable_tvm_ffi=True)]
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".so", dir=object_path.parent)
        os.close(fd)
        command = [compiler, "-shared", "-o", tmp, str(object_path)]
        for library in libraries:
            # Linked by file name and found at run time through an rpath to its directory.
            command += [f"-L{library.parent}", f"-l:{library.name}", f"-Wl,-rpath,{library.parent}"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise OSError(f"{' '.join(command)} failed: {result.stderr.strip()[:500]}")
        final = object_path.parent / f"{object_path.stem.rsplit('-', 1)[0]}-{_content_hash(Path(tmp))}.so"
        os.replace(tmp, final)
        return final
    except Exception as exc:
        print(f"cute_flash: could not link {object_path} into a shared library ({type(exc).__name__}: {exc}); "
              "cached kernels will load through the CuTe DSL", file=sys.stderr)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        return None


def store(key, compiled) -> Path | None:
    """Export `compiled` for `key`; returns the file, or None if it could not be written
    (the in-process kernel still works; a warning says why)."""
    if not enabled():
        return None
    directory = _directory()
    tmp = None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".o", dir=directory)
        os.close(fd)
        compiled.export_to_c(object_file_path=tmp, function_name=EXPORTED_NAME)
        tmp_path = Path(tmp)
        if tmp_path.stat().st_size == 0:
            raise OSError("exported an empty object file")
        final = directory / f"{key_hash(key)}-{_content_hash(tmp_path)}.o"
        os.replace(tmp_path, final)
        link_shared_library(final)
        return final
    except Exception as exc:
        print(f"cute_flash: could not write the kernel cache in {directory} ({type(exc).__name__}: {exc})",
              file=sys.stderr)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        return None
