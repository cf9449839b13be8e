"""The backward kernels compile for sm_90a on the CPU, and the main kernel's SASS shows the
Hopper machinery (WGMMA, TMA loads and stores, vector atomics for dQ) and no local-memory
traffic (register spills)."""

import dataclasses
import re

import pytest

from cute_flash.compile_bwd import compile_backward_cubins
from cute_flash.kernels.bwd_sm90 import DEFAULT_CONFIGS
from cute_flash.sass import disassemble, find_nvdisasm, opcode_counts

pytestmark = pytest.mark.sass


@pytest.fixture(scope="module", autouse=True)
def _needs_nvdisasm():
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")


def _no_spills(counts):
    return counts.get("LDL", 0) == 0 and counts.get("STL", 0) == 0


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_backward_compiles_to_hopper_sass(head_dim, causal, tmp_path):
    cubins = compile_backward_cubins("float16", head_dim, causal, DEFAULT_CONFIGS[head_dim], tmp_path)
    counts = opcode_counts(disassemble(cubins["main"]))
    assert counts.get("HGMMA", 0) > 0, "no warpgroup MMA in the main kernel"
    assert counts.get("UTMALDG", 0) > 0, "no TMA loads in the main kernel"
    assert counts.get("UTMASTG", 0) > 0, "no TMA stores of dK / dV in the main kernel"
    assert counts.get("REDG", 0) > 0, "no atomic dQ accumulation in the main kernel"
    assert counts.get("USETMAXREG", 0) >= 2, "no setmaxnreg split between producer and consumers"
    assert _no_spills(counts), (
        f"main kernel spills: LDL={counts.get('LDL', 0)} STL={counts.get('STL', 0)}"
    )
    for name in ("preprocess", "postprocess"):
        counts = opcode_counts(disassemble(cubins[name]))
        assert _no_spills(counts), f"{name} spills"


def _variant(head_dim, **fields):
    return dataclasses.replace(DEFAULT_CONFIGS[head_dim], **fields)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_deterministic_backward_compiles_without_spills(head_dim, causal, tmp_path):
    cubins = compile_backward_cubins("float16", head_dim, causal, _variant(head_dim, deterministic=True), tmp_path)
    sass = disassemble(cubins["main"])
    counts = opcode_counts(sass)
    assert counts.get("HGMMA", 0) > 0, "no warpgroup MMA in the main kernel"
    assert _no_spills(counts), (
        f"main kernel spills: LDL={counts.get('LDL', 0)} STL={counts.get('STL', 0)}"
    )
    # The turn semaphore: acquire polls, and a release increment after a GPU-scope fence.
    assert "LDG.E.STRONG.GPU" in sass, "no acquire load of the dQ semaphore"
    assert "REDG.E.ADD.S32.STRONG.GPU" in sass, "no increment of the dQ semaphore"
    assert counts.get("MEMBAR", 0) > 0, "no fence before passing the dQ turn on"


# The register-A dV / dK variant, on the YAML tile shapes (block_m 64, block_n 128 for both head
# dims; with block_m 128 the per-query-column LSE / delta of D=64 spill).
RS_SHAPE = dict(block_m=64, block_n=128, num_stages=2, num_stages_pds=2, num_mma_warpgroups=2, dq_atom_m=1,
                mma_dkv_from_registers=True)


@pytest.mark.parametrize("extra", [{}, {"deterministic": True}, {"num_stages_pds": 1}],
                         ids=["rs", "rs-det", "rs-pds1"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_register_a_backward_compiles_without_spills(head_dim, causal, extra, tmp_path):
    config = _variant(head_dim, **{**RS_SHAPE, **extra})
    cubins = compile_backward_cubins("bfloat16", head_dim, causal, config, tmp_path)
    sass = disassemble(cubins["main"])
    counts = opcode_counts(sass)
    assert _no_spills(counts), (
        f"main kernel spills: LDL={counts.get('LDL', 0)} STL={counts.get('STL', 0)}"
    )
    # dV and dK take their A operand from registers: 'HGMMA.64xDx16.F32 Racc, Ra, gdesc...'.
    assert re.search(rf"HGMMA\.64x{head_dim}x16\.F32(\.BF16)? R\d+, R\d+, gdesc", sass), "no register-A WGMMA"
    assert counts.get("REDG", 0) > 0 and counts.get("UTMASTG", 0) > 0
