"""What the three warp-specialised kernels (forward, backward, separate dQ) share at their
edges: warpgroup 0 produces (its warp 0 issues the TMA loads), the other warpgroups consume,
and setmaxnreg moves registers from the producer to the consumers."""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

from cute_flash.kernels.wgmma import THREADS_PER_WARPGROUP

SHARED_MEMORY_PER_BLOCK = 227 * 1024  # sm_90's opt-in maximum of dynamic shared memory


def check_shared_memory(storage_type, kernel: str, advice: str) -> None:
    """Raise at compile time when the kernel's shared-memory struct does not fit in an SM:
    the launch would fail with an opaque CUDA error."""
    needed = storage_type.size_in_bytes()
    if needed > SHARED_MEMORY_PER_BLOCK:
        raise ValueError(f"{kernel} tile config needs {needed} bytes of shared memory, more than the "
                         f"{SHARED_MEMORY_PER_BLOCK} an sm_90 block can have ({advice})")


def warp_roles(num_mma_warpgroups: int, register_split: dict):
    """(consumer threads, threads per CTA, consumer registers, producer registers) of a CTA
    with one producer warpgroup; register_split: consumer warpgroups -> (consumer, producer)
    registers per thread after setmaxnreg."""
    threads = THREADS_PER_WARPGROUP * num_mma_warpgroups
    return (threads, threads + THREADS_PER_WARPGROUP, *register_split[num_mma_warpgroups])


REGISTER_FILE = 64 * 1024  # 32-bit registers per SM


def ctas_per_sm(num_mma_warpgroups: int, register_split: dict) -> int:
    """How many CTAs of a register split fit an SM's register file: the launch bound ptxas
    compiles for (the registers a CTA takes at launch, before setmaxnreg moves them). One for
    the splits of two or three consumer warpgroups (they fill the file), two for a single
    consumer warpgroup at (216, 40): 32K registers, half the file."""
    consumer, producer = register_split[num_mma_warpgroups]
    return max(1, REGISTER_FILE // (THREADS_PER_WARPGROUP * (num_mma_warpgroups * consumer + producer)))


def launch(kernel_call, grid, num_threads: int, stream, min_blocks_per_mp: int = 1, cluster_size: int = 1):
    """Launch one CTA of num_threads per grid point, compiled for min_blocks_per_mp resident
    CTAs per SM (ctas_per_sm): at one, a CTA takes the whole register file at launch.
    cluster_size > 1: consecutive CTAs along grid x form clusters of that many (grid x a
    multiple of it)."""
    # More than one needs a shared-memory carveout; given here, the DSL does not ask the
    # device for it (kernels compile without a GPU).
    carveout = {"preferred_smem_carveout": 100} if min_blocks_per_mp > 1 else {}
    cluster = {"cluster": (cluster_size, 1, 1)} if cluster_size > 1 else {}
    kernel_call.launch(grid=grid, block=[num_threads, 1, 1], stream=stream, min_blocks_per_mp=min_blocks_per_mp,
                       **carveout, **cluster)


@cute.jit
def start(atoms):
    """Warp 0 prefetches the TMA descriptors of `atoms` (its loads are the first to need
    them; None entries, atoms a kernel variant does not have, are skipped); returns the warp
    index, uniform across the warp."""
    warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    if warp_idx == 0:
        for atom in atoms:
            if cutlass.const_expr(atom is not None):
                cpasync.prefetch_descriptor(atom)
    return warp_idx
