"""One forward+backward under the profiler range, for Nsight Compute (GPU).

    ncu --profile-from-start off --section SpeedOfLight --section WarpStateStats \
        --section ComputeWorkloadAnalysis python perf/experiments/profile_bwd.py [--causal]
"""

import sys

import torch

import cute_flash

causal = "--causal" in sys.argv
q, k, v = (torch.randn(2, 16, 8192, 128, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
dout = torch.randn_like(q)
cute_flash.flash_attention(q, k, v, causal=causal).backward(dout)  # compile and warm up
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
cute_flash.flash_attention(q, k, v, causal=causal).backward(dout)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
