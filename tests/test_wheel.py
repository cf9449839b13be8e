"""The wheel, on the CPU: built from (a copy of) this checkout, installed non-editable into a
fresh venv, it carries the tile configs and the default case file and finds them at run time
from a directory outside the repository.

The fresh venv sees the outer environment's packages (torch, yaml, the DSL, ...) through a
.pth file that lists the outer interpreter's package directories (its sys.path less the
standard library and the checkout): .pth files inside a directory added that way are not
processed, so the outer editable install of cute_flash stays inactive (the tests check that
cute_flash is imported from the fresh venv)."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import venv
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
H100_NAME = "NVIDIA H100 80GB HBM3"
# Not copied for the build: VCS data, virtual environments, build outputs, and the parts of
# the checkout that are not packaged.
_NOT_COPIED = shutil.ignore_patterns(
    ".git", ".venv*", ".ci-venv", ".device", "build", "dist", "*.egg-info", "__pycache__",
    ".pytest_cache", ".hypothesis", "bench-out", "perf", "tests",
)


def _run(args, timeout=300, **kwargs):
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, **kwargs)


def _check(proc):
    assert proc.returncode == 0, f"{proc.args} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def _setuptools_major() -> int:
    try:
        return int(metadata.version("setuptools").split(".")[0])
    except (metadata.PackageNotFoundError, ValueError):
        return 0


def _outer_site_dirs() -> list:
    """Where this interpreter finds its packages: its sys.path directories (site-packages of a
    venv or the system, user site, directories added by .pth files), less the standard
    library and the checkout (PYTHONPATH=checkout on the GPU machine, pytest's tests/)."""
    stdlib = {Path(sysconfig.get_path(name)).resolve() for name in ("stdlib", "platstdlib")}
    dirs = []
    for entry in sys.path:
        path = Path(entry or ".").resolve()
        if not path.is_dir() or path in stdlib or (path.parent in stdlib and path.name == "lib-dynload"):
            continue
        if path.is_relative_to(REPO) and "site-packages" not in path.parts:
            continue
        dirs.append(str(path))
    return list(dict.fromkeys(dirs))


def _link_outer_packages(new_site: Path):
    """One .pth in the fresh venv naming the outer package directories: .pth files inside
    directories added this way are not processed, so no outer editable install activates."""
    (new_site / "_cute_flash_test_outer.pth").write_text("".join(f"{d}\n" for d in _outer_site_dirs()))


def _clean_env(**extra):
    """The environment for the fresh venv's processes: no PYTHONPATH (the GPU machine runs the
    tests with PYTHONPATH=checkout), no config override, no user site, no visible GPU."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "CUTE_FLASH_CONFIG_DIR")}
    env.update(PYTHONNOUSERSITE="1", CUDA_VISIBLE_DEVICES="", **extra)
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(wheel path, venv python, venv site-packages, a working directory outside the checkout)."""
    pytest.importorskip("pip")
    root = tmp_path_factory.mktemp("wheel")
    source = root / "src"
    shutil.copytree(REPO, source, ignore=_NOT_COPIED)  # builds write build/ and egg-info next to the sources
    wheelhouse = root / "wheelhouse"
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", wheelhouse, source]
    if _setuptools_major() >= 77:  # pyproject's build requirement is installed: build offline, faster
        build.insert(4, "--no-build-isolation")
        _check(_run(build, cwd=root))
    else:  # an isolated build fetches setuptools>=77 from the package index
        proc = _run(build, cwd=root, env=dict(os.environ, PIP_RETRIES="1", PIP_DEFAULT_TIMEOUT="20"))
        if proc.returncode != 0 and "No matching distribution found for setuptools" in proc.stderr:
            pytest.skip("building the wheel needs setuptools>=77: not installed here, and the package "
                        "index did not provide it")
        _check(proc)
    (wheel,) = wheelhouse.glob("cute_flash-*.whl")

    env_dir = root / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=os.name != "nt").create(env_dir)
    python = env_dir / "bin" / "python"
    new_site = Path(_check(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                env=_clean_env())).stdout.strip())
    # This interpreter's pip installs into the fresh venv (which has no pip of its own).
    _check(_run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--quiet", wheel],
                cwd=root, env=_clean_env()))
    _link_outer_packages(new_site)
    work = root / "elsewhere"
    work.mkdir()
    return wheel, python, new_site, work


def test_wheel_contains_configs_and_case_file(installed):
    wheel, *_ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    # pyproject lists the packages explicitly: a new subpackage must be added there.
    for module in sorted((REPO / "cute_flash").rglob("*.py")):
        assert module.relative_to(REPO).as_posix() in names
    for yaml_file in sorted((REPO / "configs").glob("*.yaml")):
        assert f"cute_flash/configs/{yaml_file.name}" in names
    assert "cute_flash/cases/test.txt" in names
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names)


def test_installed_package_finds_its_packaged_data(installed):
    _, python, new_site, work = installed
    probe = textwrap.dedent(f"""
        import json
        import sys
        from importlib import metadata
        import cute_flash
        from cute_flash.config import config_path_for_device, default_config_dir, load_config_file
        from cute_flash.test_cases import DEFAULT_CASES, load_cases

        path = config_path_for_device({H100_NAME!r}, (9, 0))
        print(json.dumps(dict(
            module=cute_flash.__file__, version=cute_flash.__version__,
            finders=[getattr(f, "__name__", type(f).__name__) for f in sys.meta_path],
            dist_version=metadata.version("cute-flash"),
            license=metadata.metadata("cute-flash")["License-Expression"],
            config_dir=str(default_config_dir()), config=str(path),
            entries=len(load_config_file(path).entries),
            cases=str(DEFAULT_CASES), shapes=[c.shape for c in load_cases()],
        )))
    """)
    found = json.loads(_check(_run([python, "-c", probe], cwd=work, env=_clean_env())).stdout.splitlines()[-1])
    package = (new_site / "cute_flash").resolve()
    # Imported from the wheel install, not from the checkout (outer editable install, PYTHONPATH).
    assert Path(found["module"]).resolve() == package / "__init__.py"
    assert not [f for f in found["finders"] if "Editable" in f]

    from cute_flash._version import __version__
    from cute_flash.config import load_config_file
    from cute_flash.test_cases import load_cases

    assert found["version"] == found["dist_version"] == __version__
    assert found["license"] == "BSD-3-Clause"
    assert Path(found["config_dir"]) == package / "configs"
    assert Path(found["config"]) == package / "configs" / "h100.yaml"
    assert Path(found["config"]).read_bytes() == (REPO / "configs" / "h100.yaml").read_bytes()
    assert found["entries"] == len(load_config_file(REPO / "configs" / "h100.yaml").entries) > 0
    assert Path(found["cases"]) == package / "cases" / "test.txt"
    assert [tuple(s) for s in found["shapes"]] == [c.shape for c in load_cases(REPO / "test_cases" / "test.txt")]


def test_bench_finds_the_case_file_then_asks_for_a_gpu(installed):
    # CUDA_VISIBLE_DEVICES="" (_clean_env) hides any GPU, so this holds on GPU machines too.
    _, python, _, work = installed
    proc = _run([python, "-m", "cute_flash", "bench", "--out", work / "bench-out"], cwd=work, env=_clean_env())
    assert proc.returncode == 2, proc.stderr
    assert "needs an NVIDIA Hopper GPU (compute capability 9.x)" in proc.stderr
    assert "case file" not in proc.stderr and "Traceback" not in proc.stderr


def test_console_script(installed):
    _, python, _, work = installed
    proc = _run([python.parent / "cute-flash", "--help"], cwd=work, env=_clean_env())
    assert proc.returncode == 0, proc.stderr
    assert "bench" in proc.stdout and "tune" in proc.stdout
