// Entry points of the version-5 fused decode attention (fast.cuh) for TurboQuant-MSE and -RVQ:
// keys and values of one scalar-codebook width, 1 to 4 bits, head dims 64, 128 and 256. One
// launch per layer and decode step: code splits, exact fp16 rows and the split merge.
#include "fast.cuh"

#define KVQ_FAST_SCALAR(D, B)                                                                 \
  extern "C" __global__ void __launch_bounds__(KVQ_FAST_NW(D) * 32, 1)                        \
      kvq_fast_scalar_d##D##_b##B(kvq::AttendArgs a, kvq::ScalarParams kp,                  \
                                  kvq::ScalarParams vp, kvq::FastArgs f) {                  \
    extern __shared__ __align__(16) uint8_t kvq_smem[];                                       \
    kvq::fast_entry<D, B, B, false, KVQ_FAST_NW(D)>(a, kp, vp, f, kvq_smem);                  \
  }

#define KVQ_FAST_SCALAR_ALL(D) \
  KVQ_FAST_SCALAR(D, 1)        \
  KVQ_FAST_SCALAR(D, 2)        \
  KVQ_FAST_SCALAR(D, 3)        \
  KVQ_FAST_SCALAR(D, 4)

KVQ_FAST_SCALAR_ALL(64)
KVQ_FAST_SCALAR_ALL(128)
KVQ_FAST_SCALAR_ALL(256)
