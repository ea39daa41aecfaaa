// Gaussian sign sketches on CUDA (kvq-kernels spec.rs SketchSpec): the query's projection
// a = sqrt(pi/2)/m * S q, turned into one 16-entry table per nibble of a sign row and head, so a
// packed sign row is scored with one shared-memory load and one add per 4 signs and head
// (entries of a nibble's table sit in 16 distinct banks: lanes never conflict). Bit set = +a_i.
#pragma once
#include "attend.cuh"

namespace kvq {

constexpr float QJL_CONST = 1.2533141f;  // sqrt(pi / 2)

struct SketchParams {
  const float* mats;  // [kvh][D][m]: S transposed
  int m;
  const float* proj;  // [B][nh][T][m]: sqrt(pi/2)/m * S q of every query row (sketch_project)
};

// State layout: tables [m/4][GB][16] | a [GB][m].
__host__ __device__ inline int sketch_floats(int m, int, int GB) {
  return (m / 4) * GB * 16 + GB * m;
}

// The nibble tables of the block's GB heads from their projections (query rows prow,
// prow + pstride, ... of `proj`).
__device__ inline void sketch_prepare(const SketchParams& p, long long prow, int pstride, int gb,
                                      float* st, int, int GB) {
  const int m = p.m;
  float* tab = st;
  float* a = tab + (m / 4) * GB * 16;
  for (int i = threadIdx.x; i < gb * m; i += KVQ_THREADS)
    a[i] = p.proj[(prow + (long long)(i / m) * pstride) * m + i % m];
  __syncthreads();
  for (int i = threadIdx.x; i < (m / 4) * GB * 16; i += KVQ_THREADS) {
    const int n = i / (GB * 16), g = (i / 16) % GB, e = i % 16;
    float x = 0.f;
    if (g < gb) {
#pragma unroll
      for (int k = 0; k < 4; k++) {
        const float v = a[g * m + 4 * n + k];
        x += (e >> k) & 1 ? v : -v;
      }
    }
    tab[i] = x;
  }
  __syncthreads();
}

// Before the attention: proj[(b, h, t)] = sqrt(pi/2)/m * S_kh q for every query row, once (each
// attend block would otherwise re-read S, m x D floats, from L2). One block per row.
struct ProjectArgs {
  const float* q;  // as AttendArgs
  long long q_bstride, q_hstride, q_tstride;
  const float* mats;
  int m, nh, T, group;
  float* proj;
};

template <int D>
__device__ void sketch_project(const ProjectArgs& a) {
  __shared__ float qs[D];
  const long long row = blockIdx.x;  // (b*nh + h)*T + t
  const int t = (int)(row % a.T), h = (int)((row / a.T) % a.nh), b = (int)(row / a.T / a.nh);
  const float* q = a.q + b * a.q_bstride + h * a.q_hstride + t * a.q_tstride;
  for (int i = threadIdx.x; i < D; i += blockDim.x) qs[i] = q[i];
  __syncthreads();
  const float* S = a.mats + (long long)(h / a.group) * D * a.m;
  const float c = QJL_CONST / (float)a.m;
  for (int i = threadIdx.x; i < a.m; i += blockDim.x) {
    float x = 0.f;
#pragma unroll 8
    for (int j = 0; j < D; j++) x = fmaf(__ldg(S + (long long)j * a.m + i), qs[j], x);
    a.proj[row * a.m + i] = x * c;
  }
}

}  // namespace kvq

#define KVQ_SKETCH_PROJECT(D)                                                    \
  extern "C" __global__ void kvq_sketch_project_d##D(kvq::ProjectArgs a) {       \
    kvq::sketch_project<D>(a);                                                   \
  }

namespace kvq {

// s[g] = sqrt(pi/2)/m <S q_g, sign row>.
// `part` 0 or 1: the first or second half of the sign bytes.
template <int GB>
__device__ inline void sketch_dot(const float* tab, const uint8_t* signs, int m, float s[GB],
                                  int part) {
#pragma unroll
  for (int g = 0; g < GB; g++) s[g] = 0.f;
  const int nb = m / 8, half = (nb + 1) / 2;
  for (int j = part * half; j < min(nb, (part + 1) * half); j++) {
    const unsigned b = signs[j];
    const float* lo = tab + (2 * j) * GB * 16 + (b & 15);
    const float* hi = tab + (2 * j + 1) * GB * 16 + (b >> 4);
#pragma unroll
    for (int g = 0; g < GB; g++) s[g] += lo[g * 16] + hi[g * 16];
  }
}

}  // namespace kvq
