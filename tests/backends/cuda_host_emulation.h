// Host emulation of the CUDA subset used by graphpar/backends/cuda/paged_attention.cu, so the
// kernels' own source runs on a CPU in tests (no GPU in CI).
//
// Each CUDA thread of a block is a fiber (ucontext); blocks run one after another, so
// `__shared__` can simply be `static`. __syncthreads() and __shfl_xor_sync() are barriers over
// the block / the warp. A thread that exits drops out of its barriers; afterwards the harness
// checks that every lane of a warp made the same number of shuffles and every thread the same
// number of __syncthreads(), which catches divergent use of full-mask shuffles and barriers
// (undefined behaviour on a GPU). Only full masks (0xffffffff) are accepted.
#pragma once

#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define GP_COUNT_KV_BYTES(bytes) (emu::g_kv_bytes_read += static_cast<long long>(bytes))

struct alignas(16) uint4 {
  unsigned x, y, z, w;
};

struct EmuDim3 {
  unsigned x = 1, y = 1, z = 1;
};

inline EmuDim3 gridDim, blockDim, blockIdx;
inline thread_local EmuDim3 threadIdx;  // set per fiber switch (see emu::switch_to)

inline int min(int a, int b) { return a < b ? a : b; }

inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct __half {
  unsigned short bits;
};
struct __nv_bfloat16 {
  unsigned short bits;
};

inline __half __ushort_as_half(unsigned short u) { return __half{u}; }
inline float __half2float(__half h) {
  _Float16 v;
  std::memcpy(&v, &h.bits, 2);
  return static_cast<float>(v);
}
inline __half __float2half_rn(float x) {
  _Float16 v = static_cast<_Float16>(x);  // round to nearest even
  __half h;
  std::memcpy(&h.bits, &v, 2);
  return h;
}
inline __nv_bfloat16 __float2bfloat16_rn(float x) {
  unsigned u;
  std::memcpy(&u, &x, 4);
  if (std::isnan(x)) return __nv_bfloat16{0x7fc0};
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return __nv_bfloat16{static_cast<unsigned short>(u >> 16)};
}

namespace emu {

// Bytes the kernels read from the K/V caches since the last reset (GP_COUNT_KV_BYTES). Fibers
// share one OS thread, so a plain counter is exact.
inline long long g_kv_bytes_read = 0;

constexpr int kStackBytes = 256 * 1024;

struct Barrier {
  int expected = 0;  // live participants
  int arrived = 0;
  unsigned generation = 0;
  void arrive_done() {
    ++generation;
    arrived = 0;
  }
};

struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  bool finished = false;
  Barrier* waiting_on = nullptr;
  unsigned waiting_generation = 0;
  long long shuffles = 0;
  long long syncs = 0;
};

struct Block {
  ucontext_t scheduler;
  std::vector<Fiber> fibers;
  Barrier block_barrier;
  std::vector<Barrier> warp_barriers;
  std::vector<unsigned> exchange;  // [warp][parity][32] shuffle buffers
  int current = -1;
};

inline Block* g_block = nullptr;
inline void (*g_body)(void*) = nullptr;
inline void* g_body_arg = nullptr;

inline void wait(Barrier& b) {
  Block& blk = *g_block;
  Fiber& f = blk.fibers[blk.current];
  if (++b.arrived == b.expected) {
    b.arrive_done();
    return;
  }
  f.waiting_on = &b;
  f.waiting_generation = b.generation;
  swapcontext(&f.ctx, &blk.scheduler);
}

inline void drop(Barrier& b) {
  --b.expected;
  if (b.arrived > 0 && b.arrived == b.expected) b.arrive_done();
}

inline void fiber_main() {
  g_body(g_body_arg);
  Block& blk = *g_block;
  Fiber& f = blk.fibers[blk.current];
  f.finished = true;
  drop(blk.block_barrier);
  drop(blk.warp_barriers[blk.current / 32]);
  // returning resumes uc_link (the scheduler)
}

// Runs body(arg) as `threads` fibers of one block; returns an error string or nullptr.
inline const char* run_block(int threads, void (*body)(void*), void* arg) {
  static Block blk;
  static std::vector<std::vector<char>> stacks;
  const int warps = (threads + 31) / 32;
  blk.fibers.assign(threads, Fiber{});
  blk.block_barrier = Barrier{threads, 0, 0};
  blk.warp_barriers.assign(warps, Barrier{});
  for (int w = 0; w < warps; ++w) {
    blk.warp_barriers[w].expected = (w == warps - 1 && threads % 32) ? threads % 32 : 32;
  }
  blk.exchange.assign(static_cast<size_t>(warps) * 64, 0u);
  if (stacks.size() < static_cast<size_t>(threads)) stacks.resize(threads);
  g_block = &blk;
  g_body = body;
  g_body_arg = arg;
  for (int i = 0; i < threads; ++i) {
    Fiber& f = blk.fibers[i];
    if (stacks[i].empty()) stacks[i].resize(kStackBytes);
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = stacks[i].data();
    f.ctx.uc_stack.ss_size = stacks[i].size();
    f.ctx.uc_link = &blk.scheduler;
    makecontext(&f.ctx, fiber_main, 0);
  }
  int live = threads;
  while (live > 0) {
    bool progressed = false;
    for (int i = 0; i < threads; ++i) {
      Fiber& f = blk.fibers[i];
      if (f.finished) continue;
      if (f.waiting_on && f.waiting_on->generation == f.waiting_generation) continue;
      f.waiting_on = nullptr;
      blk.current = i;
      threadIdx.x = static_cast<unsigned>(i);
      swapcontext(&blk.scheduler, &f.ctx);
      progressed = true;
      if (f.finished) --live;
    }
    if (!progressed) return "deadlock: threads wait on a barrier the others never reach";
  }
  for (int w = 0; w < warps; ++w) {
    for (int i = w * 32; i < threads && i < (w + 1) * 32; ++i) {
      if (blk.fibers[i].shuffles != blk.fibers[w * 32].shuffles) {
        return "divergent full-mask shuffle: lanes of a warp made different numbers of shuffles";
      }
    }
  }
  for (int i = 0; i < threads; ++i) {
    if (blk.fibers[i].syncs != blk.fibers[0].syncs) {
      return "divergent __syncthreads: threads of a block reached different numbers of them";
    }
  }
  return nullptr;
}

}  // namespace emu

inline void __syncthreads() {
  emu::Block& blk = *emu::g_block;
  ++blk.fibers[blk.current].syncs;
  emu::wait(blk.block_barrier);
}

template <typename V>
inline V __shfl_xor_sync(unsigned mask, V v, int lane_mask) {
  static_assert(sizeof(V) == 4, "emulated shuffles move 32-bit values");
  if (mask != 0xffffffffu) {
    std::fprintf(stderr, "emulation supports only full-mask shuffles\n");
    std::abort();
  }
  emu::Block& blk = *emu::g_block;
  const int me = blk.current;
  const int warp = me / 32;
  const int lane = me % 32;
  emu::Fiber& f = blk.fibers[me];
  emu::Barrier& b = blk.warp_barriers[warp];
  // Double-buffered by barrier generation, so one barrier per shuffle suffices.
  unsigned* buf = blk.exchange.data() + (static_cast<size_t>(warp) * 2 + (b.generation & 1u)) * 32;
  unsigned bits;
  std::memcpy(&bits, &v, 4);
  buf[lane] = bits;
  ++f.shuffles;
  emu::wait(b);
  bits = buf[lane ^ lane_mask];
  std::memcpy(&v, &bits, 4);
  return v;
}
