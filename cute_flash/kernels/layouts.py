"""Layout helpers shared by the Hopper kernels.

A WGMMA accumulator fragment is laid out as ((2, 2, N/8), MMA_M, MMA_N): each thread owns two
rows (r and r + 8 of its 16-row slab) and pairs of adjacent columns. Softmax wants to walk the
fragment row by row, and the second GEMM (P @ V) wants the same registers viewed as an A
operand. Both are just different layouts over the same registers, built here.
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warp, warpgroup
from cutlass.tensor_utils import LayoutEnum

from cute_flash.kernels.ptx import pack_half2, round_to_tf32


def sequence_major(t: cute.Tensor) -> cute.Tensor:
    """The kernels' view of a torch tensor: (B, N, S, D) -> (S, D, N, B) and (B, N, S) ->
    (S, N, B), so that a (head, batch) slice is an (S, D) matrix (or an S vector)."""
    mode = [2, 3, 1, 0] if cute.rank(t.layout) == 4 else [2, 1, 0]
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=mode))


def row_tiled_copy(dtype, num_threads: int, cols: int, values: int, tile_rows: int) -> cute.TiledCopy:
    """Threads tile a (tile_rows, cols) block row by row, `values` contiguous elements each with
    16-byte accesses, the threads of one row in consecutive lanes (so a row reduces with warp
    shuffles). The passes (num_threads / (cols / values) rows each) must divide tile_rows:
    a partition of the block by a pass that reaches past it addresses rows beyond the block,
    and three kernels stored into their neighbours' rows that way before the check was here
    (a 112-key block by 32-row passes, a (2, 96) grouped tile and a 192-row D = 16 tile by
    128-row passes). Checked when the kernel is traced, so a config or tile that breaks it
    fails to compile instead of writing wrong rows."""
    threads_per_row = cols // values
    pass_rows, leftover = divmod(num_threads, threads_per_row)
    assert threads_per_row > 0 and leftover == 0 and tile_rows % pass_rows == 0, (
        f"row_tiled_copy: {num_threads} threads in rows of {threads_per_row} ({cols} columns, {values} a thread) "
        f"do not tile {tile_rows} rows (layouts.row_copy_threads picks a count that does)")
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128)
    threads = cute.make_ordered_layout((num_threads // threads_per_row, threads_per_row), order=(1, 0))
    return cute.make_tiled_copy_tv(atom, threads, cute.make_layout((1, values)))


def chunk_row_partitions(thr_load, thr_store, src: cute.Tensor, dst: cute.Tensor, chunk, rows: int, cols: int,
                         lo_column=None):
    """A thread's partitions of chunk `chunk` (`rows` rows) of the (S, cols) matrix src and of
    its copy in dst, for the float32 operand passes (kernels/tf32_operands.py,
    half_operands.py): (coordinates, src's values, dst's columns [0, cols), and with lo_column
    dst's columns from lo_column on, else None). Plain Python."""
    tile = (rows, cols)
    coords = thr_load.partition_S(cute.make_identity_tensor(tile))
    src_tile = thr_load.partition_S(cute.local_tile(src, tile, (chunk, 0)))
    hi_tile = thr_store.partition_D(cute.local_tile(dst, tile, (chunk, 0)))
    lo_tile = None
    if lo_column is not None:
        lo_tile = thr_store.partition_D(cute.local_tile(cute.domain_offset((0, lo_column), dst), tile, (chunk, 0)))
    return coords, src_tile, hi_tile, lo_tile


def row_copy_threads(num_threads: int, cols: int, values: int, tile_rows: int) -> int:
    """How many of num_threads a row_tiled_copy of `cols` columns over tile_rows rows can use:
    whole rows of threads (cols / values each), a power of two of them that divides tile_rows
    (96 or 192 columns: 12 or 24 threads per row, which 256 threads do not fill; a 112-key
    block takes 16-row passes, not 32)."""
    per_row = cols // values
    rows = 1
    while rows * 2 * per_row <= num_threads and tile_rows % (rows * 2) == 0:
        rows *= 2
    return rows * per_row


def row_copy(dtype, num_threads: int, cols: int, values: int, tile_rows: int):
    """(threads, copy): the row_copy_threads count of num_threads for a (tile_rows, cols)
    block and the row_tiled_copy those threads run over it (threads tidx >= threads idle)."""
    threads = row_copy_threads(num_threads, cols, values, tile_rows)
    return threads, row_tiled_copy(dtype, threads, cols, values, tile_rows)


@cute.jit
def by_first_threads(tidx, threads: cutlass.Constexpr[int], num_threads: cutlass.Constexpr[int], work, *args):
    """work(*args) by the threads tidx < threads of num_threads (a row_copy_threads count):
    with no predicate at all where that is every thread (a compile-time choice, so a kernel
    whose rows every thread covers keeps predicate-free code)."""
    if cutlass.const_expr(threads == num_threads):
        work(*args)
    elif tidx < threads:
        work(*args)


@cute.jit
def copy_clipped_rows(atom, pairs, coords: cute.Tensor, row_limit, columns: cutlass.Constexpr[int],
                      tile_columns: cutlass.Constexpr[int], row_start=None):
    """cute.copy(atom, src, dst) for each (src, dst) of `pairs`, partitions of a row_tiled_copy
    ((values, rows, vectors) per thread, `coords` the identity partition): only rows below
    row_limit (and with a row_start, from it on), and with columns < tile_columns (a head dim
    served by a wider tile, cute_flash.head_dims) only the whole vectors below `columns` (a
    multiple of 8)."""
    for m in cutlass.range_constexpr(cute.size(coords, mode=[1])):
        row = coords[0, m, 0][0]
        inside = row < row_limit
        if cutlass.const_expr(row_start is not None):
            inside = inside and row >= row_start
        if inside:
            if cutlass.const_expr(columns == tile_columns):
                for src, dst in pairs:
                    cute.copy(atom, src[None, m, None], dst[None, m, None])
            else:
                for c in cutlass.range_constexpr(cute.size(coords, mode=[2])):
                    if coords[0, m, c][1] < columns:
                        for src, dst in pairs:
                            cute.copy(atom, src[None, m, c], dst[None, m, c])


@cute.jit
def store_rows_clipped(dtype: cutlass.Constexpr, src: cute.Tensor, dst: cute.Tensor, tidx,
                       num_threads: cutlass.Constexpr[int], row_limit, columns: cutlass.Constexpr[int],
                       values: cutlass.Constexpr[int], row_start=None):
    """A (rows, tile columns) tile of `dtype` from shared memory src to global dst by the first
    row_copy_threads of num_threads, `values` elements per access (row_tiled_copy): the rows
    below row_limit (and from row_start on, where given), of the columns the whole vectors
    below `columns` (copy_clipped_rows). A packed batch's tiles leave this way: the rows past
    a sequence's end are the next one's.
    The passes tile the tile's rows exactly. One that reached past them (128-row passes of a
    192-row tile at D = 16) stored rows 192-255 wherever row_limit admitted them: into the next
    tile's rows (a dense tile aligned to the end that starts before row 0, whose limit is
    Sq plus the rows before 0; a packed sequence's tile before its last), values read past O's
    shared-memory tile (sixty-fifth session). Where dst's rows are (group, position) pairs
    (row_heads' O), a pass that ended inside the position mode (128 rows of a (2, 96) tile)
    sent every later store to the wrong rows."""
    tile = (cute.size(src, mode=[0]), cute.size(src, mode=[1]))
    threads, store = row_copy(dtype, num_threads, tile[1], values, tile[0])
    if tidx < threads:
        thr_store = store.get_slice(tidx)
        coords = thr_store.partition_S(cute.make_identity_tensor(tile))
        copy_clipped_rows(store, [(thr_store.partition_S(src), thr_store.partition_D(dst))], coords, row_limit,
                          columns, tile[1], row_start)


@cute.jit
def zero_rows_from(dtype: cutlass.Constexpr, tile: cute.Tensor, row_start, tidx, num_threads: cutlass.Constexpr[int],
                   values: cutlass.Constexpr[int]):
    """Zero rows row_start.. of a (rows, cols) shared-memory tile of `dtype` (any swizzle that
    keeps `values` elements, 16 bytes, together) by the first row_copy_threads of
    num_threads, 16 bytes per store. The caller fences the stores for the async proxy and
    syncs the readers."""
    shape = (cute.size(tile, mode=[0]), cute.size(tile, mode=[1]))
    threads, store = row_copy(dtype, num_threads, shape[1], values, shape[0])
    if tidx < threads:
        thr_store = store.get_slice(tidx)
        coords = thr_store.partition_D(cute.make_identity_tensor(shape))
        rows = thr_store.partition_D(tile)
        zeros = cute.make_rmem_tensor_like(rows[None, 0, None])
        zeros.fill(0.0)
        for m in cutlass.range_constexpr(cute.size(coords, mode=[1])):
            if coords[0, m, 0][0] >= row_start:
                cute.copy(store, zeros, rows[None, m, None])


def acc_rows_cols_layout(acc_layout: cute.Layout) -> cute.Layout:
    """((2, 2, V), MMA_M, MMA_N) -> ((2, MMA_M), (2, V, MMA_N)): (rows, cols) of one thread."""
    packed = cute.make_layout(acc_layout.shape)  # compact, so the result composes cleanly
    rows_shape = (packed.shape[0][1], packed.shape[1])
    rows_stride = (packed.stride[0][1], packed.stride[1])
    cols_shape = (packed.shape[0][0], packed.shape[0][2], packed.shape[2])
    cols_stride = (packed.stride[0][0], packed.stride[0][2], packed.stride[2])
    rows_cols = cute.make_layout((rows_shape, cols_shape), stride=(rows_stride, cols_stride))
    return cute.composition(acc_layout, rows_cols)


def acc_as_rows_cols(acc: cute.Tensor) -> cute.Tensor:
    """View an accumulator (or a partitioned coordinate tensor) as (rows, cols)."""
    return cute.make_tensor(acc.iterator, acc_rows_cols_layout(acc.layout))


@cute.jit
def store_rounded(dst: cute.Tensor, src: cute.Tensor):
    """dst (a 16-bit register fragment: a WGMMA's A operand) = src (float32 of the same shape,
    e.g. acc_as_operand_a of an accumulator), rounded to nearest, two values per instruction
    straight into dst's registers (ptx.pack_half2). `dst.store(src.load().to(...))` is the same
    arithmetic, but for bf16 key blocks other than 128 it built the pairs in other registers
    and moved them, and those moves serialised the WGMMAs reading dst (SASS: every HGMMA its
    own group). dst's fragment is compact, so its registers hold its elements in order."""
    packed = cute.recast_tensor(dst, Int32)
    for i in cutlass.range_constexpr(cute.size(packed)):
        packed[i] = pack_half2(src[2 * i], src[2 * i + 1], dst.element_type)


def acc_as_operand_a(acc: cute.Tensor) -> cute.Tensor:
    """View a QK^T accumulator as the register A operand of the P @ V WGMMA.

    ((2, 2, N/8), MMA_M, MMA_N) -> ((2, 2, 2), MMA_M, (N/16, MMA_N)): a k-block of the second
    GEMM spans 16 columns, i.e. two of the accumulator's 8-column groups.
    """
    layout = acc.layout
    assert layout.shape[0][2] % 2 == 0, "block_n must be a multiple of 16"
    split = cute.logical_divide(layout, ((None, None, 2), None, None))
    operand = cute.make_layout(
        (
            (split.shape[0][0], split.shape[0][1], split.shape[0][2][0]),
            split.shape[1],
            (split.shape[0][2][1], split.shape[2]),
        ),
        stride=(
            (split.stride[0][0], split.stride[0][1], split.stride[0][2][0]),
            split.stride[1],
            (split.stride[0][2][1], split.stride[2]),
        ),
    )
    return cute.make_tensor(acc.iterator, operand)


def acc_as_tf32_operand_a(acc: cute.Tensor) -> cute.Tensor:
    """View a float32 QK^T accumulator as the register A operand of a TF32 P @ V WGMMA.

    A thread holds columns 2t and 2t + 1 (t = lane % 4) of each 8-column group of the
    accumulator, and the TF32 A fragment of a k step of 8 wants columns t and t + 4: the view
    ((2, 2, N/8), MMA_M, MMA_N) -> ((2, 2), MMA_M, (N/8, MMA_N)) with the first two value modes
    swapped feeds key 2t + h to the GEMM as its column t + 4h. The B operand (V^T) must hold its
    keys in that order within each group of 8 (kernels/tf32_operands.py lays V out so).
    """
    layout = acc.layout
    operand = cute.make_layout(
        ((layout.shape[0][1], layout.shape[0][0]), layout.shape[1], (layout.shape[0][2], layout.shape[2])),
        stride=((layout.stride[0][1], layout.stride[0][0]), layout.stride[1], (layout.stride[0][2], layout.stride[2])),
    )
    return cute.make_tensor(acc.iterator, operand)


def store_tf32_operand_a(fragment: cute.Tensor, acc: cute.Tensor) -> None:
    """A float32 accumulator (P, dS, or their transposes) into the register A operand of a TF32
    WGMMA: every value rounded to TF32 (the tensor cores would truncate it) into registers of
    its own, in acc_as_tf32_operand_a's order. (Rounding the accumulator's own registers in
    place made ptxas serialise every WGMMA of the dQ kernel, C7511: perf/NOTES.md,
    twenty-second session.) Plain Python: unrolls where the kernel calls it."""
    rounded = cute.make_rmem_tensor_like(acc, Float32)
    for i in range(cute.size(acc)):
        rounded[i] = round_to_tf32(acc[i])
    fragment.store(acc_as_tf32_operand_a(rounded).load().to(fragment.element_type))


def store_tf32_split_operand_a(fragment: cute.Tensor, fragment_lo: cute.Tensor, acc: cute.Tensor) -> None:
    """store_tf32_operand_a for 3xTF32 (split operands): the accumulator's TF32 parts,
    hi = tf32(x) into `fragment` and lo = tf32(x - hi) into `fragment_lo` (hi + lo is x to
    float32's precision), each in registers of its own. Plain Python, unrolled."""
    hi = cute.make_rmem_tensor_like(acc, Float32)
    lo = cute.make_rmem_tensor_like(acc, Float32)
    for i in range(cute.size(acc)):
        hi[i] = round_to_tf32(acc[i])
        lo[i] = round_to_tf32(acc[i] - hi[i])
    fragment.store(acc_as_tf32_operand_a(hi).load().to(fragment.element_type))
    fragment_lo.store(acc_as_tf32_operand_a(lo).load().to(fragment_lo.element_type))


def row_halves(stages, rows: int, cols: int):
    """A (2 rows, cols, stages) tile of split operands (hi rows over lo rows: V^T, Q^T, dO^T,
    K^T) as its (rows, cols, stages) hi and lo halves. Plain Python."""
    parts = cute.flat_divide(stages, (rows, cols))
    return parts[None, None, 0, 0, None], parts[None, None, 1, 0, None]


def column_halves_transposed(stages, rows: int, cols: int, chunk: tuple | None = None):
    """A (rows, 2 cols, stages) tile of the scaled halves' [hi | lo] rows (V, K, Q, dO) as its
    hi and lo column halves, each transposed to (cols, rows, stages): the MN-major B operands of
    GEMMs that contract over the rows (P V, dS K, P^T dO, dS^T Q). chunk (first, width): only
    columns [first, first + width) of each half, (width, rows, stages) (a gradient chunk's
    operand; width divides first and cols, whole swizzle atoms). Plain Python."""
    first, width = chunk or (0, cols)
    parts = cute.flat_divide(stages, (rows, width))
    return (transposed_view(parts[None, None, 0, first // width, None]),
            transposed_view(parts[None, None, 0, (cols + first) // width, None]))


def accumulator_store_atom(dtype) -> cute.CopyAtom:
    """The copy atom that moves an accumulator-shaped fragment of `dtype` to shared memory
    (with make_tiled_copy_C): stmatrix for 16-bit elements; stmatrix moves no 32-bit ones,
    so float32 goes as each thread's column pairs, 8-byte stores."""
    if dtype.width == 32:
        return cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=64)
    return cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), dtype)


def row_major_smem_layout(dtype, rows: int, cols: int, stages=None):
    """Swizzled shared-memory layout for a (rows, cols) tile with cols contiguous.

    The swizzle width (32/64/128 B) follows from cols; with a head dim of 64 or more it is the
    128-byte swizzle, which lets both TMA writes and WGMMA reads run without bank conflicts.
    """
    atom = warpgroup.make_smem_layout_atom(
        sm90_helpers.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, cols), dtype
    )
    if stages is None:
        return cute.tile_to_shape(atom, (rows, cols), order=(0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))


def transposed_view(s: cute.Tensor) -> cute.Tensor:
    """Swap the first two modes of a shared-memory tensor (V as the (D, block_n) B operand)."""
    shape = (s.shape[1], s.shape[0], *s.shape[2:])
    order = (1, 0, *range(2, cute.rank(s)))
    return cute.composition(s, cute.make_ordered_layout(shape, order=order))
