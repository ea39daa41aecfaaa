// TurboQuant's scalar-codebook stage on CUDA (kvq-kernels spec.rs ScalarSpec): code rows are an
// f16 norm then D indices of `bits` bits packed LSB first (8 indices fill `bits` bytes). Keys are
// scored against the query rotated once per block; values are summed in the rotated domain and
// rotated back once per block. TurboQuant-MSE and -RVQ run these policies as they are;
// TurboQuant-Prod scores its first stage with them.
#pragma once
#include "../common/attend.cuh"

namespace kvq {

// In-place forward randomized Hadamard of `gb` rows of D floats in shared memory: x <- H diag(s) x
// / sqrt(D) times `post` (kvq-cache hadamard.rs `apply`).
__device__ inline void forward_hadamard(float* rows, int gb, int D, const float* signs, float post) {
  for (int i = threadIdx.x; i < gb * D; i += KVQ_THREADS) rows[i] *= __ldg(signs + i % D);
  __syncthreads();
  butterflies(rows, gb, D);
  const float sc = rsqrtf((float)D) * post;
  for (int i = threadIdx.x; i < gb * D; i += KVQ_THREADS) rows[i] *= sc;
  __syncthreads();
}

struct ScalarParams {
  const float* levels;  // 2^bits unit-variance levels, code order
  const float* signs;   // [kvh][D]
  int bits;
  float sigma;
  float lev;  // the fast kernels' f16 tables hold levels * lev (chosen to round nearly exactly)
};

// Scores: state = [D][GB] query rotated times sigma, then [GB][D] scratch, then 64 levels.
struct ScalarKeys {
  using Params = ScalarParams;
  __host__ __device__ static int state_floats(const Params&, int D, int GB) {
    return 2 * D * GB + 64;
  }
  template <int GB>
  __device__ static void prepare(const Params& p, const float* q, long long qh, int gb, int kh,
                                 float* st, int D, long long, int) {
    prepare_rotated(p, q, qh, gb, kh, st, D, GB);
  }
  // Shared by Prod: `GB` is the attend template's heads per block.
  __device__ static void prepare_rotated(const Params& p, const float* q, long long qh, int gb,
                                         int kh, float* st, int D, int GB) {
    float* scratch = st + D * GB;
    float* lv = scratch + D * GB;
    for (int i = threadIdx.x; i < gb * D; i += KVQ_THREADS)
      scratch[i] = q[(i / D) * qh + i % D];
    for (int i = threadIdx.x; i < (1 << p.bits); i += KVQ_THREADS) lv[i] = p.levels[i];
    __syncthreads();
    forward_hadamard(scratch, gb, D, p.signs + (long long)kh * D, p.sigma);
    for (int i = threadIdx.x; i < D * GB; i += KVQ_THREADS) {
      int c = i / GB, g = i % GB;
      st[i] = g < gb ? scratch[g * D + c] : 0.f;
    }
    __syncthreads();
  }
  // Coordinates of `part` (0 or 1: the first or second half).
  template <int GB>
  __device__ static void dot(const Params& p, const float* st, const uint8_t* idx, float s[GB],
                             int D, int part) {
    const float* lv = st + 2 * D * GB;
    const int bits = p.bits;
    const unsigned mask = (1u << bits) - 1;
#pragma unroll
    for (int g = 0; g < GB; g++) s[g] = 0.f;
    // Up to 4 bits, the 8 indices of a group fit one 32-bit word (cheaper shifts).
    if (bits <= 4) {
      for (int grp = part * D / 16; grp < (part + 1) * D / 16; grp++) {
        const unsigned v = bytes_le32(idx + grp * bits, bits);
#pragma unroll
        for (int j = 0; j < 8; j++) {
          const float L = lv[(v >> (j * bits)) & mask];
          fma_heads<GB>(st + (grp * 8 + j) * GB, L, s);
        }
      }
      return;
    }
    for (int grp = part * D / 16; grp < (part + 1) * D / 16; grp++) {
      const unsigned long long v = bytes_le(idx + grp * bits, bits);
#pragma unroll
      for (int j = 0; j < 8; j++) {
        const float L = lv[(v >> (j * bits)) & mask];
        fma_heads<GB>(st + (grp * 8 + j) * GB, L, s);
      }
    }
  }
  template <int GB>
  __device__ static void score(const Params& p, const float* st, const uint8_t* row, float s[GB],
                               int D, int part) {
    dot<GB>(p, st, row + 2, s, D, part);
    const float norm = f16_at(row);
#pragma unroll
    for (int g = 0; g < GB; g++) s[g] *= norm;
  }
};

// Values: state = 64 levels times sigma.
struct ScalarValues {
  using Params = ScalarParams;
  __host__ __device__ static int state_floats(const Params&, int, int) { return 64; }
  __device__ static void prepare(const Params& p, int, float* st, int) {
    for (int i = threadIdx.x; i < (1 << p.bits); i += KVQ_THREADS) st[i] = p.levels[i] * p.sigma;
  }
  template <int GB>
  __device__ static void accumulate(const Params& p, const float* st, const uint8_t* row,
                                    const float w[GB], float acc[GB][8], float[GB], int cg,
                                    int) {
    const int bits = p.bits;
    const unsigned mask = (1u << bits) - 1;
    const float norm = f16_at(row);
    float wn[GB];
#pragma unroll
    for (int g = 0; g < GB; g++) wn[g] = w[g] * norm;
    if (bits <= 4) {
      const unsigned v = bytes_le32(row + 2 + cg * bits, bits);
#pragma unroll
      for (int j = 0; j < 8; j++) {
        const float L = st[(v >> (j * bits)) & mask];
#pragma unroll
        for (int g = 0; g < GB; g++) acc[g][j] = fmaf(wn[g], L, acc[g][j]);
      }
      return;
    }
    const unsigned long long v = bytes_le(row + 2 + cg * bits, bits);
#pragma unroll
    for (int j = 0; j < 8; j++) {
      const float L = st[(v >> (j * bits)) & mask];
#pragma unroll
      for (int g = 0; g < GB; g++) acc[g][j] = fmaf(wn[g], L, acc[g][j]);
    }
  }
  __device__ static void finish(const Params& p, const float*, int kh, float* rows, int gb, int D) {
    inverse_hadamard(rows, gb, D, p.signs + (long long)kh * D);
  }
};

}  // namespace kvq
