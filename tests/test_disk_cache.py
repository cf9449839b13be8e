"""The on-disk kernel cache, on the CPU: keying, reuse by a fresh process, corrupt entries,
concurrent writers. Kernels are compiled for sm_90a without a GPU (marker `sass`)."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from cute_flash import disk_cache

REPO = Path(__file__).resolve().parent.parent

# Compiles (or loads) one forward kernel and prints how many kernels this process compiled.
CHILD = textwrap.dedent("""
    import json, sys
    from cute_flash import compile_cache, compile_fwd
    from cute_flash.config import TileConfig
    from cute_flash.kernels.problem import AttentionProblem
    job = json.loads(sys.argv[1])
    problem = AttentionProblem.of(job["causal"])
    fn = compile_fwd.get_forward(job["dtype"], 64, problem, TileConfig(**job["config"]))
    print(json.dumps({"compiled": compile_cache.compile_count, "type": type(fn).__name__,
                      "dsl_imported": "cutlass" in sys.modules}))
""")
CONFIG = dict(block_m=192, block_n=128, num_stages=2, num_mma_warpgroups=3, pingpong=True)


def child(cache_dir, dtype="float16", causal=False, config=CONFIG, wait=True):
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_FLASH_CACHE_DIR=str(cache_dir), CUTE_FLASH_DISK_CACHE="1")
    job = json.dumps(dict(dtype=dtype, causal=causal, config=config))
    proc = subprocess.Popen([sys.executable, "-c", CHILD, job], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if not wait:
        return proc
    return finish(proc)


def finish(proc):
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1]), err


def entries(cache_dir, suffix=".o"):
    return sorted(p for p in Path(cache_dir).glob(f"*/*{suffix}"))


needs_cc = pytest.mark.skipif(disk_cache._compiler() is None, reason="no C compiler (cc) to link shared libraries")


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory):
    """A cache directory holding CONFIG's kernel, compiled once per module (and test worker):
    the tests that damage or reload an entry start from a copy of it (`seed`) instead of
    compiling it again."""
    root = tmp_path_factory.mktemp("warm_cache")
    first, _ = child(root)
    assert first["compiled"] == 1
    return root


def seed(cache_dir, warm_cache):
    """cache_dir as warm_cache left it (modes kept: the cache refuses entries others may write)."""
    shutil.copytree(warm_cache, cache_dir, dirs_exist_ok=True)


@pytest.mark.sass
def test_fresh_process_loads_instead_of_compiling(tmp_path):
    first, _ = child(tmp_path)
    assert first["compiled"] == 1 and len(entries(tmp_path)) == 1
    second, _ = child(tmp_path)
    assert second["compiled"] == 0, "a warm cache must not recompile"
    assert second["type"] == "Function"  # the TVM-FFI function


@pytest.mark.sass
@needs_cc
def test_warm_process_does_not_import_the_dsl(tmp_path, warm_cache):
    seed(tmp_path, warm_cache)
    assert len(entries(tmp_path, ".so")) == 1, "no shared library linked beside the object file"
    warm, _ = child(tmp_path)
    assert warm["compiled"] == 0 and warm["type"] == "Function"
    assert not warm["dsl_imported"], "loading a cached kernel imported the CuTe DSL"


@pytest.mark.sass
@needs_cc
@pytest.mark.parametrize("damage", ["truncate", "garble"])
def test_broken_shared_library_falls_back_to_the_object_file_and_is_relinked(tmp_path, damage, warm_cache):
    seed(tmp_path, warm_cache)
    (library,) = entries(tmp_path, ".so")
    data = library.read_bytes()
    library.write_bytes(data[: len(data) // 2] if damage == "truncate" else data[:64] + b"\xff" * 64 + data[128:])
    fallback, err = child(tmp_path)
    assert fallback["compiled"] == 0 and fallback["dsl_imported"] and "discarding broken cache entry" in err
    (relinked,) = entries(tmp_path, ".so")
    assert relinked.read_bytes() == data
    assert not child(tmp_path)[0]["dsl_imported"]


@pytest.mark.sass
def test_every_key_field_separates_entries(tmp_path, warm_cache):
    seed(tmp_path, warm_cache)
    child(tmp_path, causal=True)
    child(tmp_path, dtype="bfloat16")
    child(tmp_path, config=dict(CONFIG, num_stages=1))
    assert len(entries(tmp_path)) == 4
    again, _ = child(tmp_path, causal=True)
    assert again["compiled"] == 0


@pytest.mark.sass
@pytest.mark.parametrize("damage", ["truncate", "garble", "empty"])
def test_corrupt_entry_is_detected_and_rebuilt(tmp_path, damage, warm_cache):
    seed(tmp_path, warm_cache)
    for library in entries(tmp_path, ".so"):
        library.unlink()  # the object file is what is loaded without one
    (entry,) = entries(tmp_path)
    data = entry.read_bytes()
    entry.write_bytes({"truncate": data[: len(data) // 2], "garble": data[:100] + b"\0" * 64 + data[164:],
                       "empty": b""}[damage])
    rebuilt, err = child(tmp_path)
    assert rebuilt["compiled"] == 1 and "discarding broken cache entry" in err
    (fresh,) = entries(tmp_path)
    assert fresh.read_bytes() == data  # the rebuilt entry is whole again
    assert child(tmp_path)[0]["compiled"] == 0


@pytest.mark.sass
def test_concurrent_writers_leave_one_valid_entry(tmp_path):
    procs = [child(tmp_path, wait=False) for _ in range(2)]
    results = [finish(p)[0] for p in procs]
    assert all(r["compiled"] in (0, 1) for r in results)
    (entry,) = entries(tmp_path)
    assert len(entries(tmp_path, ".so")) <= 1
    assert not list(Path(tmp_path).glob("*/.tmp-*")), "temporary files left behind"
    assert child(tmp_path)[0]["compiled"] == 0


# The backward's three kernels through compile_bwd.get_backward.
CHILD_BWD = textwrap.dedent("""
    import json, sys
    from cute_flash import compile_bwd, compile_cache
    from cute_flash.config import BackwardTileConfig
    from cute_flash.kernels.problem import AttentionProblem
    job = json.loads(sys.argv[1])
    problem = AttentionProblem.of(job["causal"])
    fns = compile_bwd.get_backward("float16", 64, problem, BackwardTileConfig(**job["config"]))
    print(json.dumps({"compiled": compile_cache.compile_count, "types": [type(f).__name__ for f in fns]}))
""")
BWD_CONFIG = dict(block_m=64, block_n=128, num_stages=2, num_stages_do=2, num_stages_pds=2, num_mma_warpgroups=2, dq_atom_m=1)


def child_bwd(cache_dir, causal=False, config=BWD_CONFIG):
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_FLASH_CACHE_DIR=str(cache_dir), CUTE_FLASH_DISK_CACHE="1")
    job = json.dumps(dict(causal=causal, config=config))
    proc = subprocess.run([sys.executable, "-c", CHILD_BWD, job], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.sass
def test_backward_kernels_are_cached_on_disk(tmp_path):
    first = child_bwd(tmp_path)
    assert first["compiled"] == 3 and len(entries(tmp_path)) == 3
    again = child_bwd(tmp_path)
    assert again["compiled"] == 0, "a warm cache must not recompile the backward"
    assert again["types"] == ["Function"] * 3
    # Another main-kernel config with the same dq_accum layout shares the pre- and postprocess.
    other = child_bwd(tmp_path, causal=True)
    assert other["compiled"] == 1 and len(entries(tmp_path)) == 4
    # Another dQ fragment order (dQ GEMM split over query rows) needs its own postprocess.
    rows = child_bwd(tmp_path, config=dict(BWD_CONFIG, block_m=128, dq_atom_m=2))
    assert rows["compiled"] == 2 and len(entries(tmp_path)) == 6


def test_fingerprint_covers_kernel_sources_and_versions(tmp_path, monkeypatch):
    base = disk_cache.fingerprint()
    assert base == disk_cache.fingerprint()  # stable within a process
    fake = tmp_path / "pkg"
    (fake / "kernels").mkdir(parents=True)
    (fake / "kernels" / "k.py").write_text("A = 1\n")
    monkeypatch.setattr(disk_cache, "_PACKAGE", fake)
    disk_cache.fingerprint.cache_clear()
    one = disk_cache.fingerprint()
    (fake / "kernels" / "k.py").write_text("A = 2\n")
    disk_cache.fingerprint.cache_clear()
    assert disk_cache.fingerprint() != one  # an edited kernel is a new cache directory
    disk_cache.fingerprint.cache_clear()


def test_fingerprint_covers_every_module_that_builds_a_kernel():
    """A module that compiles kernels (its fake tensors are the kernel's signature) changes
    binaries without changing keys: its source must be in the fingerprint (compile_kvcache.py
    was not, and a cached merge kernel outlived a change of its LSE tensor's shape)."""
    package = Path(disk_cache.__file__).parent
    builders = [path for path in package.rglob("*.py") if "compile_kernel(" in path.read_text()]
    assert builders
    for path in builders:
        relative = path.relative_to(package)
        assert any(relative.match(pattern) for pattern in disk_cache._FINGERPRINT_SOURCES), relative


def test_key_hash_is_stable_and_distinguishes_values():
    from cute_flash.config import TileConfig

    a = ("fwd", "float16", 64, False, TileConfig(**CONFIG), "sm_90a")
    b = ("fwd", "float16", 64, False, TileConfig(**dict(CONFIG, pingpong=False)), "sm_90a")
    assert disk_cache.key_hash(a) == disk_cache.key_hash(a)
    assert disk_cache.key_hash(a) != disk_cache.key_hash(b)


def test_cache_dir_rules(tmp_path, monkeypatch):
    monkeypatch.setenv("CUTE_FLASH_CACHE_DIR", str(tmp_path / "x"))
    assert disk_cache.cache_root() == tmp_path / "x"
    monkeypatch.delenv("CUTE_FLASH_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert disk_cache.cache_root() == tmp_path / "cute_flash"
    monkeypatch.setenv("CUTE_FLASH_DISK_CACHE", "0")
    assert not disk_cache.enabled() and disk_cache.load(("any",)) is None


# Trust boundary (see disk_cache's docstring), on the CPU with a fake compiled object: the
# export writes known bytes, no C compiler links, and loading is replaced by a marker.
KEY = ("fwd", "float16", 64, False, "trust")


class FakeCompiled:
    def __init__(self, data=b"\x7fELF not really an object file"):
        self.data = data

    def export_to_c(self, object_file_path, function_name):
        Path(object_file_path).unlink()  # made anew, as an exporter may: under the umask
        Path(object_file_path).write_bytes(self.data)


def content_hash(data):
    import hashlib

    return hashlib.sha256(data).hexdigest()[:16]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh process's view of an empty cache at tmp_path/cache; loads return ("so" | "o", name)."""
    root = tmp_path / "cache"
    monkeypatch.setenv("CUTE_FLASH_CACHE_DIR", str(root))
    monkeypatch.setenv("CUTE_FLASH_DISK_CACHE", "1")
    monkeypatch.setattr(disk_cache, "_directory_decisions", {})
    monkeypatch.setattr(disk_cache, "_warned", False)
    monkeypatch.setattr(disk_cache, "_compiler", lambda: None)

    def fake_load(kind):
        def load(path):
            disk_cache._check_content(path)
            return kind, path.name
        return load

    monkeypatch.setattr(disk_cache, "_load_shared_library", fake_load("so"))
    monkeypatch.setattr(disk_cache, "_load_object_file", fake_load("o"))
    return root


def new_process(monkeypatch):
    """Forget the trust decisions and the warning, as a fresh process would."""
    monkeypatch.setattr(disk_cache, "_directory_decisions", {})
    monkeypatch.setattr(disk_cache, "_warned", False)


def cache_files(root):
    return sorted(p for p in Path(root).rglob("*") if not p.is_dir())


def refused(root, match):
    """load, store, load on a refused cache: nothing loaded or written, one warning naming why."""
    before = cache_files(root)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert disk_cache.load(KEY) is None
        assert disk_cache.store(KEY, FakeCompiled(b"another")) is None
        assert disk_cache.load(KEY) is None
    assert cache_files(root) == before
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert match in str(caught[0].message)


def test_trusted_cache_round_trips(cache):
    entry = disk_cache.store(KEY, FakeCompiled())
    assert entry is not None and entry.parent.parent == cache.resolve()
    assert disk_cache.load(KEY) == ("o", entry.name)


def test_directory_of_another_owner_is_refused(cache, monkeypatch):
    disk_cache.store(KEY, FakeCompiled())
    new_process(monkeypatch)
    monkeypatch.setattr(disk_cache, "_uid", lambda: os.geteuid() + 1234)
    refused(cache, f"owned by uid {os.geteuid()}, not you (uid {os.geteuid() + 1234})")


@pytest.mark.parametrize("which", ["root", "fingerprint"])
@pytest.mark.parametrize("mode", [0o770, 0o757], ids=["group", "others"])
def test_directory_writable_by_group_or_others_is_refused(cache, monkeypatch, which, mode):
    entry = disk_cache.store(KEY, FakeCompiled())
    new_process(monkeypatch)
    directory = cache if which == "root" else entry.parent
    directory.chmod(mode)
    refused(cache, f"{directory} is writable by group or others (mode {oct(mode)})")


def test_fresh_directories_are_private(tmp_path, cache, monkeypatch):
    root = tmp_path / "a" / "b" / "cache"
    monkeypatch.setenv("CUTE_FLASH_CACHE_DIR", str(root))
    old = os.umask(0o002)  # the loosest common umask: files and directories group-writable
    try:
        entry = disk_cache.store(KEY, FakeCompiled())
    finally:
        os.umask(old)
    for directory in (tmp_path / "a", tmp_path / "a" / "b", root, entry.parent):
        assert directory.stat().st_mode & 0o777 == 0o700, directory
    assert entry.stat().st_mode & 0o022 == 0
    new_process(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert disk_cache.load(KEY) == ("o", entry.name)  # its own entry passes the check


def test_fresh_directories_are_private_under_umask_022(cache):
    old = os.umask(0o022)
    try:
        entry = disk_cache.store(KEY, FakeCompiled())
    finally:
        os.umask(old)
    assert (cache.stat().st_mode & 0o777, entry.parent.stat().st_mode & 0o777) == (0o700, 0o700)


@pytest.mark.parametrize("suffix", [".so", ".o"])
def test_symlinked_entry_is_neither_loaded_nor_touched(tmp_path, cache, suffix):
    directory = disk_cache.store(("other key",), FakeCompiled()).parent
    data = b"native code from elsewhere"
    target = tmp_path / "outside"
    target.write_bytes(data)
    link = directory / f"{disk_cache.key_hash(KEY)}-{content_hash(data)}{suffix}"  # a valid name
    link.symlink_to(target)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert disk_cache.load(KEY) is None
        assert disk_cache.load(KEY) is None
    assert len(caught) == 1 and "is a symbolic link" in str(caught[0].message)
    assert target.read_bytes() == data and link.is_symlink()
    # A store of the same name replaces the link itself, never writing through it.
    if suffix == ".o":
        assert disk_cache.store(KEY, FakeCompiled(data)) == link
        assert not link.is_symlink() and target.read_bytes() == data


def test_entry_writable_by_others_is_skipped(cache):
    entry = disk_cache.store(KEY, FakeCompiled())
    entry.chmod(0o666)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert disk_cache.load(KEY) is None
    assert len(caught) == 1 and "writable by group or others (mode 0o666)" in str(caught[0].message)
    assert entry.exists()


def test_symlinked_fingerprint_directory_is_refused(tmp_path, cache, monkeypatch):
    entry = disk_cache.store(KEY, FakeCompiled())
    elsewhere = tmp_path / "elsewhere"
    entry.parent.rename(elsewhere)  # a private directory with a valid entry, out of the cache
    entry.parent.symlink_to(elsewhere)
    new_process(monkeypatch)
    refused(cache, f"{entry.parent} is a symbolic link")
    assert cache_files(elsewhere) == [elsewhere / entry.name]


def test_root_reached_through_a_symlink_is_used(tmp_path, cache, monkeypatch):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    monkeypatch.setenv("CUTE_FLASH_CACHE_DIR", str(link))
    entry = disk_cache.store(KEY, FakeCompiled())
    assert entry.parent.parent == real.resolve()
    new_process(monkeypatch)
    assert disk_cache.load(KEY) == ("o", entry.name)
    real.chmod(0o777)  # and the resolved directory is the one checked
    new_process(monkeypatch)
    refused(real, f"{real} is writable by group or others")


# The modules a call goes through before it loads its kernels (eager entry points, the custom
# ops and SDPA's route, the plans, the config and the grid model): none imports the DSL, so that
# a process whose kernels are all cached never does.
HOST_PATH = textwrap.dedent("""
    import sys
    import cute_flash
    from cute_flash import (api, compile_bwd, compile_fwd, config, float32, grid_makespan, kvcache, kvcache_plan,
                            launch_bwd, launch_fwd, op, sdpa, varlen, varlen_plan)
    from cute_flash.kernels.problem import AttentionProblem
    table = config.load_config_file(config.default_config_dir() / "h100.yaml")
    for head_dim in (64, 96, 128):
        entry = table.lookup("bfloat16", head_dim, True, "fwd", seqlen=8192)
        config.grid_fitted(entry, AttentionProblem.of(True), 2, 8, 4096, 4096, 4 * head_dim, 132)
    float32.value_chunks("float32x3h", 256)
    print("cutlass" in sys.modules)
""")


def test_the_host_path_imports_no_dsl():
    """Before the fifty-first session launch_fwd imported the DSL through float32 (VALUE_CHUNK from
    a kernel module) and a causal grid_fitted through the tile scheduler (L2_SECTION_BYTES): about
    a second (up to 3.6 s on the H100 machine) on every process's first call."""
    proc = subprocess.run([sys.executable, "-c", HOST_PATH], cwd=REPO, text=True, capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "False", "a host module imported the CuTe DSL"
