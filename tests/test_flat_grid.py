"""kernels/flat_grid.py on plain integers (its helpers are traced with the DSL's integers in
the operand passes, and Python's behave the same): every CTA of a launch lands in exactly one
part, and each part's (block, head, batch) are covered once, the block fastest."""

import pytest

from cute_flash.kernels.flat_grid import launch_ctas, part_coordinates, part_ctas


@pytest.mark.parametrize("parts", [[(3, 2, 2)], [(1, 4, 1), (5, 2, 3), (2, 1, 2)], [(4, 2, 0), (3, 1, 2)]])
def test_every_cta_decodes_to_one_block_of_one_part(parts):
    total = launch_ctas(parts)
    assert total == sum(b * h * n for b, h, n in parts)
    seen = {index: [] for index in range(len(parts))}
    for cta in range(total):
        first, owners = 0, []
        for index, (blocks, heads, batches) in enumerate(parts):
            inside, block, head, batch = part_coordinates(cta, first, blocks, heads, batches)
            if inside:
                owners.append(index)
                seen[index].append((batch, head, block))
            first += part_ctas(blocks, heads, batches)
        assert len(owners) == 1, (cta, owners)
    for index, (blocks, heads, batches) in enumerate(parts):
        # In launch order: batch slowest, then head, the block fastest.
        assert seen[index] == [(n, h, b) for n in range(batches) for h in range(heads) for b in range(blocks)]
