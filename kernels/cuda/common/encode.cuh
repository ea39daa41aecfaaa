// Helpers the encode kernels share: one block of D threads per code row (row i of head i / t),
// block-wide sums, the forward/inverse randomized Hadamard of one row in shared memory
// (range-based butterflies), and sign packing with warp ballots.
#pragma once
#include <cuda_fp16.h>
#include <stdint.h>

namespace kvq {

struct EncodeArgs {
  const float* x;   // [rows][D] f32, row i belongs to head i / t
  long long rows;
  int t;
  uint8_t* out;     // row i at out + (i / t) * out_hstride + (i % t) * cb
  int cb;
  long long out_hstride;  // bytes between heads' rows (t * cb: [rows][cb] contiguous)
  const float* mu;        // [heads][D]: the input is f16(x) - mu (a centered cache's keys), or null
};

// Coordinate c of input row i, centered when the launch gives a center (the f16 rounding and
// subtraction kvq-cache center.rs applies to keys before they are coded).
__device__ inline float enc_in(const EncodeArgs& a, long long i, int c, int D) {
  const float x = a.x[i * D + c];
  if (a.mu == nullptr) return x;
  return __half2float(__float2half_rn(x)) - __ldg(a.mu + (i / a.t) * D + c);
}

// Code row i.
__device__ inline uint8_t* enc_out(const EncodeArgs& a, long long i) {
  return a.out + (i / a.t) * a.out_hstride + (i % a.t) * a.cb;
}

// Sum over the block's D threads (D a multiple of 32, <= 1024); every thread gets the result.
__device__ inline float block_sum(float v, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int w = threadIdx.x / 32, nw = blockDim.x / 32;
  __syncthreads();
  if ((threadIdx.x & 31) == 0) red[w] = v;
  __syncthreads();
  float s = 0.f;
  for (int i = 0; i < nw; i++) s += red[i];
  return s;
}

// u <- H u (unnormalized Walsh-Hadamard) of one row of D values, D threads.
__device__ inline void fwht_row(float* u, int D) {
  const int c = threadIdx.x;
  for (int h = 1; h < D; h <<= 1) {
    __syncthreads();
    if (c < D / 2) {
      const int lo = (c / h) * 2 * h + (c % h);
      const float a = u[lo], b = u[lo + h];
      u[lo] = a + b;
      u[lo + h] = a - b;
    }
  }
  __syncthreads();
}

// The f16 bits of v, little endian. The bits pass through an opaque move: with a plain
// `p[0] = bits & 0xff` the compiler turned "convert to f16, store its low byte" into a float to
// u8 conversion (the H200 stored trunc(v) as the low byte; kernels/cuda/README.md).
__device__ inline void store_f16(uint8_t* p, float v) {
  const unsigned short h = __half_as_ushort(__float2half_rn(v));
  unsigned int w;
  asm volatile("cvt.u32.u16 %0, %1;" : "=r"(w) : "h"(h));
  p[0] = (uint8_t)(w & 0xffu);
  p[1] = (uint8_t)(w >> 8);
}

__device__ inline float load_f16(const uint8_t* p) {
  return __half2float(__ushort_as_half((unsigned short)(p[0] | (p[1] << 8))));
}

// Packs the `bits`-bit codes idx[0..D) (shared memory) LSB first into `out`: thread c < D/8
// writes the `bits` bytes of codes 8c..8c+8.
__device__ inline void pack_codes(const uint8_t* idx, int bits, int D, uint8_t* out) {
  __syncthreads();
  const int c = threadIdx.x;
  if (c < D / 8) {
    unsigned long long v = 0;
    for (int j = 0; j < 8; j++) v |= (unsigned long long)idx[8 * c + j] << (j * bits);
    for (int k = 0; k < bits; k++) out[c * bits + k] = (v >> (8 * k)) & 0xff;
  }
}

// Signs of proj = S r (m values; S transposed [D][m], r in shared memory) for the sketch rows
// 32 * blockIdx.y .. + 31 (a launch takes ceil(m / 32) slices in y), packed with one warp ballot:
// bit i set when proj_i >= 0 (kvq-cache sketch.rs pack_signs). Lane l of warp w sums row
// 32y + l over coordinates 32w .. 32w + 31 (32 independent loads, coalesced across the lanes),
// and warp 0 adds the warps' partial sums in a fixed order. So a one-token step reads S with
// ceil(m / 32) blocks per row, not with one block's warps one row of S at a time.
__device__ inline void sketch_signs(const float* S, const float* r, int D, int m, uint8_t* out) {
  __shared__ float part[8][32];  // D <= 256: at most 8 warps
  __syncthreads();
  const int lane = threadIdx.x & 31, w = threadIdx.x / 32, nw = blockDim.x / 32;
  const int base = blockIdx.y * 32, i = base + lane;
  float p = 0.f;
  if (i < m) {
    const float* s = S + (long long)(w * 32) * m + i;
    const float* rw = r + w * 32;
#pragma unroll
    for (int j = 0; j < 32; j++) p = fmaf(__ldg(s + (long long)j * m), rw[j], p);
  }
  part[w][lane] = p;
  __syncthreads();
  if (w == 0) {
    float sum = 0.f;
    for (int k = 0; k < nw; k++) sum += part[k][lane];
    const unsigned bits = __ballot_sync(0xffffffffu, i < m && sum >= 0.f);
    if (lane == 0 && base < m) {
      const int nbytes = min(4, (m - base) / 8);
      for (int k = 0; k < nbytes; k++) out[base / 8 + k] = (bits >> (8 * k)) & 0xff;
    }
  }
}

}  // namespace kvq
