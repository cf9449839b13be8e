"""What the GPU test modules' `--prewarm` entry points share: compile a list of kernel jobs in
parallel processes (the DSL compiles one kernel at a time per process) and print each job's
seconds, so that the tests that follow load them from the disk cache."""

from concurrent.futures import ProcessPoolExecutor


def compile_in_parallel(jobs, compile_job, processes: int = 8):
    """compile_job(job) -> seconds, for every job (picklable), in `processes` processes."""
    with ProcessPoolExecutor(processes) as pool:
        for job, seconds in zip(jobs, pool.map(compile_job, jobs)):
            print(job, f"{seconds:.0f} s", flush=True)


def compile_forward_and_backward(dtype, head_dim: int, problem, deterministic_variants=(False,),
                                 value_head_dim: int | None = None):
    """The forward and backward kernels that a GPU test of (dtype, head_dim, problem) on
    1000-token sequences runs (the backward on the tile serving head_dim and value_head_dim,
    default head_dim, as launch_bwd picks it), one backward per deterministic value; compiled
    here, or loaded from the disk cache."""
    import torch

    from cute_flash import compile_bwd, launch_bwd, launch_fwd
    from cute_flash.torch_helpers import TORCH_DTYPE_NAMES

    device = torch.device("cuda")
    value_head_dim = value_head_dim or head_dim
    launch_fwd.kernel_for(dtype, head_dim, problem, device, (1000, 1000), value_head_dim)
    name = TORCH_DTYPE_NAMES[dtype]
    for deterministic in deterministic_variants:
        tile, value_tile, config = launch_bwd._tile_and_config(name, head_dim, value_head_dim, problem, (1000, 1000),
                                                               device, deterministic)
        compile_bwd.get_backward(name, head_dim, problem, config, "sm_90a", None, True, tile, value_head_dim,
                                 value_tile)
