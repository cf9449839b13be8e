"""Compiled kernels on disk, so that a fresh process does not compile again.

Layout: <cache dir>/<fingerprint>/<key hash>-<content hash>.o, one object file per compiled
kernel, exported by the CuTe DSL (`export_to_c`) and loaded back with
`cute.runtime.load_module` (TVM-FFI).

* The fingerprint hashes everything that changes a binary without being in the key: the
  source of the kernel package and the compile modules, the CuTe DSL and TVM-FFI versions
  and the Python version. Editing a kernel or upgrading the DSL starts a new directory, so a
  stale binary is never loaded.
* The key (dtype, head dim, causal, tile config, arch, ...) picks the file inside it.
* A file is written to a temporary name and renamed into place (atomic on POSIX), and its
  name carries the hash of its content: a half-written, truncated or corrupted file fails
  the check (or the load), is deleted and the kernel is compiled again. Two processes that
  compile the same key write the same name; whichever rename lands last wins, both valid.

Directory: $CUTE_FLASH_CACHE_DIR, else $XDG_CACHE_HOME/cute_flash, else ~/.cache/cute_flash.
CUTE_FLASH_DISK_CACHE=0 turns it off.
"""

import ctypes
import functools
import hashlib
import os
import sys
import tempfile
from pathlib import Path

EXPORTED_NAME = "kernel"
_PACKAGE = Path(__file__).resolve().parent
# Sources whose text shapes the generated code (the torch-side modules do not).
_FINGERPRINT_SOURCES = ("kernels/*.py", "compile_cache.py", "compile_bwd.py")


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
    import cutlass

    digest = hashlib.sha256()
    digest.update(f"python {sys.version_info.major}.{sys.version_info.minor}\n".encode())
    digest.update(f"cutlass-dsl {cutlass.__version__}\n".encode())
    try:
        import tvm_ffi

        digest.update(f"tvm-ffi {tvm_ffi.__version__}\n".encode())
    except ImportError:
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


def load(key):
    """The compiled function stored for `key`, or None (missing, or found broken and removed)."""
    if not enabled():
        return None
    directory = _directory()
    name = key_hash(key)
    for path in sorted(directory.glob(f"{name}-*.o")):
        expected = path.stem.rsplit("-", 1)[1]
        try:
            if _content_hash(path) != expected:
                raise ValueError("content does not match its hash")
            import cutlass.cute as cute

            _load_runtime_libraries()
            module = cute.runtime.load_module(str(path), enable_tvm_ffi=True)
            return getattr(module, EXPORTED_NAME)
        except Exception as exc:  # a broken entry is rebuilt, never trusted
            print(f"cute_flash: discarding broken cache entry {path} ({type(exc).__name__}: {exc})",
                  file=sys.stderr)
            path.unlink(missing_ok=True)
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
        return final
    except Exception as exc:
        print(f"cute_flash: could not write the kernel cache in {directory} ({type(exc).__name__}: {exc})",
              file=sys.stderr)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        return None
