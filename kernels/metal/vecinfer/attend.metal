// Fused decode attention of VecInfer (the Metal twin of kernels/cuda/vecinfer/attend.cu): keys
// and values are one-byte centroid indices of d/sub sub-vectors (keys smoothed by 1/lambda and
// rotated, values rotated). A key is scored as the sum over its sub-positions of the rotated,
// smoothed query's slice dotted with the row's centroid, gathered from the codebook; values are
// gathered the same way and rotated back once per threadgroup. The CUDA kernel's per-query
// lookup table (d/sub x 256 floats per head: 32 KiB at d = 128, sub = 4) is an Apple GPU's whole
// threadgroup memory, so Metal does the d multiply-adds a row instead of d/sub table loads; the
// codebooks (4 or 8 KiB shared, d KiB per-position) are read through the GPU's caches. The body is
// kernels/metal/turboquant_mse/attend.metal's `attend_codes<KVQ_VQ>`: this file is compiled after
// that one, as one library (kvq-kernels metal/backend.rs). Dispatch:
// kvq_kernels::metal::dispatch::attend_vq.

kernel void kvq_attend_vq(device const float* q [[buffer(0)]],
                          device const uchar* kc [[buffer(1)]],
                          device const uchar* vc [[buffer(2)]],
                          device const float* kbooks [[buffer(3)]],
                          device const float* ksigns [[buffer(4)]],
                          device const float* lambda [[buffer(5)]],
                          device const float* vbooks [[buffer(6)]],
                          device const float* vsigns [[buffer(7)]],
                          device float* part [[buffer(8)]],
                          constant ScalarAttendParams& p [[buffer(9)]],
                          uint tid [[thread_position_in_threadgroup]],
                          uint tg [[threadgroup_position_in_grid]],
                          uint lane [[thread_index_in_simdgroup]],
                          uint sg [[simdgroup_index_in_threadgroup]]) {
  KVQ_ATTEND_ARRAYS;
  attend_codes<KVQ_VQ>(q, kc, vc, kbooks, ksigns, lambda, vbooks, vsigns, part, p, qs, qs, klv, vlv,
                       sc, mstate, lstate, alpha, red, tid, tg, lane, sg);
}
