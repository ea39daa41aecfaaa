// VecInfer's encode kernels. `kvq_nearest_s{4,8}`: the fused nearest-centroid argmin, one
// thread per sub-vector, the 256 centroids in shared memory, the running minimum in registers
// (never an [N, centroids, sub] intermediate; O(N) memory: the input and the indices).
// `kvq_encode_vq_d{D}`: a key (divided by lambda) or value rotated in shared memory, then each
// of its D/sub sub-vectors coded against its sub-position's codebook by a warp (`vq_search`).
#include "../common/encode.cuh"

namespace kvq {

// Index of the centroid nearest to x among `books` (`[256][S]`, shared or global).
template <int S>
__device__ inline unsigned nearest(const float* x, const float* books) {
  float best = INFINITY;
  unsigned bi = 0;
  for (int c = 0; c < 256; c++) {
    float d = 0.f;
#pragma unroll
    for (int k = 0; k < S; k++) {
      const float e = x[k] - books[c * S + k];
      d = fmaf(e, e, d);
    }
    if (d < best) {
      best = d;
      bi = c;
    }
  }
  return bi;
}

// S floats from global memory at `p` (16-byte aligned), in 16-byte loads.
template <int S>
__device__ inline void ldg_floats(const float* p, float v[S]) {
  const float4* p4 = reinterpret_cast<const float4*>(p);
#pragma unroll
  for (int k = 0; k < S / 4; k++) {
    const float4 f = __ldg(p4 + k);
    v[4 * k] = f.x;
    v[4 * k + 1] = f.y;
    v[4 * k + 2] = f.z;
    v[4 * k + 3] = f.w;
  }
}

}  // namespace kvq

template <int S>
__device__ void nearest_all(const float* x, long long n, const float* centroids, unsigned* out) {
  __shared__ float books[256 * S];
  for (int i = threadIdx.x; i < 256 * S; i += blockDim.x) books[i] = centroids[i];
  __syncthreads();
  for (long long r = blockIdx.x * (long long)blockDim.x + threadIdx.x; r < n;
       r += (long long)gridDim.x * blockDim.x) {
    float v[S];
    kvq::ldg_floats<S>(x + r * S, v);
    out[r] = kvq::nearest<S>(v, books);
  }
}

extern "C" __global__ void kvq_nearest_s4(const float* x, long long n, const float* c,
                                          unsigned* out) {
  nearest_all<4>(x, n, c, out);
}

extern "C" __global__ void kvq_nearest_s8(const float* x, long long n, const float* c,
                                          unsigned* out) {
  nearest_all<8>(x, n, c, out);
}

struct VqEncodeParams {
  const float* books;   // [nb][256][sub]
  const float* signs;   // [kvh][D]
  const float* lambda;  // [kvh][D], or null (values)
  int nb, sub;
};

// The nearest centroid of each of the row's D/S sub-vectors (u, rotated, in shared memory) in
// its sub-position's codebook: warp w takes sub-vectors w, w + D/32, ...; lane l scores centroids
// l, l + 32, ..., l + 224 (coalesced 16-byte loads, all in flight at once), then the warp's
// argmin by shuffles, ties to the lowest index: the centroid `kvq::nearest` picks, found by 32
// lanes instead of one thread walking 256 centroids (a decode step codes one token per head, so
// that walk's latency was the step's cost).
template <int D, int S>
__device__ inline void vq_search(const float* u, const VqEncodeParams& p, uint8_t* out) {
  const int lane = threadIdx.x & 31;
  for (int s = threadIdx.x / 32; s < D / S; s += D / 32) {
    const float* book = p.books + (long long)(p.nb == 1 ? 0 : s) * 256 * S;
    float x[S];
#pragma unroll
    for (int k = 0; k < S; k++) x[k] = u[s * S + k];
    float best = INFINITY;
    unsigned bi = 0;
#pragma unroll
    for (int r = 0; r < 8; r++) {
      const unsigned c = r * 32 + lane;
      float e[S];
      kvq::ldg_floats<S>(book + c * S, e);
      float d = 0.f;
#pragma unroll
      for (int k = 0; k < S; k++) {
        const float v = x[k] - e[k];
        d = fmaf(v, v, d);
      }
      if (d < best) {
        best = d;
        bi = c;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ob = __shfl_xor_sync(0xffffffffu, best, o);
      const unsigned oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (ob < best || (ob == best && oi < bi)) {
        best = ob;
        bi = oi;
      }
    }
    if (lane == 0) out[s] = (uint8_t)bi;
  }
}

template <int D>
__device__ void vq_encode(const kvq::EncodeArgs& a, const VqEncodeParams& p) {
  __shared__ float u[D];
  const long long i = blockIdx.x;
  const int head = (int)(i / a.t), c = threadIdx.x;
  float xv = kvq::enc_in(a, i, c, D);
  if (p.lambda) xv *= 1.f / __ldg(p.lambda + (long long)head * D + c);
  u[c] = xv * __ldg(p.signs + (long long)head * D + c);
  kvq::fwht_row(u, D);
  u[c] *= rsqrtf((float)D);
  __syncthreads();
  if (p.sub == 4)
    vq_search<D, 4>(u, p, kvq::enc_out(a, i));
  else
    vq_search<D, 8>(u, p, kvq::enc_out(a, i));
}

#define KVQ_VQ_ENCODE(D)                                                                     \
  extern "C" __global__ void kvq_encode_vq_d##D(kvq::EncodeArgs a, VqEncodeParams p) {        \
    vq_encode<D>(a, p);                                                                       \
  }

KVQ_VQ_ENCODE(64)
KVQ_VQ_ENCODE(128)
KVQ_VQ_ENCODE(256)
