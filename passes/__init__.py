"""passes: FX and Inductor graph passes, the pass manager and its uuid, pass-debugging dumps.

Pipeline (`manager.default_passes`), each switchable with `CompileConfig.disabled_passes`:

1. `boundary_recompute`: recomputes the rope gather in every piece instead of carrying it across cuts.
2. `silu_mul_linear`: `down_proj(silu(gate) * up)` becomes one graphkiln::silu_mul_linear call,
   whose one-row GEMV computes the activation as it streams the weight.
3. `add_rmsnorm_linear`: a residual add, the RMSNorm after it and the projection reading the norm
   become one graphkiln::add_rmsnorm_linear call, whose one-row GEMV adds and normalizes too.
4. `attention_split`: cuts the graph at every graphkiln::attention call into pieces.
5. `linear_op` (post-grad): routes weight products through graphkiln::linear, whose one-row
   Triton GEMV beats cuBLAS on decode at batch 1 (see models/linear.py).

Post-grad passes (`base.PostGradPass`) run inside Inductor through the one `PassManager`. The
other fusions worth a post-grad pass in our decoder are already Inductor's:

- residual add + RMSNorm: the whole RMSNorm (pow, mean, +eps, rsqrt, two muls) is one kernel
  (`triton_red_fused__to_copy_add_mean_mul_pow_rsqrt` on the H200). Without `linear_op`, bf16
  keeps the residual add in cuBLAS `addmm` (`..._badd`), which first copies the residual into
  its output: one more launch per product (`memcpy32_post`, 30 per 1B decode step). With it,
  the add joins the norm kernel, which reads the residual anyway; `add_rmsnorm_linear` then
  takes that kernel into the next GEMV at one row (the first layer's input norm, which has no
  residual add before it, and the final norm, which no projection in the graph reads, stay).
- SiLU-and-mul: Inductor emits one kernel reading the gate_up GEMM output
  (`triton_poi_fused_mul_silu_split` on the H200); `silu_mul_linear` goes one step further at one
  row, where that kernel is a whole launch for 16 KB of work.

Measured on the H200 (1B-like bf16 model, bench/passes_bench.py): boundary_recompute takes the
tensors crossing piece boundaries from 111 to 96 and the decode step's kernels from 218 to 217;
replay times do not move beyond noise. A `noop_elimination` pass (same-shape views, same-dtype
casts dropped from the Dynamo graph) was removed: on that model it changed neither (217 kernels,
96 boundary tensors with and without it), since AOTAutograd and Inductor drop the same aliases.
"""
