"""CuTe DSL kernels. Nothing here imports torch: the torch side lives in cute_flash.launch_fwd
and cute_flash.launch_bwd. rules.py and seqlen_pad.py import no DSL either (the config loader,
the tuner and the torch side use them)."""
