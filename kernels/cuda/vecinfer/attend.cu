// Fused decode attention of VecInfer: keys and values are one-byte centroid indices of d/sub
// sub-vectors (keys smoothed by 1/lambda and rotated, values rotated). Keys are scored through
// a per-query lookup table LUT[sub-position][head][centroid] built in shared memory; values are
// gathered from the codebooks (in shared memory when they fit, else through the read-only
// cache) and rotated back once per block.
#include "../turboquant_mse/scalar.cuh"
#include "params.cuh"

namespace kvq {

// State: LUT [D/sub][GB][256] | scratch [GB][D].
struct VqKeys {
  using Params = VqParams;
  __host__ __device__ static int state_floats(const Params& p, int D, int GB) {
    return (D / p.sub) * GB * 256 + GB * D;
  }
  template <int GB>
  __device__ static void prepare(const Params& p, const float* q, long long qh, int gb, int kh,
                                 float* st, int D, long long, int) {
    const int ns = D / p.sub, sub = p.sub;
    float* lut = st;
    float* x = st + ns * GB * 256;
    const float* lam = p.lambda + (long long)kh * D;
    for (int i = threadIdx.x; i < gb * D; i += KVQ_THREADS)
      x[i] = q[(i / D) * qh + i % D] * __ldg(lam + i % D);
    __syncthreads();
    forward_hadamard(x, gb, D, p.signs + (long long)kh * D, 1.f);
    for (int i = threadIdx.x; i < ns * 256; i += KVQ_THREADS) {
      const int s = i / 256, c = i % 256;
      const float* cen = p.books + ((long long)(p.nb == 1 ? 0 : s) * 256 + c) * sub;
      float cv[8];
      for (int k = 0; k < sub; k++) cv[k] = __ldg(cen + k);
#pragma unroll
      for (int g = 0; g < GB; g++) {
        float v = 0.f;
        if (g < gb)
          for (int k = 0; k < sub; k++) v = fmaf(x[g * D + s * sub + k], cv[k], v);
        lut[(s * GB + g) * 256 + c] = v;
      }
    }
    __syncthreads();
  }
  template <int GB>
  __device__ static void score(const Params& p, const float* st, const uint8_t* row, float s[GB],
                               int D, int part) {
    const int ns = D / p.sub;
#pragma unroll
    for (int g = 0; g < GB; g++) s[g] = 0.f;
    for (int k = part * ns / 2; k < (part + 1) * ns / 2; k++) {
      const float* l = st + k * GB * 256 + row[k];
#pragma unroll
      for (int g = 0; g < GB; g++) s[g] += l[g * 256];
    }
  }
};

// State: the codebooks when `books_in_smem`.
struct VqValues {
  using Params = VqParams;
  __host__ __device__ static int state_floats(const Params& p, int, int) {
    return p.books_in_smem ? p.nb * 256 * p.sub : 0;
  }
  __device__ static void prepare(const Params& p, int, float* st, int) {
    if (p.books_in_smem)
      for (int i = threadIdx.x; i < p.nb * 256 * p.sub; i += KVQ_THREADS) st[i] = __ldg(p.books + i);
  }
  template <int GB>
  __device__ static void accumulate(const Params& p, const float* st, const uint8_t* row,
                                    const float w[GB], float acc[GB][8], float[GB], int cg,
                                    int) {
    const int sub = p.sub;
    const float* books = p.books_in_smem ? st : p.books;
    float v[8];
    // The thread's 8 coordinates: two sub-vectors of 4 or one of 8.
    const int s0 = cg * 8 / sub;
#pragma unroll
    for (int k = 0; k < 8; k += 4) {
      const int s = s0 + k / sub;
      const int off = k % sub;
      const float4* c4 = reinterpret_cast<const float4*>(
          books + ((long long)(p.nb == 1 ? 0 : s) * 256 + row[s]) * sub + off);
      const float4 c = p.books_in_smem ? *c4 : __ldg(c4);
      v[k] = c.x;
      v[k + 1] = c.y;
      v[k + 2] = c.z;
      v[k + 3] = c.w;
    }
#pragma unroll
    for (int j = 0; j < 8; j++)
#pragma unroll
      for (int g = 0; g < GB; g++) acc[g][j] = fmaf(w[g], v[j], acc[g][j]);
  }
  __device__ static void finish(const Params& p, const float*, int kh, float* rows, int gb, int D) {
    inverse_hadamard(rows, gb, D, p.signs + (long long)kh * D);
  }
};

}  // namespace kvq

KVQ_ATTEND_ALL(kvq_attend_vq, kvq::VqKeys, kvq::VqValues, 64)
KVQ_ATTEND_ALL(kvq_attend_vq, kvq::VqKeys, kvq::VqValues, 128)
KVQ_ATTEND_ALL(kvq_attend_vq, kvq::VqKeys, kvq::VqValues, 256)
