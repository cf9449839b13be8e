"""A real use of the KV-cache entry point (perf/generate.py): a tiny Llama-style model with
random weights decodes greedily, in lockstep, through cute_flash on a paged cache with a
shuffled free list and through SDPA on a contiguous cache: 64 steps, the same tokens except
where SDPA's own top-two logits lie within the two implementations' bf16 distance."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "perf"))


@pytest.mark.gpu
def test_greedy_generation_on_a_paged_cache_equals_sdpa():
    import generate

    results, gaps = generate.run(steps=64, batch=4)
    want, (got, distance, _) = results["sdpa"][0], results["cute_flash_paged"]
    assert want.shape == got.shape == (4, 64)
    assert generate.mismatches(results, gaps, "cute_flash_paged") == []
    assert (got == want).float().mean().item() > 0.95 and 0 < distance < 0.5
    assert len(set(want.flatten().tolist())) > 8  # not a degenerate repetition
