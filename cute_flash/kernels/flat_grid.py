"""One launch over several parts (tensors, or pieces of them), each a grid of (block, head,
batch): the float32 operand passes (half_operands.py, tf32_operands.py) run every tensor they
copy in one launch, because a small float32 call is host-bound and each launch costs it
microseconds (perf/NOTES.md, fifty-seventh session). The parts' CTAs follow one another on a
1-D grid in the order the kernel walks them, the block index fastest within a part."""


def part_ctas(blocks, heads, batches):
    """CTAs of one part. Plain Python, traced (host or device side)."""
    return blocks * heads * batches


def part_coordinates(cta, first, blocks, heads, batches):
    """(inside, block, head, batch) of CTA `cta` in the part whose CTAs start at `first`;
    inside is false for a CTA of another part (the caller's `if` skips the part). Plain Python,
    traced in a kernel."""
    local = cta - first
    inside = (local >= 0) & (local < part_ctas(blocks, heads, batches))
    return inside, local % blocks, (local // blocks) % heads, local // (blocks * heads)


def launch_ctas(parts) -> object:
    """CTAs of a launch over `parts`, (blocks, heads, batches) each. Plain Python, traced."""
    total = 0
    for blocks, heads, batches in parts:
        total = total + part_ctas(blocks, heads, batches)
    return total
