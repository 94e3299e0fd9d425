// A small Metal Shading Language shim so g++ can compile the exact kernel source that MLX's
// mx.fast.metal_kernel generates, and run every threadgroup of a launch on the CPU.
//
// Execution model: each Metal thread of a threadgroup is a fiber (ucontext) with its own stack;
// the threadgroups of a launch run one after another. Fibers switch only at synchronisation
// points, so a schedule is a choice of which runnable fiber goes next:
//   threadgroup_barrier  every live thread of the group must arrive before any goes on; a
//                        thread that finished while others wait is reported (divergent barrier)
//   simd_sum / simd_max  all 32 lanes of the simdgroup must arrive (lockstep semantics); the
//                        reduction is computed once, in lane order, and handed to every lane
// The runner replays a launch under several schedules (lowest id first, highest id first,
// seeded random); the Python side compares the outputs bit for bit, so a missing barrier shows
// up as a schedule-dependent result (or as a mismatch with the float64 spec).
//
// Supported subset (see README.md): the address-space qualifiers device / constant / thread on
// pointers and `threadgroup` ONLY on arrays declared at kernel scope (they become storage shared
// by the fibers of the running group); uint/uint3/ulong; float, half, bfloat16_t (conversions to
// and from float); metal::exp/log/max/min/abs/sqrt/fma/select; threadgroup_barrier(mem_flags::*);
// simd_sum, simd_max; the thread-position attributes MLX passes (thread_position_in_grid,
// thread_position_in_threadgroup, threadgroup_position_in_grid, threads_per_threadgroup,
// thread_index_in_simdgroup, simdgroup_index_in_threadgroup, simdgroups_per_threadgroup).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <ucontext.h>
#include <vector>

namespace mtl_harness {

constexpr unsigned kSimdWidth = 32;

struct Ids {
  unsigned tpig[3], tpitg[3], tgpig[3], tptg[3];
  unsigned lane, simdgroup, simdgroups;
};

enum class State { Runnable, AtBarrier, AtSimd, Done };

struct Fiber {
  ucontext_t context;
  std::vector<char> stack;
  State state = State::Runnable;
  Ids ids;
};

struct SimdGroup {
  float slots[kSimdWidth];
  unsigned arrived = 0;
  float result = 0.f;
};

struct Group {
  std::vector<Fiber> fibers;
  std::vector<SimdGroup> simdgroups;
  unsigned barrier_arrived = 0;
  unsigned current = 0;
  ucontext_t scheduler;
  std::string error;
  const std::function<void(const Ids&)>* body = nullptr;
  uint64_t barriers = 0, simd_ops = 0;
};

// The running group of this OS thread (kernels reach it from the free functions below).
inline thread_local Group* running = nullptr;

inline void yield_to_scheduler() {
  Group& group = *running;
  swapcontext(&group.fibers[group.current].context, &group.scheduler);
}

inline void fiber_entry() {
  Group& group = *running;
  Fiber& self = group.fibers[group.current];
  (*group.body)(self.ids);
  group.fibers[group.current].state = State::Done;
  // returning goes to uc_link (the scheduler)
}

inline unsigned live_threads(const Group& group) {
  unsigned n = 0;
  for (const Fiber& f : group.fibers) n += f.state != State::Done;
  return n;
}

inline void barrier() {
  Group& group = *running;
  group.barriers++;
  Fiber& self = group.fibers[group.current];
  self.state = State::AtBarrier;
  group.barrier_arrived++;
  if (group.barrier_arrived == group.fibers.size()) {
    group.barrier_arrived = 0;
    for (Fiber& f : group.fibers) f.state = State::Runnable;
    return;  // the last one to arrive goes on; the schedule decides the order of the rest
  }
  yield_to_scheduler();
}

template <typename Reduce>
inline float simd_collective(float x, Reduce reduce) {
  Group& group = *running;
  group.simd_ops++;
  Fiber& self = group.fibers[group.current];
  SimdGroup& simd = group.simdgroups[self.ids.simdgroup];
  simd.slots[self.ids.lane] = x;
  self.state = State::AtSimd;
  if (++simd.arrived == kSimdWidth) {
    float r = simd.slots[0];
    for (unsigned i = 1; i < kSimdWidth; ++i) r = reduce(r, simd.slots[i]);
    simd.result = r;
    simd.arrived = 0;
    unsigned first = self.ids.simdgroup * kSimdWidth;
    for (unsigned i = 0; i < kSimdWidth; ++i) group.fibers[first + i].state = State::Runnable;
    return r;
  }
  yield_to_scheduler();
  return simd.result;
}

enum Schedule { LowestFirst = 0, HighestFirst = 1, Random = 2 };

// Runs one threadgroup to completion; returns false (with group.error set) on a deadlock or a
// divergent barrier.
inline bool run_group(Group& group, int schedule, std::mt19937& rng) {
  std::vector<unsigned> runnable;
  for (;;) {
    runnable.clear();
    for (unsigned i = 0; i < group.fibers.size(); ++i)
      if (group.fibers[i].state == State::Runnable) runnable.push_back(i);
    if (runnable.empty()) {
      unsigned done = group.fibers.size() - live_threads(group);
      if (done == group.fibers.size()) return true;
      group.error = "deadlock: " + std::to_string(group.barrier_arrived) + " threads wait at a threadgroup_barrier, " +
                    std::to_string(done) + " finished (divergent barrier or simd op)";
      return false;
    }
    unsigned pick;
    if (schedule == LowestFirst) pick = runnable.front();
    else if (schedule == HighestFirst) pick = runnable.back();
    else pick = runnable[std::uniform_int_distribution<unsigned>(0, runnable.size() - 1)(rng)];
    group.current = pick;
    swapcontext(&group.scheduler, &group.fibers[pick].context);
    if (group.barrier_arrived > 0 && group.barrier_arrived + (group.fibers.size() - live_threads(group)) ==
                                         group.fibers.size() && live_threads(group) < group.fibers.size()) {
      group.error = "divergent barrier: " + std::to_string(group.barrier_arrived) + " of " +
                    std::to_string(group.fibers.size()) + " threads wait at a threadgroup_barrier that the others never reach";
      return false;
    }
  }
}

// Runs a whole launch. grid = total threads per axis (MLX dispatch_threads), tg = threads per group.
inline int run_grid(const unsigned* grid, const unsigned* tg, int schedule, unsigned seed, size_t stack_bytes,
                    const std::function<void(const Ids&)>& body, char* error, int error_len) {
  for (int d = 0; d < 3; ++d) {
    if (tg[d] == 0 || grid[d] % tg[d] != 0) {
      std::snprintf(error, error_len, "grid %u not a multiple of threadgroup %u on axis %d", grid[d], tg[d], d);
      return 1;
    }
  }
  unsigned threads = tg[0] * tg[1] * tg[2];
  if (threads % kSimdWidth != 0) {
    std::snprintf(error, error_len, "threadgroup size %u is not a multiple of the simd width", threads);
    return 1;
  }
  Group group;
  group.body = &body;
  group.fibers.resize(threads);
  group.simdgroups.resize(threads / kSimdWidth);
  for (Fiber& f : group.fibers) f.stack.resize(stack_bytes);
  std::mt19937 rng(seed);
  running = &group;
  unsigned groups[3] = {grid[0] / tg[0], grid[1] / tg[1], grid[2] / tg[2]};
  for (unsigned gz = 0; gz < groups[2]; ++gz)
    for (unsigned gy = 0; gy < groups[1]; ++gy)
      for (unsigned gx = 0; gx < groups[0]; ++gx) {
        group.barrier_arrived = 0;
        for (SimdGroup& s : group.simdgroups) s.arrived = 0;
        for (unsigned i = 0; i < threads; ++i) {
          Fiber& f = group.fibers[i];
          unsigned x = i % tg[0], y = (i / tg[0]) % tg[1], z = i / (tg[0] * tg[1]);
          Ids& ids = f.ids;
          ids.tpitg[0] = x, ids.tpitg[1] = y, ids.tpitg[2] = z;
          ids.tgpig[0] = gx, ids.tgpig[1] = gy, ids.tgpig[2] = gz;
          ids.tpig[0] = gx * tg[0] + x, ids.tpig[1] = gy * tg[1] + y, ids.tpig[2] = gz * tg[2] + z;
          ids.tptg[0] = tg[0], ids.tptg[1] = tg[1], ids.tptg[2] = tg[2];
          ids.lane = i % kSimdWidth, ids.simdgroup = i / kSimdWidth, ids.simdgroups = threads / kSimdWidth;
          f.state = State::Runnable;
          getcontext(&f.context);
          f.context.uc_stack.ss_sp = f.stack.data();
          f.context.uc_stack.ss_size = f.stack.size();
          f.context.uc_link = &group.scheduler;
          makecontext(&f.context, fiber_entry, 0);
        }
        if (!run_group(group, schedule, rng)) {
          std::snprintf(error, error_len, "threadgroup (%u, %u, %u): %s", gx, gy, gz, group.error.c_str());
          running = nullptr;
          return 2;
        }
      }
  running = nullptr;
  return 0;
}

}  // namespace mtl_harness

// ---- Metal types -------------------------------------------------------------------------
typedef unsigned int uint;
typedef unsigned long ulong;
typedef unsigned short ushort;
typedef _Float16 half;
typedef _Float16 float16_t;  // MLX spells half this way in generated signatures

struct uint3 {
  uint x, y, z;
};

// bfloat16: upper half of a float32, round to nearest even on conversion from float.
struct bfloat16_t {
  uint16_t bits;
  bfloat16_t() = default;
  bfloat16_t(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) bits = uint16_t((u >> 16) | 0x40u);  // NaN stays NaN
    else bits = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

namespace metal {
using std::abs;
using std::exp;
using std::fma;
using std::log;
using std::sqrt;
template <typename T>
inline T max(T a, T b) { return a > b ? a : b; }
template <typename T>
inline T min(T a, T b) { return a < b ? a : b; }
template <typename T>
inline T select(T a, T b, bool c) { return c ? b : a; }
namespace fast {
using std::exp;
using std::log;
}  // namespace fast
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2 };
inline void threadgroup_barrier(mem_flags) { mtl_harness::barrier(); }
inline float simd_sum(float x) { return mtl_harness::simd_collective(x, [](float a, float b) { return a + b; }); }
inline float simd_max(float x) { return mtl_harness::simd_collective(x, [](float a, float b) { return a > b ? a : b; }); }
}  // namespace metal
using namespace metal;

// ---- address spaces and attributes ----------------------------------------------------------
#define device
#define constant
#define thread
// Kernel-scope `threadgroup T name[N];` becomes storage shared by the fibers of the running group.
#define threadgroup static thread_local
