// Fused decode attention of TurboQuant-Prod: keys are a (b-1)-bit scalar-codebook stage plus a
// sign sketch of its residual (`||r||` f16, m/8 sign bytes after the stage's code), scored as
// stage(q) + ||r|| * sqrt(pi/2)/m <S q, sign(S r)>; values are the scalar codebook of
// TurboQuant-MSE. The tensor-core kernel (turboquant_mse/mma.cuh with the sketch term) runs the
// stage / value widths instantiated below; other pairs run the CUDA-core kernel.
#include "../turboquant_mse/mma.cuh"
#include "params.cuh"

namespace kvq {

// State: the scalar stage's state, then the sketch's.
struct ProdKeys {
  using Params = ProdParams;
  __host__ __device__ static int state_floats(const Params& p, int D, int GB) {
    return ScalarKeys::state_floats(p.scalar, D, GB) + sketch_floats(p.sketch.m, D, GB);
  }
  template <int GB>
  __device__ static void prepare(const Params& p, const float* q, long long qh, int gb, int kh,
                                 float* st, int D, long long prow, int pstride) {
    ScalarKeys::prepare_rotated(p.scalar, q, qh, gb, kh, st, D, GB);
    sketch_prepare(p.sketch, prow, pstride, gb, st + ScalarKeys::state_floats(p.scalar, D, GB), D, GB);
  }
  template <int GB>
  __device__ static void score(const Params& p, const float* st, const uint8_t* row, float s[GB],
                               int D, int part) {
    ScalarKeys::score<GB>(p.scalar, st, row, s, D, part);
    const int at = 2 + D * p.scalar.bits / 8;
    const float rnorm = f16_at(row + at);
    float r[GB];
    sketch_dot<GB>(st + ScalarKeys::state_floats(p.scalar, D, GB), row + at + 2, p.sketch.m, r,
                   part);
#pragma unroll
    for (int g = 0; g < GB; g++) s[g] = fmaf(rnorm, r[g], s[g]);
  }
};

}  // namespace kvq

KVQ_SKETCH_PROJECT(64)
KVQ_SKETCH_PROJECT(128)
KVQ_SKETCH_PROJECT(256)
KVQ_ATTEND_ALL(kvq_attend_prod, kvq::ProdKeys, kvq::ScalarValues, 64)
KVQ_ATTEND_ALL(kvq_attend_prod, kvq::ProdKeys, kvq::ScalarValues, 128)
KVQ_ATTEND_ALL(kvq_attend_prod, kvq::ProdKeys, kvq::ScalarValues, 256)

#define KVQ_PROD_MMA_ENTRY(D, KB, VB, MINB)                                                   \
  extern "C" __global__ void __launch_bounds__(KVQ_THREADS, MINB)                             \
      kvq_attend_prod_mma_d##D##_k##KB##_v##VB(kvq::AttendArgs a, kvq::ProdParams kp,        \
                                               kvq::ScalarParams vp, kvq::AttendArgs xa,     \
                                               int extra) {                                  \
    extern __shared__ __align__(16) uint8_t kvq_smem[];                                       \
    kvq::attend_scalar_mma_entry<D, KB, VB, true>(a, kp, vp, xa, extra, kvq_smem);            \
  }

// (stage bits, value bits): the value width equal to the stage's or to the key bits.
#define KVQ_PROD_MMA_ALL(D, MINB)     \
  KVQ_PROD_MMA_ENTRY(D, 1, 1, MINB)   \
  KVQ_PROD_MMA_ENTRY(D, 1, 2, MINB)   \
  KVQ_PROD_MMA_ENTRY(D, 2, 2, MINB)   \
  KVQ_PROD_MMA_ENTRY(D, 2, 3, MINB)   \
  KVQ_PROD_MMA_ENTRY(D, 3, 3, MINB)   \
  KVQ_PROD_MMA_ENTRY(D, 3, 4, MINB)   \
  KVQ_PROD_MMA_ENTRY(D, 4, 4, MINB)   \
  KVQ_PROD_MMA_ENTRY(D, 4, 5, MINB)

KVQ_PROD_MMA_ALL(64, 4)
KVQ_PROD_MMA_ALL(128, 4)
KVQ_PROD_MMA_ALL(256, 2)
