// Fused decode attention of TurboQuant-Prod (the Metal twin of kernels/cuda/turboquant_prod/
// attend.cu): keys are a (b-1)-bit scalar-codebook row, then `||r||` (f16) and m/8 sign bytes of
// the residual's sketch, scored as scalar(q) + ||r|| sqrt(pi/2)/m <S q, sign(S r)>; values are
// TurboQuant-MSE rows. The body is kernels/metal/turboquant_mse/attend.metal's
// `attend_codes<KVQ_PROD>`: this file is compiled after that one, as one library (kvq-kernels
// metal/backend.rs). Dispatch: kvq_kernels::metal::dispatch::attend_prod.

kernel void kvq_attend_prod(device const float* q [[buffer(0)]],
                            device const uchar* kc [[buffer(1)]],
                            device const uchar* vc [[buffer(2)]],
                            device const float* klevels [[buffer(3)]],
                            device const float* ksigns [[buffer(4)]],
                            device const float* vlevels [[buffer(5)]],
                            device const float* vsigns [[buffer(6)]],
                            device const float* mats [[buffer(7)]],
                            KVQ_COHERENT device float* part [[buffer(8)]],
                            device float* out [[buffer(9)]],
                            device atomic_uint* counters [[buffer(10)]],
                            constant ScalarAttendParams& p [[buffer(11)]],
                            uint tid [[thread_position_in_threadgroup]],
                            uint tg [[threadgroup_position_in_grid]],
                            uint lane [[thread_index_in_simdgroup]],
                            uint sg [[simdgroup_index_in_threadgroup]]) {
  KVQ_ATTEND_ARRAYS;
  threadgroup float sq[KVQ_ATTEND_GB * KVQ_ATTEND_MAX_D];  // sqrt(pi/2)/m S q, [gb][m]
  // (mats stands in for the codebook norms this kind never reads, sc for the table.)
  attend_codes<KVQ_PROD>(q, kc, vc, klevels, ksigns, mats, mats, vlevels, vsigns, part, out,
                         counters, p, qs, sq, klv, vlv, sc, mstate, lstate, alpha, red, sc, tid, tg,
                         lane, sg);
}
