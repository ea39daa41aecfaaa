// The split merge every method's Metal decode attention ends with (the twin of
// kernels/cuda/common/combine.cu): the n_splits partial rows [d outputs, max, sum] of one
// (query head, query row) merged into one, weighted by exp(max_s - max) so no exponential can
// overflow; with `normalize` the first d slots hold the attention output (divided by the sum).
// One threadgroup of 128 threads per row; every thread sums its coordinates over the splits in
// split order. Dispatch: kvq_kernels::metal::dispatch::attend_scalar (its `combine`).
// The merge itself is `merge_splits`, which the attention kernels also run in their last split
// threadgroup (`merge_if_last`) where the library is compiled for MSL 3.2: the attention
// libraries are this file followed by theirs (kvq-kernels metal/backend.rs).
#include <metal_stdlib>
using namespace metal;

#define KVQ_COMBINE_THREADS 128
#define KVQ_COMBINE_MAX_SPLITS 1024

// MSL 3.2 (macOS 15, iOS 18) has device-scope fences and `coherent(device)` buffers: the memory
// ordering between the threadgroups of one dispatch that a last-threadgroup merge needs.
#if __METAL_VERSION__ >= 320
#define KVQ_CAN_MERGE 1
#define KVQ_COHERENT coherent(device)
#else
#define KVQ_COHERENT
#endif

// The merge of the `n_splits` partial rows [d outputs, max, sum] at `pr` into `o`, weighted by
// exp(max_s - max); with `normalize` the first d slots hold the output divided by the sum. Run by
// all KVQ_COMBINE_THREADS threads of a threadgroup; `wgt` holds n_splits floats, `mred` one per
// simdgroup.
template <class P, class TG>
inline void merge_splits(P pr, device float* o, uint n_splits, uint d, uint normalize, uint tid,
                         uint lane, uint sg, TG wgt, TG mred) {
  const uint width = d + 2;
  float m = -INFINITY;
  for (uint s = tid; s < n_splits; s += KVQ_COMBINE_THREADS) m = max(m, pr[s * width + d]);
  m = simd_max(m);
  if (lane == 0) mred[sg] = m;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  m = mred[0];
  for (uint i = 1; i < KVQ_COMBINE_THREADS / 32; i++) m = max(m, mred[i]);
  // An empty split (max -inf) weighs nothing; so does everything when all are empty.
  for (uint s = tid; s < n_splits; s += KVQ_COMBINE_THREADS) {
    const float ms = pr[s * width + d];
    wgt[s] = ms == -INFINITY ? 0.0f : exp(ms - m);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float l = 0.0f;
  for (uint s = 0; s < n_splits; s++) l = fma(wgt[s], pr[s * width + d + 1], l);
  for (uint j = tid; j < d; j += KVQ_COMBINE_THREADS) {
    float x = 0.0f;
    for (uint s = 0; s < n_splits; s++) x = fma(wgt[s], pr[s * width + j], x);
    o[j] = normalize != 0 ? (l > 0.0f ? x / l : 0.0f) : x;
  }
  if (tid == 0) {
    o[d] = m;
    o[d + 1] = l;
  }
}

// The end of an attention threadgroup that wrote the partial rows of query heads [h0, h0 + gb)
// of query row t (one split of n_splits), when the host asked for the merge: the threadgroup
// publishes its rows device-wide and counts itself in on `counter` (one per query row, kv head
// and head chunk, zero before the dispatch); the last of the splits to arrive merges all of them
// into out [nh][T][d + 2] (unnormalized, as kvq_combine does). One dispatch then does a split
// decode whole. Without MSL 3.2 this compiles to nothing and the host dispatches kvq_combine
// (the host knows which: it compiled the library). `wgt` holds n_splits floats, `mred` 4,
// `flag` 1, none of them read by the caller after its last barrier.
template <class TG>
inline void merge_if_last(KVQ_COHERENT device float* part, device float* out,
                          device atomic_uint* counter, uint h0, uint gb, uint t, uint T,
                          uint n_splits, uint d, uint tid, uint lane, uint sg, TG wgt, TG mred,
                          TG flag) {
#ifdef KVQ_CAN_MERGE
  // Every thread's partial-row writes are ordered before the count (release) ...
  atomic_thread_fence(mem_flags::mem_device, memory_order_seq_cst, thread_scope_device);
  threadgroup_barrier(mem_flags::mem_device);
  if (tid == 0) {
    const uint before = atomic_fetch_add_explicit(counter, 1u, memory_order_relaxed);
    flag[0] = before + 1 == n_splits ? 1.0f : 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (flag[0] == 0.0f) return;
  // ... and the last threadgroup's reads of the other splits' rows after it (acquire).
  atomic_thread_fence(mem_flags::mem_device, memory_order_seq_cst, thread_scope_device);
  const uint width = d + 2;
  for (uint g = 0; g < gb; g++) {
    const uint row = (h0 + g) * T + t;
    merge_splits(part + ulong(row) * n_splits * width, out + ulong(row) * width, n_splits, d, 0u,
                 tid, lane, sg, wgt, mred);
  }
#endif
}

struct CombineParams {
  uint rows;       // (query head, query row) pairs
  uint n_splits;   // 1..KVQ_COMBINE_MAX_SPLITS
  uint d;          // head dim
  uint normalize;  // 1: out[..d] = output / sum
};

kernel void kvq_combine(device const float* part [[buffer(0)]],
                        device float* out [[buffer(1)]],
                        constant CombineParams& p [[buffer(2)]],
                        uint tid [[thread_position_in_threadgroup]],
                        uint row [[threadgroup_position_in_grid]],
                        uint lane [[thread_index_in_simdgroup]],
                        uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup float wgt[KVQ_COMBINE_MAX_SPLITS];
  threadgroup float mred[KVQ_COMBINE_THREADS / 32];
  // More splits than the weights' array writes nothing (the host's plan never makes them).
  if (row >= p.rows || p.n_splits > KVQ_COMBINE_MAX_SPLITS) return;
  const uint width = p.d + 2;
  merge_splits(part + ulong(row) * p.n_splits * width, out + ulong(row) * width, p.n_splits, p.d,
               p.normalize, tid, lane, sg, wgt, mred);
}
