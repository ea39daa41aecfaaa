// The version-6 kernels' code rows per warp (fast.cuh): chunks of 16 key and value rows copied
// into shared memory by the bulk copy engine, KVQ_FAST_STAGES deep, each stage completing on a
// transaction barrier.
#pragma once
#include "fast_frame.cuh"

namespace kvq {

// Rows [row0, row0 + n) of one head's rows (`cb` bytes each, from `head`) for `dst`: the
// 16-byte aligned span [a0, a1) of global memory that one cp.async.bulk copies (a1 <= a0: none;
// it ends on the 16 bytes holding the last row when they stay inside the head's `end`, the rows
// present), and the bytes past a1 (only where that rounding would pass `end`), stored by the
// lanes one by one. Row row0 then sits at rows_offset(head, cb, row0) in `dst`.
__device__ inline void fast_bulk_span(uint8_t* dst, const uint8_t* head, int cb, long long row0,
                                      int n, const uint8_t* end, int lane,
                                      unsigned long long& a0, unsigned long long& a1) {
  const unsigned long long b0 = reinterpret_cast<unsigned long long>(head) + row0 * cb;
  const unsigned long long b1 = b0 + (unsigned long long)n * cb;
  a0 = b0 & ~15ull;
  a1 = (b1 + 15) & ~15ull;
  if (a1 > reinterpret_cast<unsigned long long>(end)) a1 = b1 & ~15ull;
  if (a1 < a0) a1 = a0;
  for (unsigned long long x = a1 + lane; x < b1; x += 32)
    dst[x - a0] = __ldg(reinterpret_cast<const uint8_t*>(x));
}

// One bulk copy of `n` bytes (a multiple of 16, none when 0) from global address `src` to `dst`
// in shared memory, completing on the transaction barrier at shared address `bar`.
__device__ inline void fast_bulk_copy(uint8_t* dst, unsigned long long src, unsigned n,
                                      unsigned bar) {
  if (n == 0) return;
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"((unsigned)__cvta_generic_to_shared(dst)),
      "l"(src), "r"(n), "r"(bar)
      : "memory");
}

// The code rows of one block: a split of its query row's code range, copied per warp in chunks
// of 16 rows, KVQ_FAST_STAGES deep with bulk copies, keys and values alike (every family's
// loop).
template <int NW>
struct FastChunks {
  long long s0, s1;
  int count, mine, kbuf, vbuf, kcb, vcb, warp, lane;
  const uint8_t *kbase, *vbase, *kend, *vend;

  __device__ FastChunks(const AttendArgs& a, const FastLayout& L, const FastBlock& k) {
    long long r0, r1;
    code_rows(a, a.first_pos + k.t, r0, r1);
    r1 = min(r1, a.n_rows);
    s0 = r0 + (long long)blockIdx.x * a.split_rows;
    s1 = max(min(r1, s0 + a.split_rows), s0);
    warp = threadIdx.x >> 5;
    lane = threadIdx.x & 31;
    kcb = a.kcb;
    vcb = a.vcb;
    kbuf = fast_stage_bytes(kcb);
    vbuf = fast_stage_bytes(vcb);
    mine = L.stages + warp * KVQ_FAST_STAGES * (kbuf + vbuf);
    kbase = a.kc + k.b * a.k_bstride + k.kh * a.k_hstride;
    vbase = a.vc + k.b * a.v_bstride + k.kh * a.v_hstride;
    kend = kbase + a.n_rows * kcb;
    vend = vbase + a.n_rows * vcb;
    const int nchunks = (int)((s1 - s0 + 15) / 16);
    count = nchunks > warp ? (nchunks - warp + NW - 1) / NW : 0;
  }
  // Chunk i's first row and the rows it holds.
  __device__ long long base(int i) const { return s0 + (long long)(warp + i * NW) * 16; }
  __device__ int rows(int i) const { return (int)min(16ll, s1 - base(i)); }
  // Stage s's transaction barrier: the last 16 bytes of its key buffer, which no copy or load
  // reaches (fast_stage_bytes: a chunk's copy spans at most 16 * cb + 16 of the buffer's
  // 16 * cb + 48 bytes).
  __device__ unsigned bar(uint8_t* smem, int s) const {
    return (unsigned)__cvta_generic_to_shared(smem + mine + s * kbuf + kbuf - 16);
  }
  // Starts copying chunk i: lane 0 arms stage i's barrier with the bytes of both copies and
  // issues them to the bulk copy engine (16-byte aligned spans, fast_bulk_span); every lane
  // copies its share of a tail past the rows present byte by byte (fast_bulk_span).
  __device__ void issue(uint8_t* smem, int i) const {
    if (i >= count) return;
    const int s = i % KVQ_FAST_STAGES;
    uint8_t* kd = smem + mine + s * kbuf;
    uint8_t* vd = smem + mine + KVQ_FAST_STAGES * kbuf + s * vbuf;
    unsigned long long ka0, ka1, va0, va1;
    fast_bulk_span(kd, kbase, kcb, base(i), rows(i), kend, lane, ka0, ka1);
    fast_bulk_span(vd, vbase, vcb, base(i), rows(i), vend, lane, va0, va1);
    if (lane == 0) {
      const unsigned b = bar(smem, s);
      const unsigned kn = (unsigned)(ka1 - ka0), vn = (unsigned)(va1 - va0);
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(b), "r"(kn + vn)
                   : "memory");
      fast_bulk_copy(kd, ka0, kn, b);
      fast_bulk_copy(vd, va0, vn, b);
    }
  }
  // Lane 0 sets up this warp's stage barriers (one arrival each: its own, with the bytes), then
  // the first KVQ_FAST_STAGES - 1 chunks.
  __device__ void start(uint8_t* smem) const {
    if (lane == 0) {
#pragma unroll
      for (int s = 0; s < KVQ_FAST_STAGES; s++)
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar(smem, s)) : "memory");
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < KVQ_FAST_STAGES - 1; i++) issue(smem, i);
  }
  // Starts chunk i + KVQ_FAST_STAGES - 1, waits for chunk i: where its key and value rows sit.
  __device__ void next(uint8_t* smem, int i, int& kt, int& vt) const {
    issue(smem, i + KVQ_FAST_STAGES - 1);
    const int s = i % KVQ_FAST_STAGES;
    const unsigned b = bar(smem, s), parity = (unsigned)(i / KVQ_FAST_STAGES) & 1u;
    unsigned done = 0;
    do {
      asm volatile(
          "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
          " selp.u32 %0, 1, 0, p;\n}\n"
          : "=r"(done)
          : "r"(b), "r"(parity)
          : "memory");
    } while (!done);
    __syncwarp();  // the tail bytes other lanes stored
    kt = mine + s * kbuf + rows_offset(kbase, kcb, base(i));
    vt = mine + KVQ_FAST_STAGES * kbuf + s * vbuf + rows_offset(vbase, vcb, base(i));
  }
  // After the loop (every armed barrier waited for): the barriers' words may hold other data.
  __device__ void stop(uint8_t* smem) const {
    __syncwarp();
    if (lane == 0)
#pragma unroll
      for (int s = 0; s < KVQ_FAST_STAGES; s++)
        asm volatile("mbarrier.inval.shared::cta.b64 [%0];\n" ::"r"(bar(smem, s)) : "memory");
    __syncwarp();
  }
};

}  // namespace kvq
