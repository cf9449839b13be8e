"""cute_flash.sass's compile jobs on the CPU, with a stand-in for the compile child (no DSL):
which files a job returns, and a job asked for twice in one process compiled once."""

import itertools
from pathlib import Path

import pytest

from cute_flash import compile_bwd, sass
from cute_flash.config import default_config_dir, load_config_file
from cute_flash.kernels.problem import AttentionProblem


@pytest.fixture
def child(monkeypatch):
    """The compile child replaced: each run writes one file per name the job's "files" lists,
    holding the job's "kernel" and a run number, and answers with their names."""
    runs = []
    counter = itertools.count()

    def run(job, timeout):
        runs.append(job)
        number = next(counter)
        for name in job["files"]:
            (Path(job["out_dir"]) / name).write_text(f"{job['kernel']} run {number}")
        return sorted(job["files"])

    monkeypatch.setattr(sass._SERVER, "run", run)
    monkeypatch.setattr(sass, "_compiled", {})
    return runs


def test_a_repeated_job_is_copied_not_compiled(child, tmp_path):
    job = dict(kind="fwd", kernel="A", files=["k.cubin"])
    first = sass._compile_cubin(job, tmp_path / "one", 60)
    second = sass._compile_cubin(job, tmp_path / "two", 60)
    again = sass._compile_cubin(job, tmp_path / "two", 60)
    assert len(child) == 1
    assert second == again == tmp_path / "two" / "k.cubin" and first == tmp_path / "one" / "k.cubin"
    assert second.read_text() == first.read_text() == "A run 0"


def test_a_job_whose_files_another_job_overwrote_is_compiled_again(child, tmp_path):
    # The DSL names a cubin after the kernel's argument types: two configs of one kernel
    # write the same file name.
    a, b = (dict(kind="fwd", kernel=kernel, files=["k.cubin"]) for kernel in "AB")
    sass._compile_cubin(a, tmp_path, 60)
    assert sass._compile_cubin(b, tmp_path, 60).read_text() == "B run 1"
    assert sass._compile_cubin(a, tmp_path / "other", 60).read_text() == "A run 2"
    assert len(child) == 3


def test_backward_cubins_are_the_jobs_own(child, monkeypatch, tmp_path):
    # A cubin of an earlier job in the same directory, sorting after the job's own, is not taken.
    names = {"preprocess": "a_BackwardPreprocess.cubin", "main": "a_FlashBackwardSm90.cubin",
             "postprocess": "a_BackwardPostprocess.cubin"}
    (tmp_path / "z_FlashBackwardSm90.cubin").write_text("an earlier job's")
    real_run = sass._SERVER.run
    monkeypatch.setattr(sass._SERVER, "run",
                        lambda job, timeout: real_run(dict(job, kernel="bwd", files=list(names.values())), timeout))
    table = load_config_file(default_config_dir() / "h100.yaml")
    cubins = compile_bwd.compile_backward_cubins("bfloat16", 64, AttentionProblem.of(True),
                                                 table.lookup("bfloat16", 64, True, "bwd"), tmp_path)
    assert {key: path.name for key, path in cubins.items()} == names
    assert cubins["main"].read_text() == "bwd run 0"


def test_a_failed_job_is_not_remembered(child, monkeypatch, tmp_path):
    job = dict(kind="fwd", kernel="A", files=["k.cubin"])
    real_run = sass._SERVER.run

    def failing(job, timeout):
        raise RuntimeError("compiling failed")

    monkeypatch.setattr(sass._SERVER, "run", failing)
    with pytest.raises(RuntimeError):
        sass._compile_cubin(job, tmp_path, 60)
    monkeypatch.setattr(sass._SERVER, "run", real_run)
    assert sass._compile_cubin(job, tmp_path, 60).read_text() == "A run 0"
