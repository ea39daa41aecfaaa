// The emulator's kernel table: every kvq `.metal` file included unchanged (each set in its own
// namespace, so the negative controls' mutated copies can sit beside the real kernels; a file
// that builds on another's helpers comes after it, as in the Metal backend's libraries), and per
// kernel one adapter from the C ABI (buffers in `[[buffer(n)]]` order, builtins from the
// runtime) to the kernel's MSL signature. The standard headers come first: the shim's
// address-space macros (`constant`, `kernel`, ...) would rewrite their declarations; and no
// name here may be one of those words.
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <string>

#include <metal_stdlib>

namespace kvq_real {
#include "common/bitpack.metal"
#include "turboquant_mse/encode.metal"
#include "qjl/encode.metal"
#include "vecinfer/encode.metal"
#include "common/combine.metal"
#include "turboquant_mse/attend.metal"
#include "qjl/attend.metal"
#include "turboquant_prod/encode.metal"
#include "turboquant_prod/attend.metal"
#include "vecinfer/attend.metal"
}  // namespace kvq_real

namespace kvq_xor_butterfly {
#include KVQ_MUTANT_XOR_BUTTERFLY
}  // namespace kvq_xor_butterfly

namespace kvq_no_barrier {
#include KVQ_MUTANT_NO_BARRIER
}  // namespace kvq_no_barrier

namespace kvq_wrong_shuffle_lane {
#include KVQ_MUTANT_WRONG_SHUFFLE_LANE
}  // namespace kvq_wrong_shuffle_lane

namespace kvq_attend_no_barrier {
#include KVQ_MUTANT_ATTEND_NO_BARRIER
}  // namespace kvq_attend_no_barrier

namespace kvq_attend_no_score_barrier {
#include KVQ_MUTANT_ATTEND_NO_SCORE_BARRIER
}  // namespace kvq_attend_no_score_barrier

namespace kvq_attend_split_overlap {
#include KVQ_MUTANT_ATTEND_SPLIT_OVERLAP
}  // namespace kvq_attend_split_overlap

namespace kvq_qjl_no_barrier {
#include KVQ_MUTANT_QJL_NO_BARRIER
}  // namespace kvq_qjl_no_barrier

namespace kvq_combine_no_barrier {
#include KVQ_MUTANT_COMBINE_NO_BARRIER
}  // namespace kvq_combine_no_barrier

namespace kvq_prod_wrong_shuffle_lane {
#include KVQ_MUTANT_PROD_WRONG_SHUFFLE_LANE
}  // namespace kvq_prod_wrong_shuffle_lane

namespace kvq_prod_no_residual_barrier {
#include KVQ_MUTANT_PROD_NO_RESIDUAL_BARRIER
}  // namespace kvq_prod_no_residual_barrier

namespace kvq_group_no_barrier {
#include KVQ_MUTANT_GROUP_NO_BARRIER
}  // namespace kvq_group_no_barrier

namespace kvq_vq_no_barrier {
#include KVQ_MUTANT_VQ_NO_BARRIER
}  // namespace kvq_vq_no_barrier

namespace kvq_merge_not_last {
#include KVQ_MUTANT_MERGE_NOT_LAST
}  // namespace kvq_merge_not_last

namespace kvq_vq_lut_no_barrier {
#include KVQ_MUTANT_VQ_LUT_NO_BARRIER
}  // namespace kvq_vq_lut_no_barrier

namespace {

struct Entry {
  size_t buffers;
  std::function<void(void* const*)> run;
};

using B = void* const*;
const kvq_emu::Builtins& bi() { return kvq_emu::builtins(); }

template <class Params, class F>
Entry pack_like(F fn) {
  return {3, [fn](B b) {
            fn(static_cast<const uchar*>(b[0]), static_cast<uchar*>(b[1]),
                   *static_cast<const Params*>(b[2]), bi().thread_position_in_grid.x);
          }};
}

template <class Params, class F>
Entry encode_scalar(F fn) {
  return {6, [fn](B b) {
            fn(static_cast<const float*>(b[0]), static_cast<const float*>(b[1]),
                   static_cast<const float*>(b[2]), static_cast<const uchar*>(b[3]),
                   static_cast<uchar*>(b[4]), *static_cast<const Params*>(b[5]),
                   bi().thread_position_in_threadgroup.x, bi().threadgroup_position_in_grid.x,
                   bi().thread_index_in_simdgroup, bi().simdgroup_index_in_threadgroup);
          }};
}

template <class Params, class F>
Entry encode_qjl_keys(F fn) {
  return {4, [fn](B b) {
            fn(static_cast<const float*>(b[0]), static_cast<const float*>(b[1]),
               static_cast<uchar*>(b[2]), *static_cast<const Params*>(b[3]),
               bi().thread_position_in_threadgroup.x, bi().threadgroup_position_in_grid.x,
               bi().thread_index_in_simdgroup, bi().simdgroup_index_in_threadgroup);
          }};
}

template <class Params, class F>
Entry nearest(F fn) {
  return {4, [fn](B b) {
            fn(static_cast<const float*>(b[0]), static_cast<const float*>(b[1]),
               static_cast<uint*>(b[2]), *static_cast<const Params*>(b[3]),
               bi().thread_position_in_grid.x, bi().thread_position_in_threadgroup.x,
               bi().threads_per_threadgroup.x);
          }};
}

// The attention kernels: q, key codes, value codes, `Arrays` read-only float arrays, then the
// partial rows, the merged rows, the split counters and the parameters (kvq_attend_scalar: 4
// arrays, kvq_attend_prod and kvq_attend_vq: 5, kvq_attend_vq_lut: 6, kvq_attend_qjl: 1).
template <size_t... I>
struct Seq {};
template <size_t N, size_t... I>
struct MakeSeq : MakeSeq<N - 1, N - 1, I...> {};
template <size_t... I>
struct MakeSeq<0, I...> {
  using type = Seq<I...>;
};

template <class Params, class F, size_t... I>
void call_attend(F fn, B b, Seq<I...>) {
  constexpr size_t n = sizeof...(I);
  fn(static_cast<const float*>(b[0]), static_cast<const uchar*>(b[1]),
     static_cast<const uchar*>(b[2]), static_cast<const float*>(b[3 + I])...,
     static_cast<float*>(b[3 + n]), static_cast<float*>(b[4 + n]),
     static_cast<metal::atomic_uint*>(b[5 + n]), *static_cast<const Params*>(b[6 + n]),
     bi().thread_position_in_threadgroup.x, bi().threadgroup_position_in_grid.x,
     bi().thread_index_in_simdgroup, bi().simdgroup_index_in_threadgroup);
}

template <size_t Arrays, class Params, class F>
Entry attend(F fn) {
  return {Arrays + 7,
          [fn](B b) { call_attend<Params>(fn, b, typename MakeSeq<Arrays>::type{}); }};
}

template <class Params, class F>
Entry attend_scalar(F fn) {
  return attend<4, Params>(fn);
}

template <class Params, class F>
Entry attend_qjl(F fn) {
  return attend<1, Params>(fn);
}

template <class Params, class F>
Entry encode_prod(F fn) {
  return {8, [fn](B b) {
            fn(static_cast<const float*>(b[0]), static_cast<const float*>(b[1]),
               static_cast<const float*>(b[2]), static_cast<const uchar*>(b[3]),
               static_cast<const float*>(b[4]), static_cast<const float*>(b[5]),
               static_cast<uchar*>(b[6]), *static_cast<const Params*>(b[7]),
               bi().thread_position_in_threadgroup.x, bi().threadgroup_position_in_grid.x,
               bi().thread_index_in_simdgroup, bi().simdgroup_index_in_threadgroup);
          }};
}

template <class Params, class F>
Entry encode_group(F fn) {
  return {3, [fn](B b) {
            fn(static_cast<const float*>(b[0]), static_cast<uchar*>(b[1]),
               *static_cast<const Params*>(b[2]), bi().thread_position_in_threadgroup.x,
               bi().threadgroup_position_in_grid.x);
          }};
}

template <class Params, class F>
Entry encode_vq(F fn) {
  return {6, [fn](B b) {
            fn(static_cast<const float*>(b[0]), static_cast<const float*>(b[1]),
               static_cast<const float*>(b[2]), static_cast<const float*>(b[3]),
               static_cast<uchar*>(b[4]), *static_cast<const Params*>(b[5]),
               bi().thread_position_in_threadgroup.x, bi().threadgroup_position_in_grid.x);
          }};
}

// kvq_attend_prod and kvq_attend_vq.
template <class Params, class F>
Entry attend5(F fn) {
  return attend<5, Params>(fn);
}

// kvq_attend_vq_lut.
template <class Params, class F>
Entry attend6(F fn) {
  return attend<6, Params>(fn);
}

template <class Params, class F>
Entry combine(F fn) {
  return {3, [fn](B b) {
            fn(static_cast<const float*>(b[0]), static_cast<float*>(b[1]),
               *static_cast<const Params*>(b[2]), bi().thread_position_in_threadgroup.x,
               bi().threadgroup_position_in_grid.x, bi().thread_index_in_simdgroup,
               bi().simdgroup_index_in_threadgroup);
          }};
}

const std::map<std::string, Entry>& table() {
  static const std::map<std::string, Entry> t = {
      {"kvq_pack_bits", pack_like<kvq_real::PackParams>(kvq_real::kvq_pack_bits)},
      {"kvq_unpack_bits", pack_like<kvq_real::PackParams>(kvq_real::kvq_unpack_bits)},
      {"kvq_encode_scalar",
       encode_scalar<kvq_real::ScalarEncodeParams>(kvq_real::kvq_encode_scalar)},
      {"xor_butterfly/kvq_encode_scalar",
       encode_scalar<kvq_xor_butterfly::ScalarEncodeParams>(
           kvq_xor_butterfly::kvq_encode_scalar)},
      {"no_barrier/kvq_encode_scalar",
       encode_scalar<kvq_no_barrier::ScalarEncodeParams>(kvq_no_barrier::kvq_encode_scalar)},
      {"kvq_nearest", nearest<kvq_real::NearestParams>(kvq_real::kvq_nearest)},
      {"kvq_encode_qjl_keys",
       encode_qjl_keys<kvq_real::QjlKeyEncodeParams>(kvq_real::kvq_encode_qjl_keys)},
      {"wrong_shuffle_lane/kvq_encode_qjl_keys",
       encode_qjl_keys<kvq_wrong_shuffle_lane::QjlKeyEncodeParams>(
           kvq_wrong_shuffle_lane::kvq_encode_qjl_keys)},
      {"kvq_attend_scalar",
       attend_scalar<kvq_real::ScalarAttendParams>(kvq_real::kvq_attend_scalar)},
      {"attend_no_barrier/kvq_attend_scalar",
       attend_scalar<kvq_attend_no_barrier::ScalarAttendParams>(
           kvq_attend_no_barrier::kvq_attend_scalar)},
      {"attend_no_score_barrier/kvq_attend_scalar",
       attend_scalar<kvq_attend_no_score_barrier::ScalarAttendParams>(
           kvq_attend_no_score_barrier::kvq_attend_scalar)},
      {"attend_split_overlap/kvq_attend_scalar",
       attend_scalar<kvq_attend_split_overlap::ScalarAttendParams>(
           kvq_attend_split_overlap::kvq_attend_scalar)},
      {"kvq_attend_qjl", attend_qjl<kvq_real::QjlAttendParams>(kvq_real::kvq_attend_qjl)},
      {"qjl_no_barrier/kvq_attend_qjl",
       attend_qjl<kvq_qjl_no_barrier::QjlAttendParams>(kvq_qjl_no_barrier::kvq_attend_qjl)},
      {"kvq_combine", combine<kvq_real::CombineParams>(kvq_real::kvq_combine)},
      {"kvq_encode_prod", encode_prod<kvq_real::ProdEncodeParams>(kvq_real::kvq_encode_prod)},
      {"kvq_encode_group", encode_group<kvq_real::GroupEncodeParams>(kvq_real::kvq_encode_group)},
      {"kvq_encode_vq", encode_vq<kvq_real::VqEncodeParams>(kvq_real::kvq_encode_vq)},
      {"kvq_attend_prod", attend5<kvq_real::ScalarAttendParams>(kvq_real::kvq_attend_prod)},
      {"kvq_attend_vq", attend5<kvq_real::ScalarAttendParams>(kvq_real::kvq_attend_vq)},
      {"merge_not_last/kvq_attend_scalar",
       attend_scalar<kvq_merge_not_last::ScalarAttendParams>(kvq_merge_not_last::kvq_attend_scalar)},
      {"kvq_attend_vq_lut",
       attend6<kvq_real::ScalarAttendParams>(kvq_real::kvq_attend_vq_lut)},
      {"vq_lut_no_barrier/kvq_attend_vq_lut",
       attend6<kvq_vq_lut_no_barrier::ScalarAttendParams>(
           kvq_vq_lut_no_barrier::kvq_attend_vq_lut)},
      {"attend_no_barrier/kvq_attend_vq_lut",
       attend6<kvq_attend_no_barrier::ScalarAttendParams>(
           kvq_attend_no_barrier::kvq_attend_vq_lut)},
      {"attend_no_score_barrier/kvq_attend_vq_lut",
       attend6<kvq_attend_no_score_barrier::ScalarAttendParams>(
           kvq_attend_no_score_barrier::kvq_attend_vq_lut)},
      {"attend_split_overlap/kvq_attend_vq_lut",
       attend6<kvq_attend_split_overlap::ScalarAttendParams>(
           kvq_attend_split_overlap::kvq_attend_vq_lut)},
      {"combine_no_barrier/kvq_combine",
       combine<kvq_combine_no_barrier::CombineParams>(kvq_combine_no_barrier::kvq_combine)},
      // The shared helpers' mistakes reach the kernels built on them.
      {"xor_butterfly/kvq_encode_vq",
       encode_vq<kvq_xor_butterfly::VqEncodeParams>(kvq_xor_butterfly::kvq_encode_vq)},
      {"xor_butterfly/kvq_encode_prod",
       encode_prod<kvq_xor_butterfly::ProdEncodeParams>(kvq_xor_butterfly::kvq_encode_prod)},
      {"no_barrier/kvq_encode_vq",
       encode_vq<kvq_no_barrier::VqEncodeParams>(kvq_no_barrier::kvq_encode_vq)},
      {"no_barrier/kvq_encode_prod",
       encode_prod<kvq_no_barrier::ProdEncodeParams>(kvq_no_barrier::kvq_encode_prod)},
      {"attend_no_barrier/kvq_attend_prod",
       attend5<kvq_attend_no_barrier::ScalarAttendParams>(
           kvq_attend_no_barrier::kvq_attend_prod)},
      {"attend_no_barrier/kvq_attend_vq",
       attend5<kvq_attend_no_barrier::ScalarAttendParams>(kvq_attend_no_barrier::kvq_attend_vq)},
      {"attend_no_score_barrier/kvq_attend_prod",
       attend5<kvq_attend_no_score_barrier::ScalarAttendParams>(
           kvq_attend_no_score_barrier::kvq_attend_prod)},
      {"attend_no_score_barrier/kvq_attend_vq",
       attend5<kvq_attend_no_score_barrier::ScalarAttendParams>(
           kvq_attend_no_score_barrier::kvq_attend_vq)},
      {"attend_split_overlap/kvq_attend_prod",
       attend5<kvq_attend_split_overlap::ScalarAttendParams>(
           kvq_attend_split_overlap::kvq_attend_prod)},
      {"attend_split_overlap/kvq_attend_vq",
       attend5<kvq_attend_split_overlap::ScalarAttendParams>(
           kvq_attend_split_overlap::kvq_attend_vq)},
      // The new kernels' own barriers and shuffles.
      {"prod_wrong_shuffle_lane/kvq_encode_prod",
       encode_prod<kvq_prod_wrong_shuffle_lane::ProdEncodeParams>(
           kvq_prod_wrong_shuffle_lane::kvq_encode_prod)},
      {"prod_no_residual_barrier/kvq_encode_prod",
       encode_prod<kvq_prod_no_residual_barrier::ProdEncodeParams>(
           kvq_prod_no_residual_barrier::kvq_encode_prod)},
      {"group_no_barrier/kvq_encode_group",
       encode_group<kvq_group_no_barrier::GroupEncodeParams>(
           kvq_group_no_barrier::kvq_encode_group)},
      {"vq_no_barrier/kvq_encode_vq",
       encode_vq<kvq_vq_no_barrier::VqEncodeParams>(kvq_vq_no_barrier::kvq_encode_vq)},
  };
  return t;
}

void copy_err(const std::string& m, char* err, size_t len) {
  if (len == 0) return;
  const size_t n = m.size() < len - 1 ? m.size() : len - 1;
  std::memcpy(err, m.data(), n);
  err[n] = 0;
}

}  // namespace

// Runs kernel `name` over `groups` threadgroups of `threads` threads (dispatchThreadgroups
// units) in lane order `order`. 0: done; 1: the emulator found an error (in `err`); 2: no such
// kernel or the wrong number of buffers. One dispatch at a time: `threadgroup` arrays are
// statics.
extern "C" int kvq_emu_run(const char* name, const uint32_t* groups, const uint32_t* threads,
                           uint32_t order, uint64_t seed, void* const* buffers, size_t n_buffers,
                           char* err, size_t err_len) {
  static std::mutex one_at_a_time;
  std::lock_guard<std::mutex> lock(one_at_a_time);
  const auto& t = table();
  const auto it = t.find(name);
  if (it == t.end()) {
    copy_err(std::string("no emulated kernel ") + name, err, err_len);
    return 2;
  }
  if (it->second.buffers != n_buffers) {
    copy_err(std::string(name) + " takes " + std::to_string(it->second.buffers) + " buffers, got " +
                 std::to_string(n_buffers),
             err, err_len);
    return 2;
  }
  const auto& run = it->second.run;
  const std::string e = kvq_emu::dispatch({groups[0], groups[1], groups[2]},
                                          {threads[0], threads[1], threads[2]},
                                          static_cast<kvq_emu::Order>(order), seed,
                                          [&] { run(buffers); });
  if (e.empty()) return 0;
  copy_err(e, err, err_len);
  return 1;
}
