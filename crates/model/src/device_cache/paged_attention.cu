// flint's device KV pool kernels: writing a pass's new keys and values into their pool slots, and
// paged attention over block tables, for decode and chunked prefill alike.
//
// The pool of one layer is `[num_blocks * block_size][num_kv_heads][head_dim]` (slot-major: one
// token's keys, all heads, contiguous). A pass's metadata is one u32 array, uploaded once and read
// by every layer: `[token_seq: N][token_pos: N][slot: N][block_tables: S * max_blocks]`, where
// token `t` belongs to sequence `token_seq[t]`, sits at absolute position `token_pos[t]` and is
// stored at pool slot `slot[t]`; row `s` of the tables is sequence `s`'s block table.
//
// Attention: one thread block per (query token, query head); the query head's KV head is
// `head / (num_heads / num_kv_heads)` (grouped-query attention reads the KV head in place, it is
// never repeated). The keys a token sees are positions `[max(0, pos + 1 - window), pos]` (causal,
// and within the sliding window when `window > 0`), read 128 at a time: each thread scores one
// key, the block takes the tile's maximum and sum (online softmax, f32), and each thread then
// accumulates its own output dimensions over the tile's values. Accumulation is f32 whatever the
// storage type; the output is rounded once, at the end.
//
// Not tuned: a query head re-reads its KV head once per query token (prefill chunks and the query
// heads of a group do not share loads), and each thread's key dot product reads a row on its own.
// It is a correct baseline for the device check to measure, not vLLM's kernel.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define THREADS 128
#define WARPS (THREADS / 32)
#define MAX_HEAD_DIM 256
#define DIMS_PER_THREAD (MAX_HEAD_DIM / THREADS)

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// The maximum of `v` over the thread block, returned to every thread. `red` holds WARPS floats.
__device__ __forceinline__ float block_max(float v, float *red) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  float r = red[0];
  for (int w = 1; w < WARPS; ++w) r = fmaxf(r, red[w]);
  __syncthreads();
  return r;
}

// The sum of `v` over the thread block, in a fixed order, returned to every thread.
__device__ __forceinline__ float block_sum(float v, float *red) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  float r = red[0];
  for (int w = 1; w < WARPS; ++w) r += red[w];
  __syncthreads();
  return r;
}

// grid (N), any block size: token t's row of `row` values goes to slot meta[2N + t].
template <typename T>
__device__ void write_kv(T *__restrict__ cache, const T *__restrict__ src, const uint32_t *__restrict__ meta,
                         uint32_t n_tokens, uint32_t row) {
  const uint32_t t = blockIdx.x;
  const uint64_t dst = (uint64_t)meta[2 * n_tokens + t] * row;
  const uint64_t from = (uint64_t)t * row;
  for (uint32_t i = threadIdx.x; i < row; i += blockDim.x) cache[dst + i] = src[from + i];
}

// grid (N, num_heads), THREADS threads. `q` and `out` are `[N][num_heads][head_dim]`; head_dim is
// at most MAX_HEAD_DIM (the host checks).
template <typename T>
__device__ void paged_attention(T *__restrict__ out, const T *__restrict__ q, const T *__restrict__ k_cache,
                                const T *__restrict__ v_cache, const uint32_t *__restrict__ meta, uint32_t n_tokens,
                                uint32_t max_blocks, uint32_t num_heads, uint32_t num_kv_heads, uint32_t head_dim,
                                uint32_t block_size, uint32_t window, float scale) {
  __shared__ float q_s[MAX_HEAD_DIM];
  __shared__ float p_s[THREADS];
  __shared__ uint32_t slot_s[THREADS];
  __shared__ float red[WARPS];

  const uint32_t t = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
  const uint32_t kvh = h / (num_heads / num_kv_heads);
  const uint32_t seq = meta[t], pos = meta[n_tokens + t];
  const uint32_t *table = meta + 3 * (uint64_t)n_tokens + (uint64_t)seq * max_blocks;
  const uint64_t kv_stride = (uint64_t)num_kv_heads * head_dim;
  const uint64_t head_off = (uint64_t)kvh * head_dim;

  const T *q_row = q + ((uint64_t)t * num_heads + h) * head_dim;
  for (uint32_t i = tid; i < head_dim; i += THREADS) q_s[i] = to_float(q_row[i]) * scale;
  __syncthreads();

  const uint32_t end = pos + 1;
  const uint32_t start = (window > 0 && end > window) ? end - window : 0;
  float m = -INFINITY, l = 0.f;
  float acc[DIMS_PER_THREAD];
#pragma unroll
  for (int d = 0; d < DIMS_PER_THREAD; ++d) acc[d] = 0.f;

  for (uint32_t base = start; base < end; base += THREADS) {
    const uint32_t j = base + tid;
    float s = -INFINITY;
    if (j < end) {
      const uint32_t slot = table[j / block_size] * block_size + j % block_size;
      slot_s[tid] = slot;
      const T *k_row = k_cache + slot * kv_stride + head_off;
      float dot = 0.f;
      for (uint32_t i = 0; i < head_dim; ++i) dot += q_s[i] * to_float(k_row[i]);
      s = dot;
    }
    // Every tile holds at least one key (j = base < end), so m_new is finite.
    const float m_new = fmaxf(m, block_max(s, red));
    const float p = j < end ? expf(s - m_new) : 0.f;
    p_s[tid] = p;
    const float tile_sum = block_sum(p, red);  // its barrier also publishes p_s and slot_s
    const float correction = expf(m - m_new);  // 0 on the first tile (m = -inf)
    l = l * correction + tile_sum;
    const uint32_t n = min((uint32_t)THREADS, end - base);
#pragma unroll
    for (int d = 0; d < DIMS_PER_THREAD; ++d) acc[d] *= correction;
    for (uint32_t jj = 0; jj < n; ++jj) {
      const T *v_row = v_cache + slot_s[jj] * kv_stride + head_off;
      const float pj = p_s[jj];
#pragma unroll
      for (int d = 0; d < DIMS_PER_THREAD; ++d) {
        const uint32_t i = tid + d * THREADS;
        if (i < head_dim) acc[d] += pj * to_float(v_row[i]);
      }
    }
    m = m_new;
    __syncthreads();  // the next tile overwrites p_s and slot_s
  }

  T *out_row = out + ((uint64_t)t * num_heads + h) * head_dim;
#pragma unroll
  for (int d = 0; d < DIMS_PER_THREAD; ++d) {
    const uint32_t i = tid + d * THREADS;
    if (i < head_dim) out_row[i] = from_float<T>(acc[d] / l);
  }
}

#define FLINT_KV_KERNELS(SUFFIX, T)                                                                          \
  extern "C" __global__ void write_kv_##SUFFIX(T *cache, const T *src, const uint32_t *meta, uint32_t n_tokens, \
                                               uint32_t row) {                                               \
    write_kv<T>(cache, src, meta, n_tokens, row);                                                            \
  }                                                                                                          \
  extern "C" __global__ void __launch_bounds__(THREADS) paged_attention_##SUFFIX(                            \
      T *out, const T *q, const T *k_cache, const T *v_cache, const uint32_t *meta, uint32_t n_tokens,       \
      uint32_t max_blocks, uint32_t num_heads, uint32_t num_kv_heads, uint32_t head_dim, uint32_t block_size, \
      uint32_t window, float scale) {                                                                        \
    paged_attention<T>(out, q, k_cache, v_cache, meta, n_tokens, max_blocks, num_heads, num_kv_heads,        \
                       head_dim, block_size, window, scale);                                                 \
  }

FLINT_KV_KERNELS(f32, float)
FLINT_KV_KERNELS(f16, __half)
FLINT_KV_KERNELS(bf16, __nv_bfloat16)
