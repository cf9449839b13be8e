"""CuTe DSL kernels. Nothing here imports torch: the torch side lives in cute_flash.launch."""
