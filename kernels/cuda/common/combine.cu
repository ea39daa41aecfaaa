// The split-merge kernel every method's decode attention ends with (see attend.cuh): one block
// per (query row, head), D threads.
#include "attend.cuh"

#define KVQ_COMBINE(D)                                                   \
  extern "C" __global__ void kvq_combine_d##D(kvq::CombineArgs a) {      \
    kvq::combine_block<D>(a);                                            \
  }

KVQ_COMBINE(64)
KVQ_COMBINE(128)
KVQ_COMBINE(256)

// Keeps one block busy for `cycles` clock cycles: benchmarks launch it before a timed batch so
// the GPU runs the batch back to back while the host is still enqueueing it.
extern "C" __global__ void kvq_spin(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}
