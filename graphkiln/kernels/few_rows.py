"""FEW_ROWS: up to this many rows fp8_linear streams the weight against the unquantized activations
(kernels/fp8_linear.py); above, it quantizes them and multiplies on fp8 tensor cores. Chosen by
`python -m bench quantized` (README, "Quantized weights"). Kept apart from the Triton kernels so that
the graph passes read it on machines without Triton."""

FEW_ROWS = 16
