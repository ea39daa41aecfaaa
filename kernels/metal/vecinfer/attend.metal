// Fused decode attention of VecInfer (the Metal twin of kernels/cuda/vecinfer/attend.cu): keys
// and values are one-byte centroid indices of d/sub sub-vectors (keys smoothed by 1/lambda and
// rotated, values rotated). Two kernels, both kernels/metal/turboquant_mse/attend.metal's
// `attend_codes` body (this file is compiled after that one, as one library: kvq-kernels
// metal/backend.rs), which differ in how a key is scored:
// - kvq_attend_vq_lut (`attend_codes<KVQ_VQ_LUT>`) builds the CUDA kernel's per-query lookup
//   table, one entry per (sub-position, centroid), then scores a row with d/sub table loads. In
//   f32 that table is 32 KiB at d = 128, sub = 4 (an Apple GPU's whole threadgroup memory), so
//   its entries are 16-bit fixed point over a bound of each sub-position's dot products (the
//   body says how; an entry is within 2^-16 of that range) and a threadgroup serves at most two
//   query heads: 16 KiB of table. Dispatch: kvq_kernels::metal::dispatch::attend_vq_table,
//   which picks it when the table fits and a split has rows enough to pay for building it.
// - kvq_attend_vq (`attend_codes<KVQ_VQ>`) gathers each sub-position's centroid from the
//   codebook and does the d multiply-adds a row, serving up to four query heads a threadgroup:
//   the kernel for head dim 256 at sub-vectors of 4 (a 32 KiB table) and for short ranges.
//   Dispatch: kvq_kernels::metal::dispatch::attend_vq.
// Values are gathered the same way in both and rotated back once per threadgroup.

kernel void kvq_attend_vq(device const float* q [[buffer(0)]],
                          device const uchar* kc [[buffer(1)]],
                          device const uchar* vc [[buffer(2)]],
                          device const float* kbooks [[buffer(3)]],
                          device const float* ksigns [[buffer(4)]],
                          device const float* lambda [[buffer(5)]],
                          device const float* vbooks [[buffer(6)]],
                          device const float* vsigns [[buffer(7)]],
                          KVQ_COHERENT device float* part [[buffer(8)]],
                          device float* out [[buffer(9)]],
                          device atomic_uint* counters [[buffer(10)]],
                          constant ScalarAttendParams& p [[buffer(11)]],
                          uint tid [[thread_position_in_threadgroup]],
                          uint tg [[threadgroup_position_in_grid]],
                          uint lane [[thread_index_in_simdgroup]],
                          uint sg [[simdgroup_index_in_threadgroup]]) {
  KVQ_ATTEND_ARRAYS;
  // (kbooks stands in for the codebook norms this kind never reads, sc for the table.)
  attend_codes<KVQ_VQ>(q, kc, vc, kbooks, ksigns, lambda, kbooks, vbooks, vsigns, part, out,
                       counters, p, qs, qs, klv, vlv, sc, mstate, lstate, alpha, red, sc, tid, tg,
                       lane, sg);
}

kernel void kvq_attend_vq_lut(device const float* q [[buffer(0)]],
                              device const uchar* kc [[buffer(1)]],
                              device const uchar* vc [[buffer(2)]],
                              device const float* kbooks [[buffer(3)]],
                              device const float* ksigns [[buffer(4)]],
                              device const float* lambda [[buffer(5)]],
                              device const float* knorms [[buffer(6)]],
                              device const float* vbooks [[buffer(7)]],
                              device const float* vsigns [[buffer(8)]],
                              KVQ_COHERENT device float* part [[buffer(9)]],
                              device float* out [[buffer(10)]],
                              device atomic_uint* counters [[buffer(11)]],
                              constant ScalarAttendParams& p [[buffer(12)]],
                              uint tid [[thread_position_in_threadgroup]],
                              uint tg [[threadgroup_position_in_grid]],
                              uint lane [[thread_index_in_simdgroup]],
                              uint sg [[simdgroup_index_in_threadgroup]]) {
  // KVQ_ATTEND_ARRAYS for KVQ_LUT_GB heads (29 KiB with the table, of the 32 KiB).
  threadgroup float qs[KVQ_LUT_GB * KVQ_ATTEND_MAX_D];
  threadgroup float klv[1];
  threadgroup float sc[KVQ_LUT_GB * KVQ_ATTEND_THREADS];
  threadgroup float mstate[KVQ_ATTEND_GB];
  threadgroup float lstate[KVQ_ATTEND_GB];
  threadgroup float alpha[KVQ_ATTEND_GB];
  threadgroup float red[KVQ_LUT_GB * 8 * KVQ_ATTEND_THREADS];
  threadgroup float steps[2 * KVQ_LUT_GB * KVQ_LUT_MAX_SP + KVQ_LUT_GB];
  threadgroup ushort lut[KVQ_LUT_ENTRIES];
  attend_codes<KVQ_VQ_LUT>(q, kc, vc, kbooks, ksigns, lambda, knorms, vbooks, vsigns, part, out,
                           counters, p, qs, steps, klv, klv, sc, mstate, lstate, alpha, red, lut,
                           tid, tg, lane, sg);
}
