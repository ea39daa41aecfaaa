// The CPU emulator's grid runtime: runs a Metal compute dispatch (threadgroups of threads, as
// `dispatchThreadgroups` takes them) on one OS thread, each threadgroup's threads as fibers.
// `threadgroup_barrier` and every simdgroup operation are scheduling points: a fiber runs until
// it reaches one, then the next runnable fiber runs, in the dispatch's lane order (forward,
// reverse, or a fresh random permutation at every round), so a kernel that reads threadgroup
// memory before another thread wrote it, or depends on lane order, answers differently.
// Threadgroups run one after another, forward, reversed or shuffled as the order says (a
// kernel must not depend on which threadgroup runs first or last). Misuse the hardware leaves
// undefined (a barrier that not every thread reaches, simdgroup operations that diverge) is an
// error, not a guess.
#pragma once
#include <cstdint>
#include <functional>
#include <string>

namespace kvq_emu {

struct Dim3 {
  uint32_t x, y, z;
};

enum class Order : uint32_t { Forward = 0, Reverse = 1, Random = 2 };

// The builtins of the running thread (what `[[thread_position_in_grid]]` and its kin give).
struct Builtins {
  Dim3 thread_position_in_grid;
  Dim3 thread_position_in_threadgroup;
  Dim3 threadgroup_position_in_grid;
  Dim3 threads_per_threadgroup;
  Dim3 threadgroups_per_grid;
  uint32_t thread_index_in_threadgroup;
  uint32_t thread_index_in_simdgroup;
  uint32_t simdgroup_index_in_threadgroup;
  uint32_t threads_per_simdgroup;
};

// Lanes per simdgroup (every Apple GPU).
constexpr uint32_t SIMD_WIDTH = 32;

const Builtins& builtins();

// threadgroup_barrier: waits until every thread of the threadgroup arrived.
void barrier();

// One simdgroup operation `op` (an id, so diverging operations are caught): deposits this
// lane's 64 bits, waits for every live lane of the simdgroup, and copies all 32 lanes' values
// into `lanes` (lanes that did not take part: a poison pattern) and the set of lanes that took
// part into `mask`.
void simd_exchange(uint32_t op, uint64_t value, uint64_t lanes[SIMD_WIDTH], uint64_t* mask);

// Ends the dispatch with an error (from inside a kernel).
[[noreturn]] void fail(const std::string& message);

// Runs `body` once per thread of `groups` threadgroups of `threads` threads; "" or the error.
std::string dispatch(Dim3 groups, Dim3 threads, Order order, uint64_t seed,
                     const std::function<void()>& body);

}  // namespace kvq_emu
