// A small Metal Shading Language shim so g++ can compile the exact kernel source that MLX's
// mx.fast.metal_kernel generates, and run every threadgroup of a launch on the CPU.
//
// Execution model: each Metal thread of a threadgroup is a fiber with its own stack; the
// threadgroups of a launch run one after another. Fibers switch only at synchronisation points,
// so a schedule is a choice of which runnable fiber goes next:
//   threadgroup_barrier   every live thread of the group must arrive before any goes on; a
//                         thread that finished while others wait is reported (divergent barrier)
//   simdgroup operations  simd_sum / simd_max / simdgroup_barrier and the simdgroup_matrix
//                         operations (load, store, multiply, multiply_accumulate): all 32 lanes
//                         of the simdgroup must arrive at the same operation with the same
//                         arguments (lockstep semantics); the last lane to arrive performs the
//                         operation for the whole simdgroup, then every lane goes on. Lanes that
//                         reach different operations, or a load/store with lane-dependent
//                         arguments, are reported.
// The runner replays a launch under several schedules (lowest id first, highest id first,
// seeded random); the Python side compares the outputs bit for bit, so a missing barrier shows
// up as a schedule-dependent result (or as a mismatch with the float64 spec). Threadgroup memory
// is filled with 0xFF bytes (NaN in every float format) when each threadgroup starts, so a read
// before the first write in the group shows up as NaN.
//
// simdgroup_matrix<T, 8, 8>: lane l holds row fm(l), columns fn(l) and fn(l) + 1, with
//   fm = ((l / 4) & 4) + ((l / 2) % 4),  fn = ((l / 4) & 2) * 2 + (l % 2) * 2
// (the layout of Apple GPUs that MLX's steel GEMM and gated-delta kernels read through
// thread_elements()). A default-constructed matrix holds NaN (Metal leaves it undefined).
// Products accumulate in float, in the order k = 0..7, onto the addend.
//
// Supported subset (see README.md): the address-space qualifiers device / constant / thread /
// threadgroup are erased, and kernel-scope `threadgroup T name[N];` arrays are turned into
// storage shared by the fibers of the running group by harness.translation_unit (which also
// poisons them); uint/uint3/ulong/ulong2; float, half, bfloat16_t (conversions to and from
// float); metal::exp/log/max/min/abs/sqrt/fma/select; threadgroup_barrier(mem_flags::*);
// simd_sum, simd_max, simdgroup_barrier; simdgroup_matrix<T, 8, 8> with simdgroup_load,
// simdgroup_store (elements_per_row, transpose; matrix_origin only 0), simdgroup_multiply,
// simdgroup_multiply_accumulate, make_filled_simdgroup_matrix, thread_elements(); the
// thread-position attributes MLX passes.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace mtl_harness {

constexpr unsigned kSimdWidth = 32;

// ---- fibers ---------------------------------------------------------------------------------
// On x86-64 a fiber switch saves the callee-saved registers and swaps stack pointers (a few ns);
// elsewhere it falls back to ucontext (which makes two system calls per switch).
#if defined(__x86_64__)
extern "C" void mtl_harness_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .p2align 4
  .hidden mtl_harness_switch
  .globl mtl_harness_switch
  .type mtl_harness_switch, @function
mtl_harness_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size mtl_harness_switch, .-mtl_harness_switch
)");

struct Context {
  void* sp = nullptr;
};
inline void switch_context(Context& from, Context& to) { mtl_harness_switch(&from.sp, to.sp); }
inline void start_context(Context& context, std::vector<char>& stack, void (*entry)()) {
  uintptr_t top = (reinterpret_cast<uintptr_t>(stack.data()) + stack.size()) & ~uintptr_t(15);
  void** sp = reinterpret_cast<void**>(top);
  *--sp = nullptr;                         // entry's return address slot (entry never returns)
  *--sp = reinterpret_cast<void*>(entry);  // popped by `ret` in mtl_harness_switch
  for (int i = 0; i < 6; ++i) *--sp = nullptr;  // rbp rbx r12 r13 r14 r15
  context.sp = sp;
}
#else
struct Context {
  ucontext_t context;
};
inline void switch_context(Context& from, Context& to) { swapcontext(&from.context, &to.context); }
inline void start_context(Context& c, std::vector<char>& stack, void (*entry)()) {
  getcontext(&c.context);
  c.context.uc_stack.ss_sp = stack.data();
  c.context.uc_stack.ss_size = stack.size();
  c.context.uc_link = nullptr;
  makecontext(&c.context, entry, 0);
}
#endif

struct Ids {
  unsigned tpig[3], tpitg[3], tgpig[3], tptg[3];
  unsigned lane, simdgroup, simdgroups;
};

enum class State { Runnable, AtBarrier, AtSimd, Done, Failed };

struct Fiber {
  Context context;
  std::vector<char> stack;
  State state = State::Runnable;
  Ids ids;
};

struct SimdGroup {
  unsigned arrived = 0;
  int op = -1;
  const char* op_name = "";
  void* payload[kSimdWidth];
};

struct ThreadgroupArray {
  void* address;
  size_t bytes;
  uint64_t generation;
};

struct Group {
  std::vector<Fiber> fibers;
  std::vector<SimdGroup> simdgroups;
  std::vector<ThreadgroupArray> arrays;
  unsigned barrier_arrived = 0;
  unsigned current = 0;
  uint64_t generation = 0;  // which threadgroup of the launch is running
  Context scheduler;
  std::string error;
  bool failed = false;
  const std::function<void(const Ids&)>* body = nullptr;
  uint64_t barriers = 0, simd_ops = 0;
};

// The running group of this OS thread (kernels reach it from the free functions below).
inline thread_local Group* running = nullptr;
// Bytes of kernel-scope threadgroup arrays seen in the last launch (read by the Python side).
inline size_t last_threadgroup_bytes = 0;

inline void yield_to_scheduler() {
  Group& group = *running;
  switch_context(group.fibers[group.current].context, group.scheduler);
}

// Report a misuse from inside a kernel: the launch stops with this message.
[[noreturn]] inline void fail(const std::string& message) {
  Group& group = *running;
  if (!group.failed) {
    group.failed = true;
    const Ids& ids = group.fibers[group.current].ids;
    group.error = "thread " + std::to_string(group.current) + " (simdgroup " + std::to_string(ids.simdgroup) +
                  ", lane " + std::to_string(ids.lane) + "): " + message;
  }
  group.fibers[group.current].state = State::Failed;
  for (;;) yield_to_scheduler();
}

inline void fiber_entry() {
  Group& group = *running;
  (*group.body)(group.fibers[group.current].ids);
  group.fibers[group.current].state = State::Done;
  for (;;) yield_to_scheduler();  // never resumed once Done
}

inline unsigned live_threads(const Group& group) {
  unsigned n = 0;
  for (const Fiber& f : group.fibers) n += f.state != State::Done;
  return n;
}

// Kernel-scope threadgroup arrays call this where they are declared: the first thread of each
// threadgroup to get there fills the array with 0xFF bytes (NaN), the others leave it alone.
inline void threadgroup_array(void* address, size_t bytes) {
  Group& group = *running;
  for (ThreadgroupArray& a : group.arrays) {
    if (a.address == address) {
      if (a.generation != group.generation) {
        std::memset(address, 0xFF, bytes);
        a.generation = group.generation;
      }
      return;
    }
  }
  std::memset(address, 0xFF, bytes);
  group.arrays.push_back({address, bytes, group.generation});
  last_threadgroup_bytes += bytes;
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

// One simdgroup-wide operation: every lane hands in a pointer to its own payload (on its stack,
// which stays valid while it waits); the last lane to arrive runs `complete` over all 32.
enum Op { OpSum = 1, OpMax, OpBarrier, OpLoad, OpStore, OpMultiply, OpMultiplyAccumulate };

template <typename Payload, typename Complete>
inline void simd_collective(int op, const char* name, Payload& mine, Complete complete) {
  Group& group = *running;
  group.simd_ops++;
  Fiber& self = group.fibers[group.current];
  SimdGroup& simd = group.simdgroups[self.ids.simdgroup];
  if (simd.arrived == 0) {
    simd.op = op;
    simd.op_name = name;
  } else if (simd.op != op) {
    fail(std::string("lanes of one simdgroup reached different simdgroup operations (") + simd.op_name + " and " +
         name + "): divergent control flow");
  }
  simd.payload[self.ids.lane] = &mine;
  self.state = State::AtSimd;
  if (++simd.arrived == kSimdWidth) {
    simd.arrived = 0;
    Payload* lanes[kSimdWidth];
    for (unsigned i = 0; i < kSimdWidth; ++i) lanes[i] = static_cast<Payload*>(simd.payload[i]);
    complete(lanes);
    unsigned first = self.ids.simdgroup * kSimdWidth;
    for (unsigned i = 0; i < kSimdWidth; ++i) group.fibers[first + i].state = State::Runnable;
    return;
  }
  yield_to_scheduler();
}

template <typename Reduce>
inline float simd_reduce(int op, const char* name, float x, Reduce reduce) {
  struct Payload {
    float in, out;
  } mine{x, 0.f};
  simd_collective(op, name, mine, [&](Payload** lanes) {
    float r = lanes[0]->in;
    for (unsigned i = 1; i < kSimdWidth; ++i) r = reduce(r, lanes[i]->in);
    for (unsigned i = 0; i < kSimdWidth; ++i) lanes[i]->out = r;
  });
  return mine.out;
}

enum Schedule { LowestFirst = 0, HighestFirst = 1, Random = 2 };

// Runs one threadgroup to completion; returns false (with group.error set) on a deadlock, a
// divergent barrier or a misuse reported by fail().
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
    switch_context(group.scheduler, group.fibers[pick].context);
    if (group.failed) return false;
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
  last_threadgroup_bytes = 0;
  unsigned groups[3] = {grid[0] / tg[0], grid[1] / tg[1], grid[2] / tg[2]};
  for (unsigned gz = 0; gz < groups[2]; ++gz)
    for (unsigned gy = 0; gy < groups[1]; ++gy)
      for (unsigned gx = 0; gx < groups[0]; ++gx) {
        group.barrier_arrived = 0;
        group.generation++;
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
          start_context(f.context, f.stack, fiber_entry);
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

struct ulong2 {
  ulong x, y;
  ulong2() : x(0), y(0) {}
  explicit ulong2(ulong v) : x(v), y(v) {}
  ulong2(ulong a, ulong b) : x(a), y(b) {}
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
inline float simd_sum(float x) {
  return mtl_harness::simd_reduce(mtl_harness::OpSum, "simd_sum", x, [](float a, float b) { return a + b; });
}
inline float simd_max(float x) {
  return mtl_harness::simd_reduce(mtl_harness::OpMax, "simd_max", x, [](float a, float b) { return a > b ? a : b; });
}
inline void simdgroup_barrier(mem_flags) {
  struct Payload {
  } mine;
  mtl_harness::simd_collective(mtl_harness::OpBarrier, "simdgroup_barrier", mine, [](Payload**) {});
}

// ---- simdgroup_matrix ------------------------------------------------------------------------
namespace detail {
inline unsigned fragment_row(unsigned lane) { return ((lane / 4) & 4) + ((lane / 2) % 4); }
inline unsigned fragment_col(unsigned lane) { return ((lane / 4) & 2) * 2 + (lane % 2) * 2; }

template <typename T>
struct Elements {  // Metal: thread vec<T, 2>&
  T value[2];
  T& operator[](unsigned i) {
    if (i > 1) mtl_harness::fail("thread_elements() index " + std::to_string(i) + " out of range (2 elements per lane)");
    return value[i];
  }
  const T& operator[](unsigned i) const {
    if (i > 1) mtl_harness::fail("thread_elements() index " + std::to_string(i) + " out of range (2 elements per lane)");
    return value[i];
  }
};
}  // namespace detail

template <typename T, int Cols, int Rows = Cols>
struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "the harness supports 8x8 simdgroup matrices only");
  detail::Elements<T> elements;
  simdgroup_matrix() {  // undefined in Metal: NaN here, so that a use before a write shows
    elements.value[0] = elements.value[1] = T(std::numeric_limits<float>::quiet_NaN());
  }
  detail::Elements<T>& thread_elements() { return elements; }
  const detail::Elements<T>& thread_elements() const { return elements; }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat16_t, 8, 8> simdgroup_bfloat8x8;

template <typename T, int Cols, int Rows = Cols>
inline simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T value) {
  simdgroup_matrix<T, Cols, Rows> m;
  m.elements.value[0] = m.elements.value[1] = value;
  return m;
}

namespace detail {
template <typename T>
inline void gather(const simdgroup_matrix<T, 8, 8>* const* lanes, float (&full)[8][8]) {
  for (unsigned l = 0; l < mtl_harness::kSimdWidth; ++l)
    for (unsigned e = 0; e < 2; ++e) full[fragment_row(l)][fragment_col(l) + e] = float(lanes[l]->elements.value[e]);
}
template <typename T>
inline void scatter(simdgroup_matrix<T, 8, 8>* const* lanes, const float (&full)[8][8]) {
  for (unsigned l = 0; l < mtl_harness::kSimdWidth; ++l)
    for (unsigned e = 0; e < 2; ++e) lanes[l]->elements.value[e] = T(full[fragment_row(l)][fragment_col(l) + e]);
}

template <typename Payload>
inline void require_uniform(Payload** lanes, const char* name) {
  for (unsigned l = 1; l < mtl_harness::kSimdWidth; ++l) {
    if (lanes[l]->pointer != lanes[0]->pointer || lanes[l]->stride != lanes[0]->stride ||
        lanes[l]->transpose != lanes[0]->transpose)
      mtl_harness::fail(std::string(name) + " with different pointer, elements_per_row or transpose across lanes");
  }
  if (lanes[0]->origin.x != 0 || lanes[0]->origin.y != 0)
    mtl_harness::fail(std::string(name) + ": a matrix_origin other than 0 is outside the harness subset");
}
}  // namespace detail

// Element (r, c) of the matrix is src[r * elements_per_row + c], or src[c * elements_per_row + r]
// when transposed.
template <typename T, typename P>
inline void simdgroup_load(simdgroup_matrix<T, 8, 8>& d, P src, ulong elements_per_row = 8, ulong2 origin = ulong2(0),
                           bool transpose_matrix = false) {
  static_assert(std::is_same<typename std::remove_cv<typename std::remove_pointer<P>::type>::type, T>::value,
                "simdgroup_load: the pointer's element type must be the matrix's");
  struct Payload {
    simdgroup_matrix<T, 8, 8>* matrix;
    P pointer;
    ulong stride;
    bool transpose;
    ulong2 origin;
  } mine{&d, src, elements_per_row, transpose_matrix, origin};
  mtl_harness::simd_collective(mtl_harness::OpLoad, "simdgroup_load", mine, [](Payload** lanes) {
    detail::require_uniform(lanes, "simdgroup_load");
    const Payload& p = *lanes[0];
    for (unsigned l = 0; l < mtl_harness::kSimdWidth; ++l)
      for (unsigned e = 0; e < 2; ++e) {
        ulong r = detail::fragment_row(l), c = detail::fragment_col(l) + e;
        lanes[l]->matrix->elements.value[e] = p.transpose ? p.pointer[c * p.stride + r] : p.pointer[r * p.stride + c];
      }
  });
}

template <typename T, typename P>
inline void simdgroup_store(const simdgroup_matrix<T, 8, 8>& s, P dst, ulong elements_per_row = 8,
                            ulong2 origin = ulong2(0), bool transpose_matrix = false) {
  static_assert(std::is_same<typename std::remove_pointer<P>::type, T>::value,
                "simdgroup_store: the pointer's element type must be the matrix's");
  struct Payload {
    const simdgroup_matrix<T, 8, 8>* matrix;
    P pointer;
    ulong stride;
    bool transpose;
    ulong2 origin;
  } mine{&s, dst, elements_per_row, transpose_matrix, origin};
  mtl_harness::simd_collective(mtl_harness::OpStore, "simdgroup_store", mine, [](Payload** lanes) {
    detail::require_uniform(lanes, "simdgroup_store");
    const Payload& p = *lanes[0];
    for (unsigned l = 0; l < mtl_harness::kSimdWidth; ++l)
      for (unsigned e = 0; e < 2; ++e) {
        ulong r = detail::fragment_row(l), c = detail::fragment_col(l) + e;
        (p.transpose ? p.pointer[c * p.stride + r] : p.pointer[r * p.stride + c]) = lanes[l]->matrix->elements.value[e];
      }
  });
}

// d = a * b + c (each argument may alias another: all operands are read before d is written).
template <typename T>
inline void simdgroup_multiply_accumulate(simdgroup_matrix<T, 8, 8>& d, const simdgroup_matrix<T, 8, 8>& a,
                                          const simdgroup_matrix<T, 8, 8>& b, const simdgroup_matrix<T, 8, 8>& c) {
  struct Payload {
    simdgroup_matrix<T, 8, 8>* d;
    const simdgroup_matrix<T, 8, 8>*a, *b, *c;
  } mine{&d, &a, &b, &c};
  mtl_harness::simd_collective(mtl_harness::OpMultiplyAccumulate, "simdgroup_multiply_accumulate", mine,
                               [](Payload** lanes) {
    const simdgroup_matrix<T, 8, 8>* pa[mtl_harness::kSimdWidth];
    const simdgroup_matrix<T, 8, 8>* pb[mtl_harness::kSimdWidth];
    const simdgroup_matrix<T, 8, 8>* pc[mtl_harness::kSimdWidth];
    simdgroup_matrix<T, 8, 8>* pd[mtl_harness::kSimdWidth];
    for (unsigned l = 0; l < mtl_harness::kSimdWidth; ++l)
      pa[l] = lanes[l]->a, pb[l] = lanes[l]->b, pc[l] = lanes[l]->c, pd[l] = lanes[l]->d;
    float A[8][8], B[8][8], C[8][8], D[8][8];
    detail::gather(pa, A);
    detail::gather(pb, B);
    detail::gather(pc, C);
    for (int i = 0; i < 8; ++i)
      for (int j = 0; j < 8; ++j) {
        float acc = C[i][j];
        for (int k = 0; k < 8; ++k) acc = std::fma(A[i][k], B[k][j], acc);
        D[i][j] = acc;
      }
    detail::scatter(pd, D);
  });
}

template <typename T>
inline void simdgroup_multiply(simdgroup_matrix<T, 8, 8>& d, const simdgroup_matrix<T, 8, 8>& a,
                               const simdgroup_matrix<T, 8, 8>& b) {
  struct Payload {
    simdgroup_matrix<T, 8, 8>* d;
    const simdgroup_matrix<T, 8, 8>*a, *b;
  } mine{&d, &a, &b};
  mtl_harness::simd_collective(mtl_harness::OpMultiply, "simdgroup_multiply", mine, [](Payload** lanes) {
    const simdgroup_matrix<T, 8, 8>* pa[mtl_harness::kSimdWidth];
    const simdgroup_matrix<T, 8, 8>* pb[mtl_harness::kSimdWidth];
    simdgroup_matrix<T, 8, 8>* pd[mtl_harness::kSimdWidth];
    for (unsigned l = 0; l < mtl_harness::kSimdWidth; ++l) pa[l] = lanes[l]->a, pb[l] = lanes[l]->b, pd[l] = lanes[l]->d;
    float A[8][8], B[8][8], D[8][8];
    detail::gather(pa, A);
    detail::gather(pb, B);
    for (int i = 0; i < 8; ++i)
      for (int j = 0; j < 8; ++j) {
        float acc = 0.f;
        for (int k = 0; k < 8; ++k) acc = std::fma(A[i][k], B[k][j], acc);
        D[i][j] = acc;
      }
    detail::scatter(pd, D);
  });
}
}  // namespace metal
using namespace metal;

// ---- address spaces and attributes ----------------------------------------------------------
#define device
#define constant
#define thread
// Kernel-scope `threadgroup T name[N];` declarations are rewritten by harness.translation_unit
// into storage shared by the fibers of the running group; elsewhere (pointers, parameters) the
// qualifier is erased.
#define threadgroup
