// Fused decode attention of QJL: keys are `||k_rest||` (f16), m/8 sign bytes and `outliers`
// exact channels (u8 index, then f16 values), scored as ||k_rest|| sqrt(pi/2)/m <S q, sign(S k)>
// plus the outliers' exact products; values are groupwise min/scale codes (2, 4 or 8 bits).
#include "params.cuh"

namespace kvq {

// State: the sketch's, then the query [D][GB] for the outlier channels.
struct QjlKeys {
  using Params = QjlKeyParams;
  __host__ __device__ static int state_floats(const Params& p, int D, int GB) {
    return sketch_floats(p.sketch.m, D, GB) + D * GB;
  }
  template <int GB>
  __device__ static void prepare(const Params& p, const float* q, long long qh, int gb, int,
                                 float* st, int D, long long prow, int pstride) {
    sketch_prepare(p.sketch, prow, pstride, gb, st, D, GB);
    float* qs = st + sketch_floats(p.sketch.m, D, GB);
    for (int i = threadIdx.x; i < D * GB; i += KVQ_THREADS) {
      int c = i / GB, g = i % GB;
      qs[i] = g < gb ? q[g * qh + c] : 0.f;
    }
    __syncthreads();
  }
  template <int GB>
  __device__ static void score(const Params& p, const float* st, const uint8_t* row, float s[GB],
                               int D, int part) {
    const int m = p.sketch.m;
    sketch_dot<GB>(st, row + 2, m, s, part);
    const float norm = f16_at(row);
#pragma unroll
    for (int g = 0; g < GB; g++) s[g] *= norm;
    const float* qs = st + sketch_floats(m, D, GB);
    const uint8_t* idx = row + 2 + m / 8;
    for (int o = 0; o < (part == 0 ? p.outliers : 0); o++) {
      const int c = idx[o];
      const float v = f16_at(idx + p.outliers + 2 * o);
      if (c < D) {
#pragma unroll
        for (int g = 0; g < GB; g++) s[g] = fmaf(qs[c * GB + g], v, s[g]);
      }
    }
  }
};

// Values: v = min + scale * code, decoded before weighting (as the CPU codec sums): summing
// p * scale * code and p * min apart cancels at the end, both sums being about a value's size
// while the output of many random values is ~1/sqrt(n) of one. `am` stays zero.
struct GroupValues {
  using Params = GroupParams;
  __host__ __device__ static int state_floats(const Params&, int, int) { return 0; }
  __device__ static void prepare(const Params&, int, float*, int) {}
  template <int GB>
  __device__ static void accumulate(const Params& p, const float*, const uint8_t* row,
                                    const float w[GB], float acc[GB][8], float /* am */[GB], int cg,
                                    int D) {
    const int bits = p.bits, groups = D / p.group;
    const int gi = (cg * 8) / p.group;
    const float scale = f16_at(row + 4 * gi), mn = f16_at(row + 4 * gi + 2);
    const unsigned long long v = bits <= 4 ? (unsigned long long)bytes_le32(row + 4 * groups + cg * bits, bits)
                                           : bytes_le(row + 4 * groups + cg * bits, bits);
    const unsigned mask = (1u << bits) - 1;
#pragma unroll
    for (int j = 0; j < 8; j++) {
      const unsigned code = (unsigned)(v >> (j * bits)) & mask;
      // Exact int -> float: 2^23 + code, minus 2^23.
      const float x = fmaf(scale, __uint_as_float(0x4B000000u | code) - 8388608.f, mn);
#pragma unroll
      for (int g = 0; g < GB; g++) acc[g][j] = fmaf(w[g], x, acc[g][j]);
    }
  }
  __device__ static void finish(const Params&, const float*, int, float*, int, int) {}
};

}  // namespace kvq

KVQ_SKETCH_PROJECT(64)
KVQ_SKETCH_PROJECT(128)
KVQ_SKETCH_PROJECT(256)
KVQ_ATTEND_ALL(kvq_attend_qjl, kvq::QjlKeys, kvq::GroupValues, 64)
KVQ_ATTEND_ALL(kvq_attend_qjl, kvq::QjlKeys, kvq::GroupValues, 128)
KVQ_ATTEND_ALL(kvq_attend_qjl, kvq::QjlKeys, kvq::GroupValues, 256)
