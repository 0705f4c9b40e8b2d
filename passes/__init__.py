"""passes: FX and Inductor graph passes, the pass manager and its uuid, pass-debugging dumps.

Pipeline (`manager.default_passes`), each switchable with `CompileConfig.disabled_passes`:

1. `boundary_recompute`: recomputes the rope gather in every piece instead of carrying it across cuts.
2. `attention_split`: cuts the graph at every graphkiln::attention call into pieces.

Post-grad passes (`base.PostGradPass`) run inside Inductor through the one `PassManager`; none
ships, because the fusions worth a post-grad pass in our decoder are already Inductor's:

- residual add + RMSNorm: on CPU (checked, torch 2.13) the add rides in the o_proj/down_proj
  GEMM as `addmm(residual, ...)` and the whole RMSNorm (pow, mean, +eps, rsqrt, two muls) is one
  C++ kernel (`cpp_fused_add_mean_mul_pow_rsqrt`). On CUDA, Inductor's post-grad patterns keep
  `mm + add` unfused when every use is pointwise (`should_prefer_unfused_addmm`), so the add
  lands in the RMSNorm's Triton reduction kernel; bfloat16 on torch 2.13 keeps `addmm` instead
  (`keep_addmm_fused_for_half_dtypes`). Either way no separate add or norm-step kernel.
  Checked on the H200 (bf16, torch 2.11 profile of a decode step): one
  `triton_red_fused__to_copy_add_mean_mul_pow_rsqrt` kernel per norm, and cuBLAS `..._badd` GEMMs
  that add the residual in their epilogue.
- SiLU-and-mul: one kernel reading the gate_up GEMM output (`cpp_fused_mul_silu_split` on CPU,
  `triton_poi_fused_mul_silu_split` on the H200).

Measured on the H200 (1B-like bf16 model, bench/passes_bench.py): boundary_recompute takes the
tensors crossing piece boundaries from 111 to 96 and the decode step's kernels from 218 to 217;
replay times do not move beyond noise. A `noop_elimination` pass (same-shape views, same-dtype
casts dropped from the Dynamo graph) was removed: on that model it changed neither (217 kernels,
96 boundary tensors with and without it), since AOTAutograd and Inductor drop the same aliases.
"""
