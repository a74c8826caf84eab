// Builds graphpar's paged-attention CUDA source for the host (see cuda_host_emulation.h) and
// exposes a cuLaunchKernel-like entry point to Python (ctypes):
//
//   const char* emu_launch(const char* kernel, unsigned gx, unsigned gy, unsigned gz,
//                          unsigned bx, void** params)
//
// params[i] points at the value of the kernel's i-th parameter, exactly as for cuLaunchKernel.
// Returns nullptr on success or an error message.
//
//   long long emu_kv_bytes_read(int reset)
//
// Bytes the kernels read from the K/V caches (GP_COUNT_KV_BYTES) since the last reset; a
// non-zero `reset` starts a new count after reading.
//
// Build: g++ -std=c++20 -O1 -shared -fPIC -DGP_KERNEL_SOURCE='"<path>.cu"' cuda_host_harness.cpp

#define GRAPHPAR_HOST_EMULATION 1
#include "cuda_host_emulation.h"

#include GP_KERNEL_SOURCE

#include <cstring>
#include <type_traits>
#include <utility>

namespace {

template <typename... A, std::size_t... I>
void call_with(void (*kernel)(A...), void** params, std::index_sequence<I...>) {
  kernel(*static_cast<std::remove_reference_t<A>*>(params[I])...);
}

template <typename... A>
void call(void (*kernel)(A...), void** params) {
  call_with(kernel, params, std::index_sequence_for<A...>{});
}

struct Entry {
  const char* name;
  void (*invoke)(void**);
};

#define GP_EMU_ATTENTION(T, NAME, D) \
  {"paged_attention_" #NAME "_h" #D, [](void** p) { call(paged_attention_##NAME##_h##D, p); }},
#define GP_EMU_ATTENTION_ALL_HEADS(T, NAME) GP_FOR_EACH_HEAD_SIZE(GP_EMU_ATTENTION, T, NAME)
#define GP_EMU_REDUCE(T, NAME) \
  {"paged_attention_reduce_" #NAME, [](void** p) { call(paged_attention_reduce_##NAME, p); }},

const Entry kEntries[] = {
    GP_FOR_EACH_DTYPE(GP_EMU_ATTENTION_ALL_HEADS) GP_FOR_EACH_DTYPE(GP_EMU_REDUCE)
    {"reshape_and_cache", [](void** p) { call(reshape_and_cache, p); }},
    {"copy_blocks", [](void** p) { call(copy_blocks, p); }},
};

struct Job {
  void (*invoke)(void**);
  void** params;
};

void run_job(void* arg) {
  Job* job = static_cast<Job*>(arg);
  job->invoke(job->params);
}

}  // namespace

extern "C" const char* emu_launch(const char* kernel, unsigned gx, unsigned gy, unsigned gz,
                                  unsigned bx, void** params) {
  const Entry* entry = nullptr;
  for (const Entry& e : kEntries) {
    if (std::strcmp(e.name, kernel) == 0) entry = &e;
  }
  if (!entry) return "no such kernel";
  gridDim = EmuDim3{gx, gy, gz};
  blockDim = EmuDim3{bx, 1, 1};
  Job job{entry->invoke, params};
  for (unsigned z = 0; z < gz; ++z) {
    for (unsigned y = 0; y < gy; ++y) {
      for (unsigned x = 0; x < gx; ++x) {
        blockIdx = EmuDim3{x, y, z};
        if (const char* err = emu::run_block(static_cast<int>(bx), run_job, &job)) return err;
      }
    }
  }
  return nullptr;
}

extern "C" long long emu_kv_bytes_read(int reset) {
  const long long bytes = emu::g_kv_bytes_read;
  if (reset) emu::g_kv_bytes_read = 0;
  return bytes;
}
