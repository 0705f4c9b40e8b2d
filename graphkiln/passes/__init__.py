"""passes: FX and Inductor graph passes, the pass manager and its uuid, pass-debugging dumps.

Pipeline (`manager.default_passes`), each switchable with `CompileConfig.disabled_passes`:

1. `boundary_recompute`: recomputes the rope gather in every piece instead of carrying it across cuts.
2. `silu_mul_linear`: `down_proj(silu(gate) * up)` becomes one graphkiln::silu_mul_linear call,
   whose one-row GEMV computes the activation as it streams the weight.
3. `attention_split`: cuts the graph at every graphkiln::attention call into pieces.
4. `linear_op` (post-grad): routes weight products through graphkiln::linear, whose one-row
   Triton GEMV beats cuBLAS on decode at batch 1 (see models/linear.py).

Post-grad passes (`base.PostGradPass`) run inside Inductor through the one `PassManager`. The
other fusions worth a post-grad pass in our decoder are already Inductor's:

- residual add + RMSNorm: the whole RMSNorm (pow, mean, +eps, rsqrt, two muls) is one kernel
  (`triton_red_fused__to_copy_add_mean_mul_pow_rsqrt` on the H200). Without `linear_op`, bf16
  keeps the residual add in cuBLAS `addmm` (`..._badd`), which first copies the residual into
  its output: one more launch per product (`memcpy32_post`, 30 per 1B decode step). With it,
  the add joins the norm kernel, which reads the residual anyway.
- SiLU-and-mul: Inductor emits one kernel reading the gate_up GEMM output
  (`triton_poi_fused_mul_silu_split` on the H200); `silu_mul_linear` goes one step further at one
  row, where that kernel is a whole launch for 16 KB of work.

Measured on the H200 (1B-like bf16 model, bench/passes_bench.py): boundary_recompute takes the
tensors crossing piece boundaries from 111 to 96 and the decode step's kernels from 218 to 217;
replay times do not move beyond noise. A `noop_elimination` pass (same-shape views, same-dtype
casts dropped from the Dynamo graph) was removed: on that model it changed neither (217 kernels,
96 boundary tensors with and without it), since AOTAutograd and Inductor drop the same aliases.
An `add_rmsnorm_linear` pass (commit a033de1: the residual add and RMSNorm inside the next
projection's one-row GEMV, every program summing squares as it walked K) was removed too: it took
30 launches out of the 1B decode step, but on a 4-layer 8B-shaped model the step replayed in
0.802 ms with it and 0.778 ms without (`bench/decode_kernels.py --model 8b --layers 4`, one H200
call), since each of the GEMV's hundreds of programs re-reads the residual and norm weight that
one norm kernel reads once. In the full bench (run7) 8B decode at batch 1 was 1.27x the floor
with it against 1.25x in run6 without it.
"""
