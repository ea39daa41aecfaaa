// VecInfer's fused nearest-centroid argmin (the Metal twin of kernels/cuda/vecinfer/encode.cu
// `kvq_nearest_s*`; the CPU definition is kvq_kernels::nearest_centroid_reference): one thread
// per sub-vector, the codebook copied once per threadgroup into threadgroup memory, the running
// minimum in registers, one u32 index written. Never the [N, centroids, sub] intermediate the
// seed's pure-MLX search allocated: memory is the input and the indices. Dispatch:
// kvq_kernels::metal::dispatch::nearest.
#include <metal_stdlib>
using namespace metal;

struct NearestParams {
  uint n;          // sub-vectors
  uint centroids;  // 1..256
  uint sub;        // sub-vector length, 1..8
};

kernel void kvq_nearest(device const float* x [[buffer(0)]],
                        device const float* codebook [[buffer(1)]],
                        device uint* out [[buffer(2)]],
                        constant NearestParams& p [[buffer(3)]],
                        uint gid [[thread_position_in_grid]],
                        uint tid [[thread_position_in_threadgroup]],
                        uint threads [[threads_per_threadgroup]]) {
  threadgroup float books[256 * 8];
  // Every thread helps copy (none returns before the barrier), then the ones past n stop.
  for (uint i = tid; i < p.centroids * p.sub; i += threads) books[i] = codebook[i];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (gid >= p.n) return;
  float v[8];
  for (uint k = 0; k < p.sub; k++) v[k] = x[gid * p.sub + k];
  float best = INFINITY;
  uint bi = 0;
  for (uint c = 0; c < p.centroids; c++) {
    float dist = 0.0f;
    for (uint k = 0; k < p.sub; k++) {
      const float e = v[k] - books[c * p.sub + k];
      dist = fma(e, e, dist);
    }
    if (dist < best) {
      best = dist;
      bi = c;
    }
  }
  out[gid] = bi;
}
