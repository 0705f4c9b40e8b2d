"""kernels: graphkiln's Triton kernels (GEMV, attention, KV writes, quantized products) and their launches."""
