"""FEW_ROWS: up to this many rows fp8_linear runs kernels of its own (kernels/fp8_linear.py, fp8_mma.py),
which take x unquantized; above, x is quantized per token by a kernel of its own (or by the
fp8_activation_quant pass, fused into the norm before) and multiplied in torch._scaled_mm. Chosen by
`python -m bench quantized` (README, "Quantized weights"). Kept apart from the Triton kernels so that
the graph passes read it on machines without Triton."""

FEW_ROWS = 16
