// VecInfer's encode kernels: `kvq_nearest` (below) and `kvq_encode_vq` (after it), compiled
// after kernels/metal/turboquant_mse/encode.metal, whose `fwht_row` the second uses.
//
// The fused nearest-centroid argmin (the Metal twin of kernels/cuda/vecinfer/encode.cu
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

// Encode of VecInfer rows (the Metal twin of kernels/cuda/vecinfer/encode.cu; the CPU definition
// is crates/kvq-cache vecinfer/codec.rs `encode`): one threadgroup of d threads per row, thread c
// holding coordinate c. Keys are smoothed (x / lambda), then rotated (x <- H diag(signs) x /
// sqrt(d)) with kernels/metal/turboquant_mse/encode.metal's range-based butterfly (this file is
// compiled after that one, as one library); then one thread per sub-vector finds its nearest
// centroid with the running minimum in registers and writes the byte. Dispatch:
// kvq_kernels::metal::dispatch::encode_vq.
struct VqEncodeParams {
  uint rows;    // code rows; row i belongs to kv head i / t
  uint t;       // rows per head
  uint d;       // head dim (64, 128 or 256), the threads of a threadgroup
  uint sub;     // sub-vector length, 4 or 8; the row is d / sub bytes
  uint books;   // 1 (shared) or d / sub (one per sub-position), each [256][sub]
  uint smooth;  // 1: divide by lambda first (keys)
};

kernel void kvq_encode_vq(device const float* x [[buffer(0)]],
                          device const float* signs [[buffer(1)]],
                          device const float* lambda [[buffer(2)]],
                          device const float* books [[buffer(3)]],
                          device uchar* out [[buffer(4)]],
                          constant VqEncodeParams& p [[buffer(5)]],
                          uint c [[thread_position_in_threadgroup]],
                          uint row [[threadgroup_position_in_grid]]) {
  threadgroup float u[256];
  if (row >= p.rows || p.sub == 0 || p.sub > 8) return;
  const uint d = p.d, head = row / p.t;
  const float xv = x[row * d + c];
  u[c] = (p.smooth != 0 ? xv / lambda[head * d + c] : xv) * signs[head * d + c];
  fwht_row(u, c, d);
  const float y = u[c] * rsqrt(float(d));
  threadgroup_barrier(mem_flags::mem_threadgroup);
  u[c] = y;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (c >= d / p.sub) return;
  float v[8];
  for (uint k = 0; k < p.sub; k++) v[k] = u[c * p.sub + k];
  device const float* book = books + (p.books == 1 ? 0ul : ulong(c) * 256 * p.sub);
  float best = INFINITY;
  uint bi = 0;
  for (uint j = 0; j < 256; j++) {
    float dist = 0.0f;
    for (uint k = 0; k < p.sub; k++) {
      const float e = v[k] - book[j * p.sub + k];
      dist = fma(e, e, dist);
    }
    if (dist < best) {
      best = dist;
      bi = j;
    }
  }
  out[row * (d / p.sub) + c] = uchar(bi);
}
