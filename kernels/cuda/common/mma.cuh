// Tensor-core pieces of the decode attention (sm_80+): the m16n8k16 f16 mma with f32
// accumulation (and the m16n8k32 s8 one with s32), fragment packing, word loads from shared
// memory at any byte alignment, and the per-warp asynchronous copy of a chunk of code rows.
// Fragment layouts (PTX ISA, mma.m16n8k16, g = lane / 4, t = lane % 4): A a0 (row g, cols 2t,
// 2t+1), a1 (row g+8, same), a2 (row g, cols 2t+8, 2t+9), a3 (row g+8, same); B b0 (rows 2t,
// 2t+1, col g), b1 (rows 2t+8, 2t+9, col g); C c0, c1 (row g, cols 2t, 2t+1), c2, c3 (row g+8,
// same). The lower half of a register is the lower column (A) or row (B).
#pragma once
#include "attend.cuh"

namespace kvq {

// c += A B for one 16x8x16 tile (f16 inputs, f32 accumulators).
__device__ inline void mma_16816(float c[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                 unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// c += A B for one 16x8x32 tile (s8 inputs, s32 accumulators). Four bytes per register:
// A a0 (row g, cols 4t..4t+3), a1 (row g+8, same), a2 (row g, cols 16+4t..16+4t+3), a3 (row g+8,
// same); B b0 (rows 4t..4t+3, col g), b1 (rows 16+4t..16+4t+3, col g); C as m16n8k16's. The
// lowest byte is the lowest column (A) or row (B).
__device__ inline void mma_16832_s8(int c[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                    unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Two f16 bit patterns as one register, `lo` in the lower half.
__device__ inline unsigned pack_u16(unsigned lo, unsigned hi) { return __byte_perm(lo, hi, 0x5410); }

// Two floats rounded to f16, `lo` in the lower half.
__device__ inline unsigned pack_f2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const unsigned*>(&h);
}

// x ~ hi + lo with both parts f16 (about 22 significant bits together): a query split this way
// into two rows of an A tile is scored at nearly f32 precision by one mma.
__device__ inline void split_f16(float x, unsigned short& hi, unsigned short& lo) {
  const __half h = __float2half_rn(x);
  hi = __half_as_ushort(h);
  lo = __half_as_ushort(__float2half_rn(x - __half2float(h)));
}

// `N` little-endian 32-bit words starting at byte `off` of the shared buffer `base` (16-byte
// aligned), any alignment of `off` (reads up to 4 bytes past the last word: buffers keep
// slack). Offsets, not pointers cast to integers, keep the loads in the shared space (LDS).
template <int N>
__device__ inline void lds_words(const uint8_t* base, int off, unsigned w[N]) {
  const unsigned* a = reinterpret_cast<const unsigned*>(base) + (off >> 2);
  const unsigned sh = (unsigned)(off & 3) * 8;
  unsigned r[N + 1];
#pragma unroll
  for (int i = 0; i <= N; i++) r[i] = a[i];
#pragma unroll
  for (int i = 0; i < N; i++) w[i] = __funnelshift_r(r[i], r[i + 1], sh);
}

// `N` 32-bit words from global memory at `p` (16-byte aligned, N a multiple of 4).
template <int N>
__device__ inline void ldg_words(const uint8_t* p, unsigned w[N]) {
  const uint4* a = reinterpret_cast<const uint4*>(p);
#pragma unroll
  for (int i = 0; i < N / 4; i++) {
    const uint4 v = __ldg(a + i);
    w[4 * i] = v.x;
    w[4 * i + 1] = v.y;
    w[4 * i + 2] = v.z;
    w[4 * i + 3] = v.w;
  }
}

// 16 f16 values held in registers, looked up 4 at a time with byte permutes (no shared memory):
// lo[q] holds the low bytes of entries 4q .. 4q+3, hi[q] their high bytes.
struct Lut16 {
  unsigned lo[4], hi[4];
};

__device__ inline Lut16 lut16_make(const unsigned short* v) {
  Lut16 t;
#pragma unroll
  for (int q = 0; q < 4; q++) {
    t.lo[q] = t.hi[q] = 0;
#pragma unroll
    for (int e = 0; e < 4; e++) {
      t.lo[q] |= (unsigned)(v[4 * q + e] & 0xff) << (8 * e);
      t.hi[q] |= (unsigned)(v[4 * q + e] >> 8) << (8 * e);
    }
  }
  return t;
}

// The entries of the 4 nibbles n0..n3 of the low 16 bits of `x` as two f16 pairs:
// h01 = (v[n0], v[n1]), h23 = (v[n2], v[n3]). A permute picks byte n & 7 of entries 0-7 and of
// 8-15 for all four at once; bit 3 of each nibble chooses between them.
__device__ inline void lut16(const Lut16& t, unsigned x, unsigned& h01, unsigned& h23) {
  const unsigned s = x & 0x7777u;
  const unsigned m = __byte_perm(0x0000ff00u, 0u, (x >> 3) & 0x1111u);
  const unsigned lo = (__byte_perm(t.lo[0], t.lo[1], s) & ~m) | (__byte_perm(t.lo[2], t.lo[3], s) & m);
  const unsigned hi = (__byte_perm(t.hi[0], t.hi[1], s) & ~m) | (__byte_perm(t.hi[2], t.hi[3], s) & m);
  h01 = __byte_perm(lo, hi, 0x5140);
  h23 = __byte_perm(lo, hi, 0x7362);
}

// The `BITS`-bit field starting at bit `bit` of the words `w` (`bit` known at compile time
// after unrolling; fields may straddle two words).
template <int BITS>
__device__ inline unsigned field_at(const unsigned* w, int bit) {
  const int wi = bit >> 5, off = bit & 31;
  unsigned v = w[wi] >> off;
  if (off + BITS > 32) v |= w[wi + 1] << (32 - off);
  return v & ((1u << BITS) - 1);
}

// Starts copying rows [row0, row0 + n) of one head's rows (`cb` bytes each, contiguous from
// `head`, any alignment) into `dst` with the 32 lanes of a warp: 16-byte cp.async from the
// 16-byte boundary at or below the first row's address (inside the allocation: allocations start
// 256-byte aligned), the bytes after the last 16-byte boundary by plain loads (never past the
// last row). Row r then sits at `rows_offset(head, cb, row0) + r * cb` in `dst`. Completed by
// cp_async_wait and __syncwarp.
__device__ inline void warp_load_rows(uint8_t* dst, const uint8_t* head, int cb, long long row0,
                                      int n, int lane) {
  const unsigned long long b0 = reinterpret_cast<unsigned long long>(head) + row0 * cb;
  const unsigned long long b1 = b0 + (unsigned long long)n * cb;
  const unsigned long long a0 = b0 & ~15ull, a1 = b1 & ~15ull;
  const uint8_t* base = reinterpret_cast<const uint8_t*>(a0);
  for (unsigned long long x = 16 * lane; a0 + x < a1; x += 16 * 32) cp_async16(dst + x, base + x);
  for (unsigned long long x = (a1 > a0 ? a1 : a0) + lane; x < b1; x += 32)
    dst[x - a0] = __ldg(reinterpret_cast<const uint8_t*>(x));
}

// Where warp_load_rows put row row0.
__device__ inline int rows_offset(const uint8_t* head, int cb, long long row0) {
  return (int)((reinterpret_cast<unsigned long long>(head) + row0 * cb) & 15);
}

}  // namespace kvq
