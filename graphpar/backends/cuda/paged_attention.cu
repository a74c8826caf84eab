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
//   paged_attention_<dt>_h<D>     one thread block per (kv head, sequence, partition) computing
//                                 every query head of that kv head, so each K/V row is read once
//                                 (a GQA group over max_heads_per_block(D) heads is split into
//                                 gridDim.x / num_kv_heads chunks of heads_per_block heads); dt
//                                 is f32, f16 or bf16, D is 64, 80, 96, 128 or 256.
//                                 partition_size == 0: the block covers the whole context and
//                                 writes `out`; otherwise it covers [part * partition_size,
//                                 +partition_size) and writes its normalised partial output,
//                                 running max and exp-sum (split-K).
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

// Threads that compute one logit (q . k_row, a "thread group"): the row's 16-byte vectors
// rounded up to a power of two, at most a warp; lanes past the row's end idle. E.g. fp16 D=128:
// 16 vectors -> 16 threads; fp16 D=80: 10 vectors -> 16 threads of one vector (6 idle).
// Splitting D=80 as 2 threads of 5 vectors instead uses 128 registers (25 % occupancy, see
// docs/paged-attention-kernel.md).
__host__ __device__ constexpr int group_size_for(int num_vecs) {
  int group = 1;
  while (group < num_vecs && group < 32) group *= 2;
  return group;
}

// Query heads one attention block computes: its fp32 output accumulators (heads x D) are
// spread over the block's registers, kAccPerThread per thread. The launcher splits a larger
// GQA group into chunks of at most this many heads (each chunk then reads the K/V again).
constexpr int kAccPerThread = 16;
__host__ __device__ constexpr int max_heads_per_block(int head_size) {
  return kNumThreads * kAccPerThread / head_size;
}

// Tokens per K/V tile in shared memory: kTileBytes of K (and as many of V), at most 32 rows.
constexpr int kTileBytes = 4096;
__host__ __device__ constexpr int tile_rows(int head_size, int elem_bytes) {
  return kTileBytes / (head_size * elem_bytes) < 32 ? kTileBytes / (head_size * elem_bytes) : 32;
}

template <typename V>
__device__ __forceinline__ V shfl_xor(V v, int lane_mask) {
  return __shfl_xor_sync(0xffffffffu, v, lane_mask);
}

// Decode attention for the query heads that share one kv head, for one (sequence, partition):
// out_h = softmax(q_h K^T * scale) V over the partition's tokens, read through the block table
// (Eq. 4 of the PagedAttention paper with an online softmax per head, tile by tile).
//
// The block computes heads first_head .. first_head + n_heads - 1 (all of a kv head's group
// when it has at most kMaxHeads heads, else one chunk of it, see the launcher), so each K/V row
// is read from the cache once per kv head, not once per query head. Per tile of kTile tokens:
//   1. the block copies the tile's K and V rows into shared memory (16-byte loads, coalesced);
//   2. one thread group per (head, row) computes the logit q_h . k_row;
//   3. one warp per head folds the tile's logits into the head's running max and exp-sum and
//      turns them into probabilities;
//   4. each accumulator slot (a 16-byte vector of one head's output, and a slice of the tile's
//      rows) rescales and adds p * v over its rows. Small groups leave most (head, vector)
//      outputs to several slots, so all threads work; the slices are summed once at the end
//      (the rescaling is linear, so it applies to each slice alike).
template <typename T, int D>
__device__ __forceinline__ void paged_attention_impl(
    T* __restrict__ out, float* __restrict__ tmp_out, float* __restrict__ max_logits,
    float* __restrict__ exp_sums, const T* __restrict__ q, const T* __restrict__ k_cache,
    const T* __restrict__ v_cache, const int* __restrict__ block_tables,
    const int* __restrict__ context_lens, int num_heads, int num_kv_heads, int heads_per_block,
    int block_size, int max_blocks_per_seq, int q_stride, float scale, int partition_size,
    int max_num_partitions) {
  using Tr = Traits<T>;
  constexpr int kVec = Tr::kVec;
  static_assert(D % kVec == 0, "head size must be a whole number of 16-byte vectors");
  static_assert(D <= kMaxHeadSize, "head size too large for the reduce kernel");
  constexpr int kNumVecs = D / kVec;                  // 16-byte vectors per row
  constexpr int kMaxHeads = max_heads_per_block(D);  // query heads one block computes
  static_assert(kMaxHeads <= kNumThreads, "one thread per head initialises the softmax state");
  constexpr int kTile = tile_rows(D, static_cast<int>(sizeof(T)));  // tokens per tile
  constexpr int kGroup = group_size_for(kNumVecs);   // threads per logit (one K row)
  constexpr int kVecsPerThread = (kNumVecs + kGroup - 1) / kGroup;
  constexpr int kGroupsPerBlock = kNumThreads / kGroup;
  constexpr int kLoadSteps = (kTile * kNumVecs + kNumThreads - 1) / kNumThreads;
  constexpr int kUnitsPerThread = (kMaxHeads * kNumVecs + kNumThreads - 1) / kNumThreads;
  constexpr int kSlots = kUnitsPerThread * kNumThreads;  // accumulator slots of kVec floats
  // s_q holds the queries, then (after the last tile) each slot's partial output.
  constexpr int kSharedFloats = kMaxHeads * D > kSlots * kVec ? kMaxHeads * D : kSlots * kVec;

  const int seq = blockIdx.y;
  const int part = blockIdx.z;
  const int chunks = gridDim.x / num_kv_heads;  // blocks per kv head
  const int kv_head = blockIdx.x / chunks;
  const int chunk = blockIdx.x - kv_head * chunks;
  const int group = num_heads / num_kv_heads;  // GQA / MQA: query heads per kv head
  const int first_head = kv_head * group + chunk * heads_per_block;
  const int n_heads = min(heads_per_block, group - chunk * heads_per_block);
  const int n_units = n_heads * kNumVecs;  // (head, 16-byte vector) outputs of this block
  const int n_slices = kSlots / n_units;   // slots per output, each over 1 / n_slices of a tile
  GP_DEBUG_ASSERT(n_heads > 0 && n_heads <= kMaxHeads);
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

  const int tid = threadIdx.x;
  const int warp = tid / kWarpSize;
  const int lane = tid % kWarpSize;
  const int group_id = tid / kGroup;  // a thread group never straddles warps (kGroup <= 32)
  const int lane_in_group = tid % kGroup;
  // Whether this lane holds vector i of a row (false only for the idle lanes of a padded group).
  constexpr bool kPadded = kGroup * kVecsPerThread != kNumVecs;
  auto holds = [lane_in_group](int i) {
    return !kPadded || lane_in_group + i * kGroup < kNumVecs;
  };

  __shared__ float s_q[kSharedFloats];  // the block's queries [n_heads][D], pre-scaled, fp32
  __shared__ uint4 s_k[kTile][kNumVecs];
  __shared__ uint4 s_v[kTile][kNumVecs];
  __shared__ float s_p[kMaxHeads][kTile];  // the tile's logits, then probabilities
  __shared__ float s_max[kMaxHeads];       // running max per head
  __shared__ float s_sum[kMaxHeads];       // running sum of exp(logit - max) per head
  __shared__ float s_rescale[kMaxHeads];   // exp(old max - new max) for this tile

  for (int i = tid; i < n_units; i += kNumThreads) {
    const int h = i / kNumVecs;
    const int vec = i - h * kNumVecs;
    const uint4* qp =
        reinterpret_cast<const uint4*>(q + static_cast<long long>(seq) * q_stride +
                                       static_cast<long long>(first_head + h) * D);
    float f[kVec];
    Tr::unpack(qp[vec], f);
#pragma unroll
    for (int e = 0; e < kVec; ++e) s_q[h * D + vec * kVec + e] = f[e] * scale;
  }
  if (tid < kMaxHeads) {
    s_max[tid] = kNegBig;
    s_sum[tid] = 0.f;
  }

  // Slot tid + j * kNumThreads accumulates output `unit` = slot % n_units, (head, vector) =
  // divmod(unit, kNumVecs), over rows slice, slice + n_slices, ... (slice = slot / n_units).
  float acc[kUnitsPerThread][kVec];
#pragma unroll
  for (int j = 0; j < kUnitsPerThread; ++j) {
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[j][e] = 0.f;
  }
  __syncthreads();

  const long long row_stride = static_cast<long long>(num_kv_heads) * D;  // between tokens
  const long long block_stride = row_stride * block_size;                  // between blocks
  const int* table = block_tables + static_cast<long long>(seq) * max_blocks_per_seq;

  for (int tile = start; tile < end; tile += kTile) {
    const int rows = min(kTile, end - tile);
    // 1. Consecutive threads load consecutive 16-byte vectors of a row: each row is read once.
    // A fixed, unrolled trip count lets every load of the tile be in flight at once.
#pragma unroll
    for (int step = 0; step < kLoadSteps; ++step) {
      const int i = tid + step * kNumThreads;
      if (i >= rows * kNumVecs) continue;
      const int r = i / kNumVecs;
      const int vec = i - r * kNumVecs;
      const int t = tile + r;
      const int logical_block = t / block_size;
      const int offset = t - logical_block * block_size;
      GP_DEBUG_ASSERT(table[logical_block] >= 0);
      const long long row = static_cast<long long>(table[logical_block]) * block_stride +
                            offset * row_stride + static_cast<long long>(kv_head) * D;
      s_k[r][vec] = reinterpret_cast<const uint4*>(k_cache + row)[vec];
      s_v[r][vec] = reinterpret_cast<const uint4*>(v_cache + row)[vec];
      GP_COUNT_KV_BYTES(2 * sizeof(uint4));
    }
    __syncthreads();

    // 2. The loop bound is the same for the whole block, so all 32 lanes of a warp run the same
    // iterations and the full-mask shuffles are well defined; pairs past the end are masked.
    const int pairs = n_heads * rows;
    for (int base = 0; base < pairs; base += kGroupsPerBlock) {
      const int pair = base + group_id;
      const bool valid = pair < pairs;
      const int h = valid ? pair / rows : 0;
      const int r = pair - h * rows;
      float s = 0.f;
      if (valid) {
#pragma unroll
        for (int i = 0; i < kVecsPerThread; ++i) {
          if (!holds(i)) continue;
          const int vec = lane_in_group + i * kGroup;
          float kf[kVec];
          Tr::unpack(s_k[r][vec], kf);
#pragma unroll
          for (int e = 0; e < kVec; ++e) s = fmaf(s_q[h * D + vec * kVec + e], kf[e], s);
        }
      }
#pragma unroll
      for (int mask = kGroup / 2; mask > 0; mask >>= 1) s += shfl_xor(s, mask);
      if (valid && lane_in_group == 0) s_p[h][r] = s;
    }
    __syncthreads();

    // 3. The loop bound depends only on the warp, so the warp's shuffles stay uniform.
    for (int h = warp; h < n_heads; h += kNumWarps) {
      const float old_max = s_max[h];
      float tile_max = kNegBig;
      for (int r = lane; r < rows; r += kWarpSize) tile_max = fmaxf(tile_max, s_p[h][r]);
#pragma unroll
      for (int mask = kWarpSize / 2; mask > 0; mask >>= 1) {
        tile_max = fmaxf(tile_max, shfl_xor(tile_max, mask));
      }
      const float new_max = fmaxf(old_max, tile_max);
      float tile_sum = 0.f;
      for (int r = lane; r < rows; r += kWarpSize) {
        const float p = expf(s_p[h][r] - new_max);
        s_p[h][r] = p;
        tile_sum += p;
      }
#pragma unroll
      for (int mask = kWarpSize / 2; mask > 0; mask >>= 1) tile_sum += shfl_xor(tile_sum, mask);
      if (lane == 0) {
        const float rescale = expf(old_max - new_max);
        s_rescale[h] = rescale;
        s_sum[h] = fmaf(s_sum[h], rescale, tile_sum);
        s_max[h] = new_max;
      }
    }
    __syncthreads();

    // 4.
#pragma unroll
    for (int j = 0; j < kUnitsPerThread; ++j) {
      const int slot = tid + j * kNumThreads;
      const int slice = slot / n_units;
      if (slice >= n_slices) continue;
      const int unit = slot - slice * n_units;
      const int h = unit / kNumVecs;
      const int vec = unit - h * kNumVecs;
      const float rescale = s_rescale[h];
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[j][e] *= rescale;
      for (int r = slice; r < rows; r += n_slices) {
        const float p = s_p[h][r];
        float vf[kVec];
        Tr::unpack(s_v[r][vec], vf);
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[j][e] = fmaf(p, vf[e], acc[j][e]);
      }
    }
    __syncthreads();  // the next tile overwrites s_k, s_v and s_p
  }

  // Sum the slices through shared memory: the last tile's barrier has freed s_q.
#pragma unroll
  for (int j = 0; j < kUnitsPerThread; ++j) {
    const int slot = tid + j * kNumThreads;
    if (slot >= n_slices * n_units) continue;
#pragma unroll
    for (int e = 0; e < kVec; ++e) s_q[slot * kVec + e] = acc[j][e];
  }
  __syncthreads();
  for (int unit = tid; unit < n_units; unit += kNumThreads) {
    const int h = unit / kNumVecs;
    const int vec = unit - h * kNumVecs;
    const float inv_sum = s_sum[h] > 0.f ? 1.f / s_sum[h] : 0.f;  // empty context -> zeros
    const long long head_index = static_cast<long long>(seq) * num_heads + first_head + h;
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const int d = vec * kVec + e;
      float o = 0.f;
      for (int slice = 0; slice < n_slices; ++slice) o += s_q[(slice * n_units + unit) * kVec + e];
      o *= inv_sum;
      if (partition_size > 0) {
        tmp_out[(head_index * max_num_partitions + part) * D + d] = o;
      } else {
        out[head_index * D + d] = Tr::from_float(o);
      }
    }
  }
  if (partition_size > 0 && tid < n_heads) {
    const long long head_index = static_cast<long long>(seq) * num_heads + first_head + tid;
    max_logits[head_index * max_num_partitions + part] = s_max[tid];
    exp_sums[head_index * max_num_partitions + part] = s_sum[tid];
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
          const int* __restrict__ context_lens, int num_heads, int num_kv_heads,                \
          int heads_per_block, int block_size, int max_blocks_per_seq, int q_stride,            \
          float scale, int partition_size, int max_num_partitions) {                            \
    gp::paged_attention_impl<T, D>(out, tmp_out, max_logits, exp_sums, q, k_cache, v_cache,     \
                                   block_tables, context_lens, num_heads, num_kv_heads,         \
                                   heads_per_block, block_size, max_blocks_per_seq, q_stride,   \
                                   scale, partition_size, max_num_partitions);                  \
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
