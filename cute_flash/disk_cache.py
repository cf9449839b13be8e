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
* The key (dtype, head dim, AttentionProblem, tile config, arch, ...) picks the file inside it.
* A file is written to a temporary name and renamed into place (atomic on POSIX), and its
  name carries the hash of its content: a half-written, truncated or corrupted file fails
  the check (or the load), is deleted and the kernel is compiled again (a broken library
  falls back to its object file). Two processes that compile the same key write the same
  name; whichever rename lands last wins, both valid.

Directory: $CUTE_FLASH_CACHE_DIR, else $XDG_CACHE_HOME/cute_flash, else ~/.cache/cute_flash.
CUTE_FLASH_DISK_CACHE=0 turns it off.

Trust: loading an entry runs its native code in this process, so whoever can write the
cache can run code as you. The cache is used only where it is yours alone:
* The root may be reached through symbolic links the user set up (e.g. $CUTE_FLASH_CACHE_DIR
  naming a link to scratch space): it is resolved once (realpath) and the resolved directory
  is checked. Below it no link is followed: a fingerprint directory that is a link is refused,
  an entry (.o, .so) that is a link is ignored (neither loaded nor deleted; what it points to is
  never read or touched). Entries are read with O_NOFOLLOW.
* The root and the fingerprint directory must be directories owned by you (the effective uid)
  and not writable by group or others. Otherwise the cache warns once per process (naming the
  directory and the reason) and acts as if it were off: nothing is loaded or written, kernels
  compile in memory. The decision is kept per directory for the process. An entry file must
  likewise be a regular file of yours, not group/other-writable, or it is skipped (same warning).
* Directories the cache creates (the root, any missing parent of it, the fingerprint
  directory) are made with mode 0o700. Caches made before this rule under a umask of 0o002
  are group-writable and refused: `chmod 700` them (or delete them).
Directories above the root are not checked.
"""

import ctypes
import functools
import hashlib
import importlib.metadata
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

EXPORTED_NAME = "kernel"
_PACKAGE = Path(__file__).resolve().parent
# Sources whose text shapes the generated code (the torch-side modules do not).
_FINGERPRINT_SOURCES = ("kernels/*.py", "compile_*.py")
# Distributions whose version changes the generated code or the runtime it links against.
_FINGERPRINT_DISTRIBUTIONS = (
    "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-core",
    "nvidia-cutlass-dsl-libs-cu12", "nvidia-cutlass-dsl-libs-cu13", "apache-tvm-ffi",
)
# Loaded shared libraries stay open for the life of the process (their functions run code
# in them); keyed by path.
_loaded_libraries = {}
# Trust decisions for the cache directories (see the module docstring), keyed by path: the
# reason a directory is refused, or None. A refusal is warned about once per process.
_directory_decisions = {}
_warned = False


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


def _uid() -> int:
    return os.geteuid()


def _untrusted(path: Path, directory: bool) -> str | None:
    """Why `path` (a cache directory, or an entry file) must not be used, or None when it may:
    it must not be a symbolic link (lstat: it is not followed), must be a directory / regular
    file, owned by you and not writable by group or others. Raises OSError where it cannot
    be lstat'ed (missing)."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link (the cache follows none below its root)"
    if directory and not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if not directory and not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    uid = _uid()
    if st.st_uid != uid:
        return f"is owned by uid {st.st_uid}, not you (uid {uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by group or others (mode {oct(stat.S_IMODE(st.st_mode))})"
    return None


def _refuse(path: Path, reason: str, consequence: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"cute_flash: {path} {reason}; {consequence} (the kernel cache loads native code, "
                      "so it must be yours and writable only by you: chmod 700 it, or remove it)", stacklevel=3)


def _make_private_directories(path: Path) -> None:
    """mkdir -p, each directory it creates with mode 0o700 (os.makedirs gives its mode to the
    leaf only; the umask can only take bits away)."""
    missing = []
    while not os.path.lexists(path) and path != path.parent:  # lexists: a link is not missing
        missing.append(path)
        path = path.parent
    for path in reversed(missing):
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:  # made meanwhile by another process: checked like any other
            pass


def _directory(create: bool = False) -> Path | None:
    """The fingerprint directory when it (and the root) may be trusted; None when it does not
    exist (create=False) or is refused (warned once). create=True makes the missing ones."""
    root = Path(os.path.realpath(cache_root()))  # the user's links to the root are followed, once
    directory = root / fingerprint()
    if create:
        _make_private_directories(directory)
    for path in (root, directory):
        key = str(path)
        if key not in _directory_decisions:
            try:
                _directory_decisions[key] = _untrusted(path, directory=True)
            except OSError:  # missing: nothing cached yet (not remembered: it may be made later)
                return None
        reason = _directory_decisions[key]
        if reason is not None:
            _refuse(path, reason, "not using the disk cache of compiled kernels (they compile in memory)")
            return None
    return directory


def cache_directory(create: bool = False) -> Path | None:
    """The directory this process's kernels are cached in (see _directory), for tools that
    fill or report on it (`python -m cute_flash precompile`)."""
    return _directory(create)


def _entry_trusted(path: Path) -> bool:
    try:
        reason = _untrusted(path, directory=False)
    except OSError:  # removed meanwhile
        return False
    if reason is not None:
        _refuse(path, reason, "ignoring this cache entry")
    return reason is None


def _content_hash(path: Path) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)  # never reads through a link
    with os.fdopen(fd, "rb") as file:
        return hashlib.sha256(file.read()).hexdigest()[:16]


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


def _load_object_file(path: Path):
    """The exported function of a cached object file, loaded through the DSL."""
    _check_content(path)
    import cutlass.cute as cute

    _load_runtime_libraries()
    module = cute.runtime.load_module(str(path), enable_tvm_ffi=True)
    return getattr(module, EXPORTED_NAME)


def load(key):
    """The compiled function stored for `key`, or None (missing, found broken and removed, or
    not trusted: see the module docstring)."""
    if not enabled():
        return None
    directory = _directory()
    if directory is None:
        return None
    name = key_hash(key)
    for path in sorted(directory.glob(f"{name}-*.so")):
        if not _entry_trusted(path):
            continue
        try:
            return _load_shared_library(path)
        except Exception as exc:  # the object file below is the fallback
            _discard(path, exc)
    for path in sorted(directory.glob(f"{name}-*.o")):
        if not _entry_trusted(path):
            continue
        try:
            function = _load_object_file(path)
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
        os.chmod(tmp, 0o700)  # the linker makes its output under the umask (0o002: group-writable, refused)
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
    """Export `compiled` for `key`; returns the file, or None if it could not be written, or
    the cache is not trusted (the in-process kernel still works; a warning says why)."""
    if not enabled():
        return None
    directory = cache_root() / fingerprint()  # named in the message if it cannot be made
    tmp = None
    try:
        directory = _directory(create=True)
        if directory is None:
            return None
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".o", dir=directory)
        os.close(fd)
        compiled.export_to_c(object_file_path=tmp, function_name=EXPORTED_NAME)
        os.chmod(tmp, 0o600)  # in case the export made the file anew, under the umask
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
