// Fused decode attention of TurboQuant-MSE and TurboQuant-RVQ (one scalar codebook over rotated
// coordinates for keys and values; RVQ's two stages are one codebook of 2^(2b) levels): the
// entry points the Rust op launches. Keys and values of one bit width run the tensor-core kernel
// (mma.cuh, one per head dim and width); other pairs the CUDA-core one (one per head dim and
// heads per block).
#include "mma.cuh"
#include "scalar.cuh"

KVQ_ATTEND_ALL(kvq_attend_scalar, kvq::ScalarKeys, kvq::ScalarValues, 64)
KVQ_ATTEND_ALL(kvq_attend_scalar, kvq::ScalarKeys, kvq::ScalarValues, 128)
KVQ_ATTEND_ALL(kvq_attend_scalar, kvq::ScalarKeys, kvq::ScalarValues, 256)

KVQ_SCALAR_MMA_ALL(64, 4)
KVQ_SCALAR_MMA_ALL(128, KVQ_MMA_MINB128)
KVQ_SCALAR_MMA_ALL(256, 2)
