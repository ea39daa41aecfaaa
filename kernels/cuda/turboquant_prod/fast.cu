// Entry points of the version-5 fused decode attention (turboquant_mse/fast.cuh) for
// TurboQuant-Prod: a scalar stage of 1 to 3 bits plus the residual's sign sketch (m = d) for
// keys, values of the stage's width or one more. One launch per layer and decode step.
#include "../turboquant_mse/fast.cuh"
#include "params.cuh"

#define KVQ_FAST_PROD(D, KB, VB)                                                              \
  extern "C" __global__ void __launch_bounds__(KVQ_FAST_NW(D) * 32, 1)                        \
      kvq_fast_prod_d##D##_k##KB##_v##VB(kvq::AttendArgs a, kvq::ProdParams kp,             \
                                         kvq::ScalarParams vp, kvq::FastArgs f) {           \
    extern __shared__ __align__(16) uint8_t kvq_smem[];                                       \
    kvq::fast_entry<D, KB, VB, true, KVQ_FAST_NW(D)>(a, kp, vp, f, kvq_smem);                 \
  }

#define KVQ_FAST_PROD_ALL(D) \
  KVQ_FAST_PROD(D, 1, 1)     \
  KVQ_FAST_PROD(D, 1, 2)     \
  KVQ_FAST_PROD(D, 2, 2)     \
  KVQ_FAST_PROD(D, 2, 3)     \
  KVQ_FAST_PROD(D, 3, 3)     \
  KVQ_FAST_PROD(D, 3, 4)

KVQ_FAST_PROD_ALL(64)
KVQ_FAST_PROD_ALL(128)
KVQ_FAST_PROD_ALL(256)
