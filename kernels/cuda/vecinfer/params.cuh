// VecInfer's parameters on CUDA (kvq-kernels spec.rs VqSpec): the product quantizer's codebooks
// (f32, and an f16 copy made once at upload for the version-5 kernel), rotation signs and the
// keys' smoothing.
#pragma once
#include <cuda_fp16.h>

namespace kvq {

struct VqParams {
  const float* books;     // [nb][256][sub]
  const float* signs;     // [kvh][D]
  const float* lambda;    // [kvh][D] (keys only)
  int nb, sub;
  int books_in_smem;      // values: copy the codebooks to shared memory
  const __half* books16;  // [nb][256][sub] in f16
};

}  // namespace kvq
