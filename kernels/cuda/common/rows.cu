// Stores the f32 rows of one append ([heads][t][D] keys and values) as f16 into a cache's device
// row buffers in place (the fp16 window of a compressed cache): both in one launch, one block
// per (row, keys or values), two coordinates per thread.
#include <cuda_fp16.h>
#include <stdint.h>

namespace kvq {

struct RowsArgs {
  const float* k;  // [heads][t][D]
  const float* v;
  __half* dk;      // row (h, j) at dk + h * hstride_k + (row0 + j) * D
  __half* dv;
  long long hstride_k, hstride_v;  // halves between heads
  long long row0;
  int t, D;
};

}  // namespace kvq

extern "C" __global__ void kvq_store_rows_f16(kvq::RowsArgs a) {
  const long long r = blockIdx.x;  // h * t + j
  const long long h = r / a.t, j = r % a.t;
  const bool keys = blockIdx.y == 0;
  const float* src = (keys ? a.k : a.v) + r * a.D;
  __half* dst = (keys ? a.dk : a.dv) + h * (keys ? a.hstride_k : a.hstride_v) + (a.row0 + j) * a.D;
  for (int c = 2 * threadIdx.x; c < a.D; c += 2 * blockDim.x) {
    const float2 x = *reinterpret_cast<const float2*>(src + c);
    *reinterpret_cast<__half2*>(dst + c) = __floats2half2_rn(x.x, x.y);
  }
}
