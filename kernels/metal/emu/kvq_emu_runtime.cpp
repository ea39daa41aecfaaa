// The emulator's fiber scheduler (see kvq_emu_runtime.h): ucontext fibers, one per thread of the
// running threadgroup, resumed round by round in the dispatch's lane order.
#include "kvq_emu_runtime.h"

#include <ucontext.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

namespace kvq_emu {
namespace {

constexpr size_t STACK_BYTES = 128 * 1024;
constexpr uint64_t POISON = 0x7fc00bad7fc00badull;  // a NaN in either 32-bit half

enum class Wait { Run, Barrier, Simd, Done };

struct Lane {
  ucontext_t ctx;
  Builtins b;
  Wait wait = Wait::Run;
  uint32_t simd_phase = 0;
};

// One simdgroup's exchange slots, double buffered by phase parity: a lane cannot deposit for
// phase p + 2 before every lane has read phase p (it would have to pass phase p + 1 first).
struct Simd {
  uint64_t slot[2][SIMD_WIDTH];
  uint32_t arrived[2] = {0, 0};
  uint32_t read[2] = {0, 0};
  uint32_t op[2] = {0, 0};
  uint64_t mask[2] = {0, 0};
  bool released[2] = {false, false};
};

struct State {
  std::vector<Lane> lanes;
  std::vector<std::unique_ptr<char[]>> stacks;
  std::vector<Simd> simd;
  ucontext_t sched;
  Lane* cur = nullptr;
  const std::function<void()>* body = nullptr;
  std::string error;
  uint32_t at_barrier = 0;
};

thread_local State* S = nullptr;

void yield() { swapcontext(&S->cur->ctx, &S->sched); }

uint32_t alive_in(uint32_t sg) {
  uint32_t n = 0;
  for (const Lane& l : S->lanes)
    if (l.b.simdgroup_index_in_threadgroup == sg && l.wait != Wait::Done) n++;
  return n;
}

// Releases simdgroup `sg`'s lanes waiting at phase `p` once every live lane has arrived.
void try_release(uint32_t sg, int p) {
  Simd& s = S->simd[sg];
  if (s.arrived[p] == 0 || s.released[p] || s.arrived[p] < alive_in(sg)) return;
  s.released[p] = true;
  for (Lane& l : S->lanes)
    if (l.b.simdgroup_index_in_threadgroup == sg && l.wait == Wait::Simd &&
        (l.simd_phase & 1) == (uint32_t)p)
      l.wait = Wait::Run;
}

void trampoline() {
  (*S->body)();
  Lane* l = S->cur;
  l->wait = Wait::Done;
  // Lanes of its simdgroup may have been waiting only for this one to decide.
  const uint32_t sg = l->b.simdgroup_index_in_threadgroup;
  try_release(sg, 0);
  try_release(sg, 1);
  swapcontext(&l->ctx, &S->sched);
  std::abort();  // a finished fiber is never resumed
}

// Makes `l` a fiber that starts at the kernel (apart from the dispatch loop: getcontext
// returns twice as far as the compiler knows, which it must not assume of the loop's counters).
__attribute__((noinline)) void start_fiber(Lane& l, char* stack) {
  getcontext(&l.ctx);
  l.ctx.uc_stack.ss_sp = stack;
  l.ctx.uc_stack.ss_size = STACK_BYTES;
  l.ctx.uc_link = nullptr;
  makecontext(&l.ctx, trampoline, 0);
}

// Runs one threadgroup to completion; false on an error (in S->error).
bool run_group(Order order, std::mt19937_64& rng) {
  const size_t n = S->lanes.size();
  std::vector<size_t> perm(n);
  for (size_t i = 0; i < n; i++) perm[i] = i;
  if (order == Order::Reverse) std::reverse(perm.begin(), perm.end());
  for (;;) {
    if (order == Order::Random) std::shuffle(perm.begin(), perm.end(), rng);
    bool ran = false;
    for (size_t i : perm) {
      Lane& l = S->lanes[i];
      if (l.wait != Wait::Run) continue;
      S->cur = &l;
      swapcontext(&S->sched, &l.ctx);
      ran = true;
      if (!S->error.empty()) return false;
    }
    if (ran) continue;
    uint32_t alive = 0, simd_waiting = 0;
    for (const Lane& l : S->lanes) {
      alive += l.wait != Wait::Done;
      simd_waiting += l.wait == Wait::Simd;
    }
    if (alive == 0) return true;
    if (S->at_barrier == alive && simd_waiting == 0 && alive < n) {
      S->error = "a thread returned before a threadgroup_barrier the other " +
                 std::to_string(alive) + " reach";
      return false;
    }
    if (S->at_barrier == alive && simd_waiting == 0) {
      for (Lane& l : S->lanes)
        if (l.wait == Wait::Barrier) l.wait = Wait::Run;
      S->at_barrier = 0;
      continue;
    }
    S->error = "deadlock: " + std::to_string(S->at_barrier) + " of " + std::to_string(alive) +
               " live threads wait at threadgroup_barrier and " + std::to_string(simd_waiting) +
               " at a simdgroup operation (a barrier not every thread reaches, or simdgroup "
               "operations on diverged paths)";
    return false;
  }
}

}  // namespace

const Builtins& builtins() { return S->cur->b; }

void barrier() {
  S->cur->wait = Wait::Barrier;
  S->at_barrier++;
  yield();
}

void simd_exchange(uint32_t op, uint64_t value, uint64_t lanes[SIMD_WIDTH], uint64_t* mask) {
  Lane* l = S->cur;
  const uint32_t sg = l->b.simdgroup_index_in_threadgroup;
  const int p = (int)(l->simd_phase & 1);
  Simd& s = S->simd[sg];
  if (s.arrived[p] == 0) {
    s.op[p] = op;
    s.mask[p] = 0;
    s.released[p] = false;
    for (uint32_t i = 0; i < SIMD_WIDTH; i++) s.slot[p][i] = POISON;
  } else if (s.op[p] != op) {
    fail("simdgroup lanes reached different simdgroup operations (diverged paths)");
  }
  const uint32_t lane = l->b.thread_index_in_simdgroup;
  s.slot[p][lane] = value;
  s.mask[p] |= 1ull << lane;
  s.arrived[p]++;
  l->wait = Wait::Simd;
  try_release(sg, p);
  yield();
  std::memcpy(lanes, s.slot[p], sizeof(s.slot[p]));
  *mask = s.mask[p];
  if (++s.read[p] == s.arrived[p]) {
    s.arrived[p] = 0;
    s.read[p] = 0;
  }
  l->simd_phase++;
}

void fail(const std::string& message) {
  if (S->error.empty()) S->error = message;
  swapcontext(&S->cur->ctx, &S->sched);
  std::abort();  // the dispatch ended; this fiber is never resumed
}

std::string dispatch(Dim3 groups, Dim3 threads, Order order, uint64_t seed,
                     const std::function<void()>& body) {
  const uint64_t n = (uint64_t)threads.x * threads.y * threads.z;
  if (n == 0 || n > 1024) return "threads per threadgroup must be 1..1024, got " + std::to_string(n);
  State st;
  State* outer = S;
  S = &st;
  st.body = &body;
  st.lanes.resize(n);
  st.stacks.resize(n);
  for (auto& s : st.stacks) s.reset(new char[STACK_BYTES]);
  st.simd.resize((n + SIMD_WIDTH - 1) / SIMD_WIDTH);
  std::mt19937_64 rng(seed);
  std::string err;
  // Threadgroups in the order's order too: forward, reverse, or shuffled, so a kernel whose
  // threadgroups depend on each other's order (the split merge's last one) meets every case.
  std::vector<uint64_t> order_of;
  const uint64_t n_groups = (uint64_t)groups.x * groups.y * groups.z;
  order_of.reserve(n_groups);
  for (uint64_t g = 0; g < n_groups; g++) order_of.push_back(g);
  if (order == Order::Reverse) std::reverse(order_of.begin(), order_of.end());
  if (order == Order::Random) std::shuffle(order_of.begin(), order_of.end(), rng);
  for (uint64_t gi = 0; gi < n_groups && err.empty(); gi++) {
    const uint32_t gx = (uint32_t)(order_of[gi] % groups.x);
    const uint32_t gy = (uint32_t)(order_of[gi] / groups.x % groups.y);
    const uint32_t gz = (uint32_t)(order_of[gi] / groups.x / groups.y);
    st.at_barrier = 0;
    for (auto& s : st.simd) s = Simd{};
    uint32_t i = 0;
    for (uint32_t tz = 0; tz < threads.z; tz++)
      for (uint32_t ty = 0; ty < threads.y; ty++)
        for (uint32_t tx = 0; tx < threads.x; tx++, i++) {
          Lane& l = st.lanes[i];
          l.wait = Wait::Run;
          l.simd_phase = 0;
          l.b.thread_position_in_threadgroup = {tx, ty, tz};
          l.b.threadgroup_position_in_grid = {gx, gy, gz};
          l.b.threads_per_threadgroup = threads;
          l.b.threadgroups_per_grid = groups;
          l.b.thread_position_in_grid = {gx * threads.x + tx, gy * threads.y + ty,
                                         gz * threads.z + tz};
          l.b.thread_index_in_threadgroup = i;
          l.b.thread_index_in_simdgroup = i % SIMD_WIDTH;
          l.b.simdgroup_index_in_threadgroup = i / SIMD_WIDTH;
          l.b.threads_per_simdgroup = SIMD_WIDTH;
          start_fiber(l, st.stacks[i].get());
        }
    if (!run_group(order, rng)) err = st.error;
  }
  S = outer;
  return err;
}

}  // namespace kvq_emu
