"""The on-disk kernel cache, on the CPU: keying, reuse by a fresh process, corrupt entries,
concurrent writers. Kernels are compiled for sm_90a without a GPU (marker `sass`)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cute_flash import disk_cache

REPO = Path(__file__).resolve().parent.parent

# Compiles (or loads) one forward kernel and prints how many kernels this process compiled.
CHILD = textwrap.dedent("""
    import json, sys
    from cute_flash import compile_cache
    from cute_flash.config import TileConfig
    job = json.loads(sys.argv[1])
    fn = compile_cache.get_forward(job["dtype"], 64, job["causal"], TileConfig(**job["config"]))
    print(json.dumps({"compiled": compile_cache.compile_count, "type": type(fn).__name__,
                      "dsl_imported": "cutlass" in sys.modules}))
""")
CONFIG = dict(block_m=192, block_n=128, num_stages=2, num_mma_warpgroups=3, intra_wg_overlap=True,
              pingpong=True, mma_pv_from_registers=True, persistent=False)


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


@pytest.mark.sass
def test_fresh_process_loads_instead_of_compiling(tmp_path):
    first, _ = child(tmp_path)
    assert first["compiled"] == 1 and len(entries(tmp_path)) == 1
    second, _ = child(tmp_path)
    assert second["compiled"] == 0, "a warm cache must not recompile"
    assert second["type"] == "Function"  # the TVM-FFI function


@pytest.mark.sass
@needs_cc
def test_warm_process_does_not_import_the_dsl(tmp_path):
    child(tmp_path)
    assert len(entries(tmp_path, ".so")) == 1, "no shared library linked beside the object file"
    warm, _ = child(tmp_path)
    assert warm["compiled"] == 0 and warm["type"] == "Function"
    assert not warm["dsl_imported"], "loading a cached kernel imported the CuTe DSL"


@pytest.mark.sass
@needs_cc
@pytest.mark.parametrize("damage", ["truncate", "garble"])
def test_broken_shared_library_falls_back_to_the_object_file_and_is_relinked(tmp_path, damage):
    child(tmp_path)
    (library,) = entries(tmp_path, ".so")
    data = library.read_bytes()
    library.write_bytes(data[: len(data) // 2] if damage == "truncate" else data[:64] + b"\xff" * 64 + data[128:])
    fallback, err = child(tmp_path)
    assert fallback["compiled"] == 0 and fallback["dsl_imported"] and "discarding broken cache entry" in err
    (relinked,) = entries(tmp_path, ".so")
    assert relinked.read_bytes() == data
    assert not child(tmp_path)[0]["dsl_imported"]


@pytest.mark.sass
def test_every_key_field_separates_entries(tmp_path):
    child(tmp_path)
    child(tmp_path, causal=True)
    child(tmp_path, dtype="bfloat16")
    child(tmp_path, config=dict(CONFIG, num_stages=1))
    assert len(entries(tmp_path)) == 4
    again, _ = child(tmp_path, causal=True)
    assert again["compiled"] == 0


@pytest.mark.sass
@pytest.mark.parametrize("damage", ["truncate", "garble", "empty"])
def test_corrupt_entry_is_detected_and_rebuilt(tmp_path, damage):
    child(tmp_path)
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
    from cute_flash import compile_bwd
    from cute_flash.config import BackwardTileConfig
    job = json.loads(sys.argv[1])
    fns = compile_bwd.get_backward("float16", 64, job["causal"], BackwardTileConfig(**job["config"]))
    print(json.dumps({"compiled": compile_bwd.compile_count, "types": [type(f).__name__ for f in fns]}))
""")
BWD_CONFIG = dict(block_m=64, block_n=128, num_stages=2, num_stages_pds=2, num_mma_warpgroups=2, dq_atom_m=1,
                  mma_dkv_from_registers=True, dq_writer_warp=True)


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
    # The atomics path's row-major dq_accum needs its own postprocess.
    atomics = child_bwd(tmp_path, config=dict(BWD_CONFIG, dq_writer_warp=False))
    assert atomics["compiled"] == 2 and len(entries(tmp_path)) == 6


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


def test_key_hash_is_stable_and_distinguishes_values():
    from cute_flash.config import TileConfig

    a = ("fwd", "float16", 64, False, TileConfig(**CONFIG), "sm_90a", 132)
    b = ("fwd", "float16", 64, False, TileConfig(**dict(CONFIG, pingpong=False)), "sm_90a", 132)
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
