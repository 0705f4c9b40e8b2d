"""MM_ROWS: up to this many rows fp8_linear streams the weight against the unquantized activations
(kernels/fp8_linear.py); above, it quantizes them and multiplies on fp8 tensor cores. The few-row
kernel beat torch._scaled_mm at 8 rows on every 8B-like projection and lost at 32 and 64 on three of
four (bench/results, `python -m bench quantized`). Kept apart from the Triton kernels so that the graph
passes read it on machines without Triton."""

MM_ROWS = 16
