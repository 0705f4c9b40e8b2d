"""passes: FX and Inductor graph passes, the pass manager and its uuid, pass-debugging dumps.

Pipeline (`pipeline.default_passes`), each switchable with `CompileConfig.disabled_passes`:

1. `silu_mul_epilogue`: `silu(gate) * up` of an unbiased gate/up product (bf16 or fp8) becomes one
   graphkiln::linear_silu_mul or fp8_linear_silu_mul call, whose one-row GEMV applies the activation
   to its own outputs.
2. `fp8_mlp`: an fp8 down projection of that activated product becomes one graphkiln::fp8_mlp call, whose
   activation quantization (past 16 rows) computes the SiLU-and-mul as it loads the gate/up product.
3. `silu_mul_linear`: `down_proj(silu(gate) * up)` that the pass before left (a biased gate/up product)
   becomes one graphkiln::silu_mul_linear call, whose one-row GEMV computes the activation as it
   streams the weight; an int4 down product becomes graphkiln::int4_silu_mul_linear, whose one-row product
   applies it as it writes its input's words.
4. `add_rms_norm` (CUDA compiles; on the CPU only when named): a residual add and the RMSNorm of its sum become one
   graphkiln::add_rms_norm call, a Triton kernel holding each row in registers (Inductor's loops over
   a row twice above 1024 inputs) and launched with programmatic dependent launch.
5. `fp8_norm_quant` (where add_rms_norm runs): an add_rms_norm feeding only fp8 products with a
   dynamic per-token scale becomes graphkiln::add_rms_norm_fp8, which also writes its output quantized, and the
   products read that instead of launching their own quantization.
6. `int4_norm_words` (where add_rms_norm runs): an add_rms_norm feeding only int4 products becomes
   graphkiln::add_rms_norm_int4, which at one row also writes its output as the products' words.
7. `rope_attention` (CUDA compiles): a layer's rope and attention become one graphkiln::rope_attention call,
   whose Triton decode kernel rotates q and the new key as it loads them: no rope launch in small decode batches.
8. `attention_split`: cuts the graph at every graphkiln::attention (or rope_attention) call into pieces.
9. `linear_op` (post-grad): routes weight products through graphkiln::linear, whose one-row
   Triton GEMV reads the narrow projections faster than cuBLAS (see models/linear.py).
10. `symm_mem_all_reduce` (post-grad, off unless named; CUDA, 2+ ranks): in compiles specialized to a
    token count, an all-reduce of at most 128 KiB becomes PyTorch's symmetric-memory one-shot kernel
    instead of NCCL's; the residual add + RMSNorm after it stay one Inductor kernel.

Post-grad passes (`base.PostGradPass`) run inside Inductor through the one `PassManager`. The
other fusions worth a pass in this decoder are already Inductor's: the residual add joins the
RMSNorm kernel (once `linear_op` takes the add out of cuBLAS's addmm), and at more rows SiLU-and-mul is
one kernel reading the gate_up output. Passes that were measured and removed are listed in README.
"""
