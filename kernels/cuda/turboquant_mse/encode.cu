// Encode of TurboQuant-MSE and -RVQ (and the first stage of TurboQuant-Prod, through
// scalar_encode_row): one block of D threads per row. Norm by a block sum, the randomized
// Hadamard fused with the scaling and the threshold search in shared memory, indices packed
// LSB first. Same float operations as kvq-cache codec/turboquant/rotated.rs `encode`, in another
// summation order.
#include "../common/encode.cuh"

namespace kvq {

struct ScalarEncodeParams {
  const float* thresholds;  // 2^bits - 1, ascending
  const unsigned char* code_of;  // 2^bits
  const float* signs;       // [kvh][D]
  int bits;
  float sigma;
};

// Writes the scalar code of x (this thread's coordinate xv) to `out` (unless `write` is false:
// a block that shares the row with others, the same for the whole block); leaves the indices in
// `idx` and returns the f16-rounded norm (what decoding will use).
__device__ inline float scalar_encode_row(const ScalarEncodeParams& p, int head, float xv,
                                          float* u, uint8_t* idx, float* red, uint8_t* out,
                                          int D, bool write = true) {
  const int c = threadIdx.x;
  const float norm = sqrtf(block_sum(xv * xv, red));
  u[c] = xv * __ldg(p.signs + (long long)head * D + c);
  fwht_row(u, D);
  const float inv = norm > 0.f ? 1.f / (norm * p.sigma) : 0.f;
  const float y = u[c] * rsqrtf((float)D) * inv;
  const int nt = (1 << p.bits) - 1;
  int k = 0;
  for (int j = 0; j < nt; j++) k += __ldg(p.thresholds + j) < y;
  idx[c] = p.code_of[k];
  if (write) {
    pack_codes(idx, p.bits, D, out + 2);
    if (c == 0) store_f16(out, norm);
  }
  return __half2float(__float2half_rn(norm));
}

}  // namespace kvq

template <int D>
__device__ void scalar_encode(const kvq::EncodeArgs& a, const kvq::ScalarEncodeParams& p) {
  __shared__ float u[D];
  __shared__ uint8_t idx[D];
  __shared__ float red[32];
  const long long i = blockIdx.x;
  const int head = (int)(i / a.t);
  kvq::scalar_encode_row(p, head, kvq::enc_in(a, i, threadIdx.x, D), u, idx, red,
                         kvq::enc_out(a, i), D);
}

#define KVQ_SCALAR_ENCODE(D)                                                                 \
  extern "C" __global__ void kvq_encode_scalar_d##D(kvq::EncodeArgs a,                        \
                                                     kvq::ScalarEncodeParams p) {             \
    scalar_encode<D>(a, p);                                                                   \
  }

KVQ_SCALAR_ENCODE(64)
KVQ_SCALAR_ENCODE(128)
KVQ_SCALAR_ENCODE(256)
