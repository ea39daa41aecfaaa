// Bit packing of b-bit codes (1 to 8 bits) into bytes, least significant bits first, so n codes
// take ceil(n * b / 8) bytes and every 8 codes fill exactly b bytes (the CPU definition:
// crates/kvq-kernels/src/bitpack.rs). One thread per group of 8 codes; the dispatch comes
// from kvq_kernels::metal::dispatch::pack_bits.
#include <metal_stdlib>
using namespace metal;

struct PackParams {
  uint n;     // codes
  uint bits;  // 1..8
};

kernel void kvq_pack_bits(device const uchar* codes [[buffer(0)]],
                          device uchar* packed [[buffer(1)]],
                          constant PackParams& p [[buffer(2)]],
                          uint gid [[thread_position_in_grid]]) {
  const uint first = gid * 8;
  if (first >= p.n) return;
  const uint count = min(8u, p.n - first);
  const ulong mask = (1ul << p.bits) - 1ul;
  ulong v = 0;
  for (uint k = 0; k < count; k++) v |= (ulong(codes[first + k]) & mask) << (k * p.bits);
  // The last group may fill fewer than `bits` bytes.
  const uint bytes = (count * p.bits + 7) / 8;
  for (uint b = 0; b < bytes; b++) packed[gid * p.bits + b] = uchar(v >> (8 * b));
}

kernel void kvq_unpack_bits(device const uchar* packed [[buffer(0)]],
                            device uchar* codes [[buffer(1)]],
                            constant PackParams& p [[buffer(2)]],
                            uint gid [[thread_position_in_grid]]) {
  const uint first = gid * 8;
  if (first >= p.n) return;
  const uint count = min(8u, p.n - first);
  const uint bytes = (count * p.bits + 7) / 8;
  ulong v = 0;
  for (uint b = 0; b < bytes; b++) v |= ulong(packed[gid * p.bits + b]) << (8 * b);
  const ulong mask = (1ul << p.bits) - 1ul;
  for (uint k = 0; k < count; k++) codes[first + k] = uchar((v >> (k * p.bits)) & mask);
}
