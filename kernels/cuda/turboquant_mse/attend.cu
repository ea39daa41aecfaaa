// Fused decode attention of TurboQuant-MSE and TurboQuant-RVQ (one scalar codebook over rotated
// coordinates for keys and values; RVQ's two stages are one codebook of 2^(2b) levels): the
// entry points the Rust op launches, one per head dim and heads-per-block.
#include "scalar.cuh"

KVQ_ATTEND_ALL(kvq_attend_scalar, kvq::ScalarKeys, kvq::ScalarValues, 64)
KVQ_ATTEND_ALL(kvq_attend_scalar, kvq::ScalarKeys, kvq::ScalarValues, 128)
KVQ_ATTEND_ALL(kvq_attend_scalar, kvq::ScalarKeys, kvq::ScalarValues, 256)
