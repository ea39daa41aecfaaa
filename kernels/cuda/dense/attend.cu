// Fused decode attention over an fp16 KV cache (rows of D halves): the fp16 baseline's CUDA
// kernel, on the same flash-decoding skeleton as the compressed methods (no score matrix).
#include "../common/attend.cuh"

namespace kvq {

struct DenseParams {
  int unused;
};

__device__ inline void halves8(const uint8_t* p, float f[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
  for (int i = 0; i < 4; i++) {
    const float2 x = __half22float2(h[i]);
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}

// State: the query, [D][GB].
struct DenseKeys {
  using Params = DenseParams;
  __host__ __device__ static int state_floats(const Params&, int D, int GB) { return D * GB; }
  template <int GB>
  __device__ static void prepare(const Params&, const float* q, long long qh, int gb, int,
                                 float* st, int D, long long, int) {
    for (int i = threadIdx.x; i < D * GB; i += KVQ_THREADS) {
      int c = i / GB, g = i % GB;
      st[i] = g < gb ? q[g * qh + c] : 0.f;
    }
    __syncthreads();
  }
  template <int GB>
  __device__ static void score(const Params&, const float* st, const uint8_t* row, float s[GB],
                               int D, int part) {
#pragma unroll
    for (int g = 0; g < GB; g++) s[g] = 0.f;
    for (int c8 = part * D / 16; c8 < (part + 1) * D / 16; c8++) {
      float k[8];
      halves8(row + c8 * 16, k);
#pragma unroll
      for (int j = 0; j < 8; j++) fma_heads<GB>(st + (c8 * 8 + j) * GB, k[j], s);
    }
  }
};

struct DenseValues {
  using Params = DenseParams;
  __host__ __device__ static int state_floats(const Params&, int, int) { return 0; }
  __device__ static void prepare(const Params&, int, float*, int) {}
  template <int GB>
  __device__ static void accumulate(const Params&, const float*, const uint8_t* row,
                                    const float w[GB], float acc[GB][8], float[GB], int cg,
                                    int) {
    float v[8];
    halves8(row + cg * 16, v);
#pragma unroll
    for (int j = 0; j < 8; j++)
#pragma unroll
      for (int g = 0; g < GB; g++) acc[g][j] = fmaf(w[g], v[j], acc[g][j]);
  }
  __device__ static void finish(const Params&, const float*, int, float*, int, int) {}
};

}  // namespace kvq

KVQ_ATTEND_ALL(kvq_attend_dense, kvq::DenseKeys, kvq::DenseValues, 64)
KVQ_ATTEND_ALL(kvq_attend_dense, kvq::DenseKeys, kvq::DenseValues, 128)
KVQ_ATTEND_ALL(kvq_attend_dense, kvq::DenseKeys, kvq::DenseValues, 256)
