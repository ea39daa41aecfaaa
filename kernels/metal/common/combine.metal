// The split merge every method's Metal decode attention ends with (the twin of
// kernels/cuda/common/combine.cu): the n_splits partial rows [d outputs, max, sum] of one
// (query head, query row) merged into one, weighted by exp(max_s - max) so no exponential can
// overflow; with `normalize` the first d slots hold the attention output (divided by the sum).
// One threadgroup of 128 threads per row; every thread sums its coordinates over the splits in
// split order. Dispatch: kvq_kernels::metal::dispatch::combine.
#include <metal_stdlib>
using namespace metal;

#define KVQ_COMBINE_THREADS 128
#define KVQ_COMBINE_MAX_SPLITS 1024

struct CombineParams {
  uint rows;       // (query head, query row) pairs
  uint n_splits;   // 1..KVQ_COMBINE_MAX_SPLITS
  uint d;          // head dim
  uint normalize;  // 1: out[..d] = output / sum
};

kernel void kvq_combine(device const float* part [[buffer(0)]],
                        device float* out [[buffer(1)]],
                        constant CombineParams& p [[buffer(2)]],
                        uint tid [[thread_position_in_threadgroup]],
                        uint row [[threadgroup_position_in_grid]],
                        uint lane [[thread_index_in_simdgroup]],
                        uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup float wgt[KVQ_COMBINE_MAX_SPLITS];
  threadgroup float mred[KVQ_COMBINE_THREADS / 32];
  // More splits than the weights' array writes nothing (the host's plan never makes them).
  if (row >= p.rows || p.n_splits > KVQ_COMBINE_MAX_SPLITS) return;
  const uint width = p.d + 2;
  device const float* pr = part + ulong(row) * p.n_splits * width;
  float m = -INFINITY;
  for (uint s = tid; s < p.n_splits; s += KVQ_COMBINE_THREADS) m = max(m, pr[s * width + p.d]);
  m = simd_max(m);
  if (lane == 0) mred[sg] = m;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  m = mred[0];
  for (uint i = 1; i < KVQ_COMBINE_THREADS / 32; i++) m = max(m, mred[i]);
  // An empty split (max -inf) weighs nothing; so does everything when all are empty.
  for (uint s = tid; s < p.n_splits; s += KVQ_COMBINE_THREADS) {
    const float ms = pr[s * width + p.d];
    wgt[s] = ms == -INFINITY ? 0.0f : exp(ms - m);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float l = 0.0f;
  for (uint s = 0; s < p.n_splits; s++) l = fma(wgt[s], pr[s * width + p.d + 1], l);
  device float* o = out + ulong(row) * width;
  for (uint j = tid; j < p.d; j += KVQ_COMBINE_THREADS) {
    float x = 0.0f;
    for (uint s = 0; s < p.n_splits; s++) x = fma(wgt[s], pr[s * width + j], x);
    o[j] = p.normalize != 0 ? (l > 0.0f ? x / l : 0.0f) : x;
  }
  if (tid == 0) {
    o[p.d] = m;
    o[p.d + 1] = l;
  }
}
