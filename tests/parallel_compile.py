"""What the GPU test modules' `--prewarm` entry points share: compile a list of kernel jobs in
parallel processes (the DSL compiles one kernel at a time per process) and print each job's
seconds, so that the tests that follow load them from the disk cache."""

from concurrent.futures import ProcessPoolExecutor


def compile_in_parallel(jobs, compile_job, processes: int = 8):
    """compile_job(job) -> seconds, for every job (picklable), in `processes` processes."""
    with ProcessPoolExecutor(processes) as pool:
        for job, seconds in zip(jobs, pool.map(compile_job, jobs)):
            print(job, f"{seconds:.0f} s", flush=True)
