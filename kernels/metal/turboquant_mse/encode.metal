// Encode of TurboQuant-MSE and -RVQ (the Metal twin of kernels/cuda/turboquant_mse/encode.cu):
// one threadgroup of d threads per code row, thread c holding coordinate c. The norm by a
// threadgroup sum, the randomized Hadamard in threadgroup memory with the range-based
// butterfly (each pass reads both values before a barrier, writes after it), the scaling, the
// threshold search, and the indices packed LSB first after the f16 norm. Same float operations
// as crates/kvq-cache codec/turboquant/rotated.rs `encode`, in another summation order. Dispatch:
// kvq_kernels::metal::dispatch::encode_scalar.
#include <metal_stdlib>
using namespace metal;

struct ScalarEncodeParams {
  uint rows;   // code rows; row i belongs to kv head i / t
  uint t;      // rows per head
  uint d;      // head dim (64, 128 or 256), the threads of a threadgroup
  uint bits;   // index bits, 1..6
  uint cb;     // bytes per code row: 2 + d * bits / 8
  float sigma; // 1 / sqrt(d)
};

// Sum over the threadgroup's threads (a multiple of 32): simdgroup sums, then the simdgroups'
// partial sums through `red`. Every thread gets the total.
template <class TG>
inline float group_sum(float v, TG red, uint lane, uint sg, uint nsg) {
  const float s = simd_sum(v);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lane == 0) red[sg] = s;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float total = 0.0f;
  for (uint i = 0; i < nsg; i++) total += red[i];
  return total;
}

// u <- H u (the unnormalized Walsh-Hadamard transform) of one row, thread c owning u[c]
// (written by every thread before the call: the first pass reads its partner's).
template <class TG>
inline void fwht_row(TG u, uint c, uint d) {
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint h = 1; h < d; h <<= 1) {
    const bool upper = (c % (2 * h)) >= h;
    const uint partner = upper ? c - h : c + h;
    const float a = u[c];
    const float b = u[partner];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    u[c] = upper ? (b - a) : (a + b);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}

// One row's scalar code, thread c of the d holding coordinate xv: the norm, the rotation, the
// threshold search, the indices packed after the f16 norm into `o`, and `idx` (each thread's
// index, complete after the final barrier). Returns the norm (f32). `signs`: this head's.
template <class TGF, class TGU>
inline float scalar_encode_row(float xv, device const float* signs,
                               device const float* thresholds, device const uchar* code_of,
                               device uchar* o, uint d, uint bits, float sigma, uint c, uint lane,
                               uint sg, TGF u, TGU idx, TGF red) {
  const float norm = sqrt(group_sum(xv * xv, red, lane, sg, d / 32));
  u[c] = xv * signs[c];
  fwht_row(u, c, d);
  const float inv = norm > 0.0f ? 1.0f / (norm * sigma) : 0.0f;
  const float y = u[c] * rsqrt(float(d)) * inv;
  const uint nt = (1u << bits) - 1u;
  uint k = 0;
  for (uint j = 0; j < nt; j++) k += thresholds[j] < y ? 1u : 0u;
  idx[c] = code_of[k];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (c < d / 8) {
    ulong v = 0;
    for (uint j = 0; j < 8; j++) v |= ulong(idx[8 * c + j]) << (j * bits);
    for (uint b = 0; b < bits; b++) o[2 + c * bits + b] = uchar(v >> (8 * b));
  }
  if (c == 0) {
    const ushort h = as_type<ushort>(half(norm));
    o[0] = uchar(h & 0xff);
    o[1] = uchar(h >> 8);
  }
  return norm;
}

kernel void kvq_encode_scalar(device const float* x [[buffer(0)]],
                              device const float* signs [[buffer(1)]],
                              device const float* thresholds [[buffer(2)]],
                              device const uchar* code_of [[buffer(3)]],
                              device uchar* out [[buffer(4)]],
                              constant ScalarEncodeParams& p [[buffer(5)]],
                              uint c [[thread_position_in_threadgroup]],
                              uint row [[threadgroup_position_in_grid]],
                              uint lane [[thread_index_in_simdgroup]],
                              uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup float u[256];
  threadgroup uchar idx[256];
  threadgroup float red[8];
  if (row >= p.rows) return;
  const uint d = p.d;
  const uint head = row / p.t;
  scalar_encode_row(x[row * d + c], signs + head * d, thresholds, code_of, out + row * p.cb, d,
                    p.bits, p.sigma, c, lane, sg, u, idx, red);
}
