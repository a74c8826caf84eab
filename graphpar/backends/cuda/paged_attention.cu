// Paged-attention kernels for graphpar (vLLM's design, PagedAttention paper §4.1 and §5).
//
// KV cache layout (shared by these kernels, graphpar/ir/paged_reference.py and the
// launcher graphpar/backends/cuda/paged_attention.py):
//
//   key_cache, value_cache : T[num_blocks, block_size, num_kv_heads, head_size]   (row-major)
//   block_tables           : int32[num_seqs, max_blocks_per_seq]   logical block -> physical block
//   context_lens           : int32[num_seqs]                       tokens cached per sequence
//   slot_mapping           : int64[num_tokens]  slot = physical_block * block_size + offset, -1 = skip
//
// Token `t` of a sequence lives in physical block block_tables[s][t / block_size] at offset
// t % block_size; its key for kv head h is the head_size contiguous elements at
// ((block * block_size + offset) * num_kv_heads + h) * head_size. head_size * sizeof(T) is a
// multiple of 32 bytes for every supported head size, so each such row is read with 16-byte
// vector loads and every 32-byte sector a warp touches is used in full.
//
// Entry points (extern "C", so CuPy's RawModule.get_function finds them by plain name):
//
//   paged_attention_<dt>_h<D>     one thread block per (head, sequence, partition); dt is f32, f16
//                                 or bf16, D is 64, 80, 96, 128 or 256. partition_size == 0: the
//                                 block covers the whole context and writes `out`; otherwise it
//                                 covers [part * partition_size, +partition_size) and writes its
//                                 normalised partial output, running max and exp-sum (split-K).
//                                 The last launched partition also takes every token past it,
//                                 so a launch with too few partitions is slower, never wrong.
//   paged_attention_reduce_<dt>   combines the split-K partials of one (head, sequence) into `out`
//                                 (at most the max_num_partitions that were launched).
//   reshape_and_cache             writes new K/V tokens into their cache slots (any dtype).
//   copy_blocks                   copies src -> dst blocks of many caches in one launch (CoW).
//
// All arithmetic is in fp32; fp16/bf16 are converted on load and rounded once on store.
//
// Bounds (block-table entries, context length vs table width, cache slots) are checked by the
// launcher on host metadata; building with -DGRAPHPAR_KERNEL_DEBUG also asserts them here.

#if !defined(GRAPHPAR_HOST_EMULATION)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

#if defined(GRAPHPAR_KERNEL_DEBUG) && !defined(GRAPHPAR_HOST_EMULATION)
// A trap, not assert(): NVRTC has no <assert.h>. The launch then fails with an illegal
// instruction that names the kernel.
#define GP_DEBUG_ASSERT(cond) \
  do {                        \
    if (!(cond)) __trap();    \
  } while (0)
#else
#define GP_DEBUG_ASSERT(cond) ((void)0)
#endif

// Counts bytes read from the K/V caches. A no-op on the GPU; the host emulation
// (tests/backends/cuda_host_emulation.h) defines it to count every cache load, so tests can
// check how often each kv head's K/V is read per decode step.
#if !defined(GP_COUNT_KV_BYTES)
#define GP_COUNT_KV_BYTES(bytes) ((void)0)
#endif

namespace gp {

constexpr int kWarpSize = 32;
constexpr int kNumThreads = 128;  // threads per attention / reduce block
constexpr int kNumWarps = kNumThreads / kWarpSize;
constexpr int kMaxHeadSize = 256;
constexpr float kNegBig = -3.402823466e+38f;  // -FLT_MAX: an "empty" running max, never NaN

// Element type traits: how many T fit in 16 bytes, how to widen a 16-byte vector to fp32, how to
// round a fp32 result back to T. Bit-level conversions avoid type punning through unions.
template <typename T>
struct Traits;

template <>
struct Traits<float> {
  static constexpr int kVec = 4;
  __device__ __forceinline__ static void unpack(const uint4& r, float* f) {
    f[0] = __uint_as_float(r.x);
    f[1] = __uint_as_float(r.y);
    f[2] = __uint_as_float(r.z);
    f[3] = __uint_as_float(r.w);
  }
  __device__ __forceinline__ static float from_float(float x) { return x; }
};

template <>
struct Traits<__half> {
  static constexpr int kVec = 8;
  __device__ __forceinline__ static void unpack_word(unsigned w, float* f) {
    f[0] = __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xffffu)));
    f[1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
  }
  __device__ __forceinline__ static void unpack(const uint4& r, float* f) {
    unpack_word(r.x, f);
    unpack_word(r.y, f + 2);
    unpack_word(r.z, f + 4);
    unpack_word(r.w, f + 6);
  }
  __device__ __forceinline__ static __half from_float(float x) { return __float2half_rn(x); }
};

template <>
struct Traits<__nv_bfloat16> {
  static constexpr int kVec = 8;
  // bf16 is the top half of an fp32, so widening is a shift.
  __device__ __forceinline__ static void unpack_word(unsigned w, float* f) {
    f[0] = __uint_as_float(w << 16);
    f[1] = __uint_as_float(w & 0xffff0000u);
  }
  __device__ __forceinline__ static void unpack(const uint4& r, float* f) {
    unpack_word(r.x, f);
    unpack_word(r.y, f + 2);
    unpack_word(r.z, f + 4);
    unpack_word(r.w, f + 6);
  }
  __device__ __forceinline__ static __nv_bfloat16 from_float(float x) {
    return __float2bfloat16_rn(x);
  }
};

// Threads that share one K/V row ("thread group"): the row's 16-byte vectors rounded up to a
// power of two, at most a warp; lanes past the row's end idle. E.g. fp16 D=128: 16 vectors ->
// 16 threads, 2 rows per warp pass; fp16 D=80: 10 vectors -> 16 threads of one vector (6 idle).
// Splitting D=80 as 2 threads of 5 vectors instead uses 128 registers (25 % occupancy): every
// lane then holds 5 vectors of q, k, v and 40 accumulators (see docs/paged-attention-kernel.md).
__host__ __device__ constexpr int group_size_for(int num_vecs) {
  int group = 1;
  while (group < num_vecs && group < 32) group *= 2;
  return group;
}

template <typename V>
__device__ __forceinline__ V shfl_xor(V v, int lane_mask) {
  return __shfl_xor_sync(0xffffffffu, v, lane_mask);
}

// Merge the online-softmax state (m_o, l_o, acc_o) into (m, l, acc): both describe
// sum_t exp(s_t - m) * v_t over disjoint token sets.
__device__ __forceinline__ void merge_coefficients(float m, float m_o, float* a, float* b,
                                                   float* m_new) {
  *m_new = fmaxf(m, m_o);
  *a = expf(m - *m_new);
  *b = expf(m_o - *m_new);
}

// Decode attention for one (head, sequence, partition): out = softmax(q K^T * scale) V over the
// partition's tokens, read through the block table (Eq. 4 of the PagedAttention paper with an
// online softmax: a running max and sum per thread group, merged at the end).
template <typename T, int D>
__device__ __forceinline__ void paged_attention_impl(
    T* __restrict__ out, float* __restrict__ tmp_out, float* __restrict__ max_logits,
    float* __restrict__ exp_sums, const T* __restrict__ q, const T* __restrict__ k_cache,
    const T* __restrict__ v_cache, const int* __restrict__ block_tables,
    const int* __restrict__ context_lens, int num_kv_heads, int block_size,
    int max_blocks_per_seq, int q_stride, float scale, int partition_size,
    int max_num_partitions) {
  using Tr = Traits<T>;
  constexpr int kVec = Tr::kVec;
  static_assert(D % kVec == 0, "head size must be a whole number of 16-byte vectors");
  static_assert(D <= kMaxHeadSize, "head size too large for the reduce kernel");
  constexpr int kNumVecs = D / kVec;             // 16-byte vectors per row
  constexpr int kGroup = group_size_for(kNumVecs);  // threads per row
  constexpr int kVecsPerThread = (kNumVecs + kGroup - 1) / kGroup;
  constexpr int kElemsPerThread = kVecsPerThread * kVec;
  constexpr int kRowsPerWarp = kWarpSize / kGroup;  // rows one warp handles per pass
  constexpr int kRowsPerPass = kNumWarps * kRowsPerWarp;

  const int head = blockIdx.x;
  const int num_heads = gridDim.x;
  const int seq = blockIdx.y;
  const int part = blockIdx.z;
  const int context_len = context_lens[seq];

  GP_DEBUG_ASSERT(context_len >= 0 && context_len <= max_blocks_per_seq * block_size);
  int start = 0;
  int end = context_len;
  if (partition_size > 0) {
    start = part * partition_size;
    if (start >= context_len) return;  // whole block exits: no partial to write
    // The last launched partition covers the rest: the reduce reads only launched partials.
    end = part == max_num_partitions - 1 ? context_len : min(context_len, start + partition_size);
  }

  const int kv_head = head / (num_heads / num_kv_heads);  // GQA / MQA: heads share a kv head
  const int tid = threadIdx.x;
  const int warp = tid / kWarpSize;
  const int lane = tid % kWarpSize;
  const int row_in_warp = lane / kGroup;
  const int lane_in_group = lane % kGroup;
  // Whether this lane holds vector i of a row (false only for the idle lanes of a padded group).
  constexpr bool kPadded = kGroup * kVecsPerThread != kNumVecs;
  auto holds = [lane_in_group](int i) {
    return !kPadded || lane_in_group + i * kGroup < kNumVecs;
  };

  // This lane's slice of q (pre-scaled): vectors lane_in_group, lane_in_group + kGroup, ...
  float qv[kElemsPerThread];
  {
    const uint4* qp =
        reinterpret_cast<const uint4*>(q + static_cast<long long>(seq) * q_stride +
                                       static_cast<long long>(head) * D);
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      if (holds(i)) {
        Tr::unpack(qp[lane_in_group + i * kGroup], qv + i * kVec);
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) qv[i * kVec + e] = 0.f;
      }
    }
#pragma unroll
    for (int e = 0; e < kElemsPerThread; ++e) qv[e] *= scale;
  }

  float m = kNegBig;  // running max of this thread group's logits
  float l = 0.f;      // running sum of exp(logit - m)
  float acc[kElemsPerThread];
#pragma unroll
  for (int e = 0; e < kElemsPerThread; ++e) acc[e] = 0.f;

  const long long row_stride = static_cast<long long>(num_kv_heads) * D;  // between tokens
  const long long block_stride = row_stride * block_size;                  // between blocks
  const int* table = block_tables + static_cast<long long>(seq) * max_blocks_per_seq;

  // The loop bound depends only on the warp, so all 32 lanes run the same iterations and the
  // full-mask shuffles below are well defined; rows past `end` are masked by `valid`.
  for (int base = start + warp * kRowsPerWarp; base < end; base += kRowsPerPass) {
    const int t = base + row_in_warp;
    const bool valid = t < end;
    uint4 kraw[kVecsPerThread];
    uint4 vraw[kVecsPerThread];
    if (kPadded) {  // idle lanes add zeros
#pragma unroll
      for (int i = 0; i < kVecsPerThread; ++i) kraw[i] = vraw[i] = uint4{0u, 0u, 0u, 0u};
    }
    if (valid) {
      const int logical_block = t / block_size;
      const int offset = t - logical_block * block_size;
      GP_DEBUG_ASSERT(table[logical_block] >= 0);
      const long long row = static_cast<long long>(table[logical_block]) * block_stride +
                            offset * row_stride + static_cast<long long>(kv_head) * D;
      const uint4* kp = reinterpret_cast<const uint4*>(k_cache + row) + lane_in_group;
      const uint4* vp = reinterpret_cast<const uint4*>(v_cache + row) + lane_in_group;
#pragma unroll
      for (int i = 0; i < kVecsPerThread; ++i) {
        if (holds(i)) {
          kraw[i] = kp[i * kGroup];
          vraw[i] = vp[i * kGroup];
          GP_COUNT_KV_BYTES(2 * sizeof(uint4));
        }
      }
    }
    float s = 0.f;
    if (valid) {
#pragma unroll
      for (int i = 0; i < kVecsPerThread; ++i) {
        float kf[kVec];
        Tr::unpack(kraw[i], kf);
#pragma unroll
        for (int e = 0; e < kVec; ++e) s = fmaf(qv[i * kVec + e], kf[e], s);
      }
    }
#pragma unroll
    for (int mask = kGroup / 2; mask > 0; mask >>= 1) s += shfl_xor(s, mask);

    if (valid) {
      float alpha;
      float p;
      if (s > m) {
        alpha = expf(m - s);
        p = 1.f;
        m = s;
      } else {
        alpha = 1.f;
        p = expf(s - m);
      }
      l = fmaf(l, alpha, p);
#pragma unroll
      for (int i = 0; i < kVecsPerThread; ++i) {
        float vf[kVec];
        Tr::unpack(vraw[i], vf);
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          acc[i * kVec + e] = fmaf(p, vf[e], acc[i * kVec + e] * alpha);
        }
      }
    }
  }

  // Merge the thread groups of a warp (lanes lane ^ kGroup, lane ^ 2*kGroup, ... hold the same
  // output elements for other rows).
#pragma unroll
  for (int mask = kGroup; mask < kWarpSize; mask <<= 1) {
    const float m_o = shfl_xor(m, mask);
    const float l_o = shfl_xor(l, mask);
    float a, b, m_new;
    merge_coefficients(m, m_o, &a, &b, &m_new);
    l = l * a + l_o * b;
#pragma unroll
    for (int e = 0; e < kElemsPerThread; ++e) {
      const float acc_o = shfl_xor(acc[e], mask);
      acc[e] = acc[e] * a + acc_o * b;
    }
    m = m_new;
  }

  // Merge the warps through shared memory.
  __shared__ float s_max[kNumWarps];
  __shared__ float s_sum[kNumWarps];
  __shared__ float s_acc[kNumWarps][D];
  if (lane == 0) {
    s_max[warp] = m;
    s_sum[warp] = l;
  }
  if (row_in_warp == 0) {
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      if (!holds(i)) continue;
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        s_acc[warp][(lane_in_group + i * kGroup) * kVec + e] = acc[i * kVec + e];
      }
    }
  }
  __syncthreads();

  float block_max = kNegBig;
#pragma unroll
  for (int w = 0; w < kNumWarps; ++w) block_max = fmaxf(block_max, s_max[w]);
  float coef[kNumWarps];
  float block_sum = 0.f;
#pragma unroll
  for (int w = 0; w < kNumWarps; ++w) {
    coef[w] = expf(s_max[w] - block_max);
    block_sum = fmaf(s_sum[w], coef[w], block_sum);
  }
  const float inv_sum = block_sum > 0.f ? 1.f / block_sum : 0.f;  // empty context -> zeros

  const long long head_index = static_cast<long long>(seq) * num_heads + head;
  for (int d = tid; d < D; d += kNumThreads) {
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < kNumWarps; ++w) o = fmaf(s_acc[w][d], coef[w], o);
    o *= inv_sum;
    if (partition_size > 0) {
      tmp_out[(head_index * max_num_partitions + part) * D + d] = o;
    } else {
      out[head_index * D + d] = Tr::from_float(o);
    }
  }
  if (partition_size > 0 && tid == 0) {
    max_logits[head_index * max_num_partitions + part] = block_max;
    exp_sums[head_index * max_num_partitions + part] = block_sum;
  }
}

// Split-K reduce for one (head, sequence): out = sum_p w_p * tmp_out_p / sum_p w_p with
// w_p = exp_sums_p * exp(max_logits_p - max_p' max_logits_p').
template <typename T>
__device__ __forceinline__ void paged_attention_reduce_impl(
    T* __restrict__ out, const float* __restrict__ tmp_out,
    const float* __restrict__ max_logits, const float* __restrict__ exp_sums,
    const int* __restrict__ context_lens, int head_size, int partition_size,
    int max_num_partitions) {
  constexpr int kDimsPerThread = kMaxHeadSize / kNumThreads;
  const int head = blockIdx.x;
  const int num_heads = gridDim.x;
  const int seq = blockIdx.y;
  const int tid = threadIdx.x;
  const int warp = tid / kWarpSize;
  const int lane = tid % kWarpSize;
  const int context_len = context_lens[seq];
  // Partials exist only for launched partitions (the last one holds the tail).
  const int num_parts = min((context_len + partition_size - 1) / partition_size,
                            max_num_partitions);
  const long long head_index = static_cast<long long>(seq) * num_heads + head;
  const long long base = head_index * max_num_partitions;

  __shared__ float s_red[kNumWarps];
  __shared__ float s_w[kNumThreads];

  float m = kNegBig;
  for (int p = tid; p < num_parts; p += kNumThreads) m = fmaxf(m, max_logits[base + p]);
#pragma unroll
  for (int mask = kWarpSize / 2; mask > 0; mask >>= 1) m = fmaxf(m, shfl_xor(m, mask));
  if (lane == 0) s_red[warp] = m;
  __syncthreads();
  float global_max = kNegBig;
#pragma unroll
  for (int w = 0; w < kNumWarps; ++w) global_max = fmaxf(global_max, s_red[w]);

  float o[kDimsPerThread];
#pragma unroll
  for (int k = 0; k < kDimsPerThread; ++k) o[k] = 0.f;
  float total = 0.f;
  for (int chunk = 0; chunk < num_parts; chunk += kNumThreads) {
    const int p = chunk + tid;
    s_w[tid] = p < num_parts ? exp_sums[base + p] * expf(max_logits[base + p] - global_max) : 0.f;
    __syncthreads();
    const int n = min(kNumThreads, num_parts - chunk);
    for (int j = 0; j < n; ++j) {
      const float w = s_w[j];
      total += w;
      const float* part_out = tmp_out + (base + chunk + j) * head_size;
#pragma unroll
      for (int k = 0; k < kDimsPerThread; ++k) {
        const int d = tid + k * kNumThreads;
        if (d < head_size) o[k] = fmaf(w, part_out[d], o[k]);
      }
    }
    __syncthreads();
  }
  const float inv_total = total > 0.f ? 1.f / total : 0.f;
#pragma unroll
  for (int k = 0; k < kDimsPerThread; ++k) {
    const int d = tid + k * kNumThreads;
    if (d < head_size) out[head_index * head_size + d] = Traits<T>::from_float(o[k] * inv_total);
  }
}

}  // namespace gp

// ---------------------------------------------------------------------------------------------
// extern "C" entry points. The X-macros list every instantiation once; the launcher builds the
// names the same way (paged_attention_<dt>_h<D>, paged_attention_reduce_<dt>).

#define GP_FOR_EACH_DTYPE(X) \
  X(float, f32)              \
  X(__half, f16)             \
  X(__nv_bfloat16, bf16)

#define GP_FOR_EACH_HEAD_SIZE(X, T, NAME) \
  X(T, NAME, 64)                          \
  X(T, NAME, 80)                          \
  X(T, NAME, 96)                          \
  X(T, NAME, 128)                         \
  X(T, NAME, 256)

#define GP_DEFINE_ATTENTION(T, NAME, D)                                                         \
  extern "C" __global__ void __launch_bounds__(gp::kNumThreads)                                 \
      paged_attention_##NAME##_h##D(                                                            \
          T* __restrict__ out, float* __restrict__ tmp_out, float* __restrict__ max_logits,     \
          float* __restrict__ exp_sums, const T* __restrict__ q, const T* __restrict__ k_cache, \
          const T* __restrict__ v_cache, const int* __restrict__ block_tables,                  \
          const int* __restrict__ context_lens, int num_kv_heads, int block_size,               \
          int max_blocks_per_seq, int q_stride, float scale, int partition_size,                \
          int max_num_partitions) {                                                             \
    gp::paged_attention_impl<T, D>(out, tmp_out, max_logits, exp_sums, q, k_cache, v_cache,     \
                                   block_tables, context_lens, num_kv_heads, block_size,        \
                                   max_blocks_per_seq, q_stride, scale, partition_size,         \
                                   max_num_partitions);                                         \
  }

#define GP_DEFINE_ATTENTION_ALL_HEADS(T, NAME) GP_FOR_EACH_HEAD_SIZE(GP_DEFINE_ATTENTION, T, NAME)

#define GP_DEFINE_REDUCE(T, NAME)                                                               \
  extern "C" __global__ void __launch_bounds__(gp::kNumThreads) paged_attention_reduce_##NAME(  \
      T* __restrict__ out, const float* __restrict__ tmp_out,                                   \
      const float* __restrict__ max_logits, const float* __restrict__ exp_sums,                 \
      const int* __restrict__ context_lens, int head_size, int partition_size,                  \
      int max_num_partitions) {                                                                 \
    gp::paged_attention_reduce_impl<T>(out, tmp_out, max_logits, exp_sums, context_lens,        \
                                       head_size, partition_size, max_num_partitions);          \
  }

GP_FOR_EACH_DTYPE(GP_DEFINE_ATTENTION_ALL_HEADS)
GP_FOR_EACH_DTYPE(GP_DEFINE_REDUCE)

// Writes token i's key/value rows (num_kv_heads * head_size elements each, vecs_per_token
// 16-byte vectors) into slot slot_mapping[i] of the caches; slot -1 is skipped (padding).
// key/value rows may be strided (e.g. views into a fused qkv tensor): strides are in 16-byte
// vectors. One thread block per token. Dtype-agnostic: it moves bytes.
extern "C" __global__ void reshape_and_cache(const uint4* __restrict__ key,
                                             const uint4* __restrict__ value,
                                             uint4* __restrict__ key_cache,
                                             uint4* __restrict__ value_cache,
                                             const long long* __restrict__ slot_mapping,
                                             long long key_stride, long long value_stride,
                                             int vecs_per_token) {
  const long long token = blockIdx.x;
  const long long slot = slot_mapping[token];
  if (slot < 0) return;
  const uint4* k = key + token * key_stride;
  const uint4* v = value + token * value_stride;
  uint4* kc = key_cache + slot * vecs_per_token;
  uint4* vc = value_cache + slot * vecs_per_token;
  for (int i = threadIdx.x; i < vecs_per_token; i += blockDim.x) {
    kc[i] = k[i];
    vc[i] = v[i];
  }
}

// Copy-on-write block copies for many caches in one launch. cache_ptrs[c] is the base address
// of cache c (16-byte aligned), block_vecs[c] its block size in 16-byte vectors, pairs a
// [num_pairs, 2] array of (src, dst) physical block ids. grid = (num_pairs, num_caches).
// No dst may appear as a src in the same launch (CoW always copies into fresh blocks).
extern "C" __global__ void copy_blocks(const unsigned long long* __restrict__ cache_ptrs,
                                       const long long* __restrict__ block_vecs,
                                       const long long* __restrict__ pairs) {
  const long long pair = blockIdx.x;
  const int cache = blockIdx.y;
  uint4* base = reinterpret_cast<uint4*>(cache_ptrs[cache]);
  const long long n = block_vecs[cache];
  const uint4* src = base + pairs[2 * pair] * n;
  uint4* dst = base + pairs[2 * pair + 1] * n;
  for (long long i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}
