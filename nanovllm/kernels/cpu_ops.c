/* The CPU's fused decode ops: float32, compiled on first use by nanovllm/kernels/cpu_ops.py.

   Why C: on a small CPU a decode step of one request runs ~30 small torch ops per layer at 3-90 us each
   (dispatch, allocation, and thread wake-ups for tensors of a few hundred floats), as long as its matmuls.
   Each function here is one call instead of several. They run their loops on OpenMP, which the library
   shares with torch (the same libgomp is loaded once), so they use torch's worker threads instead of
   competing with them. Every function has a torch reference it is tested against. */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* out = RMSNorm(x [+ residual]) * weight, row by row; with a residual, summed = x + residual too. */
void add_rms_norm_f32(const float *x, const float *residual, float *summed, const float *weight, float *out,
                      int64_t rows, int64_t dim, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * dim >= 65536)
  for (int64_t r = 0; r < rows; r++) {
    const float *xr = x + r * dim;
    float *src = (float *)xr;
    if (residual) {
      const float *rr = residual + r * dim;
      src = summed + r * dim;
      for (int64_t i = 0; i < dim; i++) src[i] = xr[i] + rr[i];
    }
    double sum_sq = 0.0;
#pragma omp simd reduction(+ : sum_sq)
    for (int64_t i = 0; i < dim; i++) sum_sq += (double)src[i] * src[i];
    const float inv = (float)(1.0 / sqrt(sum_sq / dim + eps));
    float *o = out + r * dim;
    for (int64_t i = 0; i < dim; i++) o[i] = weight[i] * (src[i] * inv);
  }
}

/* out[r, i] = silu(gate[r, i]) * up[r, i] over a packed [gate | up] row of 2 * half. */
void silu_and_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t half, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * half >= 65536)
  for (int64_t r = 0; r < rows; r++) {
    const float *g = gate_up + r * 2 * half, *u = g + half;
    float *o = out + r * half;
#pragma omp simd
    for (int64_t i = 0; i < half; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
  }
}

/* x (head_dim floats) -> RMSNorm(x) * weight in place. */
static void head_rms_norm(float *x, const float *weight, int64_t head_dim, float eps) {
  double sum_sq = 0.0;
  for (int64_t i = 0; i < head_dim; i++) sum_sq += (double)x[i] * x[i];
  const float inv = (float)(1.0 / sqrt(sum_sq / head_dim + eps));
  for (int64_t i = 0; i < head_dim; i++) x[i] = weight[i] * (x[i] * inv);
}

/* src rotated by RoPE (rotate-half form) into dst; cos, sin: this position's rows of the tables. */
static void rope(const float *src, float *dst, const float *cos, const float *sin, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  for (int64_t i = 0; i < half; i++) {
    dst[i] = src[i] * cos[i] - src[i + half] * sin[i];
    dst[i + half] = src[i + half] * cos[i + half] + src[i] * sin[i + half];
  }
}

/* One decode step's attention straight from the fused qkv projection, for requests of one new token each.

   qkv: [num_seqs, qkv_stride], each row [q heads | k heads | v heads] x head_dim. For request r and KV head h
   (one task each): optional per-head RMSNorm of q and k (q_norm / k_norm weights, NULL when the model has
   none), RoPE at positions[r], the new k and v stored at slot_mapping[r] (skipped when < 0), then attention of
   the group's query heads over the request's seq_lens[r] tokens, read in place from the paged cache
   ([num_blocks, block_size, num_kv_heads, head_dim]) block by block with an online softmax.
   out: [num_seqs, num_heads, head_dim]; a request of seq_len 0 gets zeros. */
void rope_store_decode_attention_f32(const float *qkv, int64_t qkv_stride, const int64_t *positions,
                                     const float *cos_table, const float *sin_table, const float *q_norm,
                                     const float *k_norm, float norm_eps, float *k_cache, float *v_cache,
                                     const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                                     const int64_t *slot_mapping, float *out, int64_t num_seqs,
                                     int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                     int64_t block_size, float scale, int num_threads) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim; /* floats between consecutive tokens of a head */
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
  for (int64_t task = 0; task < num_seqs * num_kv_heads; task++) {
    const int64_t r = task / num_kv_heads, h = task % num_kv_heads;
    const float *row = qkv + r * qkv_stride;
    const float *cos = cos_table + positions[r] * head_dim, *sin = sin_table + positions[r] * head_dim;
    float q[group * head_dim], k[head_dim], acc[group * head_dim];
    float scores[group * block_size], running_max[group], running_sum[group];

    memcpy(k, row + (num_heads + h) * head_dim, head_dim * sizeof(float));
    if (k_norm) head_rms_norm(k, k_norm, head_dim, norm_eps);
    const int64_t slot = slot_mapping[r];
    if (slot >= 0) {
      float *k_dst = k_cache + slot * token_stride + h * head_dim;
      rope(k, k_dst, cos, sin, head_dim);
      memcpy(v_cache + slot * token_stride + h * head_dim, row + (num_heads + num_kv_heads + h) * head_dim,
             head_dim * sizeof(float));
    }
    for (int64_t g = 0; g < group; g++) {
      float tmp[head_dim];
      memcpy(tmp, row + (h * group + g) * head_dim, head_dim * sizeof(float));
      if (q_norm) head_rms_norm(tmp, q_norm, head_dim, norm_eps);
      rope(tmp, q + g * head_dim, cos, sin, head_dim);
      for (int64_t i = 0; i < head_dim; i++) q[g * head_dim + i] *= scale;
      running_max[g] = -INFINITY;
      running_sum[g] = 0.0f;
    }
    memset(acc, 0, sizeof(acc));

    const int64_t seq_len = seq_lens[r];
    const int32_t *table = block_tables + r * table_stride;
    for (int64_t start = 0; start < seq_len; start += block_size) {
      const int64_t n = seq_len - start < block_size ? seq_len - start : block_size;
      const int64_t base = (int64_t)table[start / block_size] * block_size * token_stride + h * head_dim;
      const float *keys = k_cache + base, *values = v_cache + base;
      for (int64_t j = 0; j < n; j++) {
        const float *key = keys + j * token_stride;
        for (int64_t g = 0; g < group; g++) {
          const float *qg = q + g * head_dim;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t i = 0; i < head_dim; i++) dot += qg[i] * key[i];
          scores[g * block_size + j] = dot;
        }
      }
      for (int64_t g = 0; g < group; g++) {
        float *s = scores + g * block_size;
        float block_max = running_max[g];
        for (int64_t j = 0; j < n; j++) block_max = s[j] > block_max ? s[j] : block_max;
        const float rescale = expf(running_max[g] - block_max); /* 0 on the first block (max was -inf) */
        float sum = 0.0f;
        for (int64_t j = 0; j < n; j++) {
          s[j] = expf(s[j] - block_max);
          sum += s[j];
        }
        running_sum[g] = running_sum[g] * rescale + sum;
        running_max[g] = block_max;
        float *a = acc + g * head_dim;
        for (int64_t i = 0; i < head_dim; i++) a[i] *= rescale;
      }
      for (int64_t j = 0; j < n; j++) {
        const float *value = values + j * token_stride;
        for (int64_t g = 0; g < group; g++) {
          const float p = scores[g * block_size + j];
          float *a = acc + g * head_dim;
#pragma omp simd
          for (int64_t i = 0; i < head_dim; i++) a[i] += p * value[i];
        }
      }
    }
    for (int64_t g = 0; g < group; g++) {
      float *o = out + (r * num_heads + h * group + g) * head_dim;
      const float inv = running_sum[g] > 0.0f ? 1.0f / running_sum[g] : 0.0f;
      for (int64_t i = 0; i < head_dim; i++) o[i] = acc[g * head_dim + i] * inv;
    }
  }
}

/* ---- int8 matrix-vector products for steps of a few rows ------------------------------------------------
   y[r, j] = w_scale[j] * sum_b x_scale[r, b] * sum_{i in block b} w[j, i] * xq[r, i]: int8 weights with one
   scale per output channel; each row of x quantized to int8 in blocks of 32 values, each block with its own
   scale (symmetric, [-127, 127]), so an outlier channel coarsens only its block (with one scale per row, the
   MLP's down projection lost its small inputs). A few rows read each weight once from memory for all of them:
   the product runs near the memory's speed (at one row ~1.3-2.4x faster than torch's dynamic int8 linear,
   which also quantizes per tensor). in_features must be a multiple of 32. */
#define QBLOCK 32

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* sum_b scale[b] * sum_i a[i] * b[i] over n int8s in blocks of 32 (a, b within [-127, 127]). maddubs
   multiplies an unsigned by a signed byte: |a| times b with a's sign cannot saturate its pair sums (2 * 127^2). */
static inline float dot_i8(const int8_t *a, const float *a_scale, const int8_t *b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t i = 0; i < n; i += QBLOCK) {
    const __m256i va = _mm256_loadu_si256((const __m256i *)(a + i));
    const __m256i vb = _mm256_loadu_si256((const __m256i *)(b + i));
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(va, va), _mm256_sign_epi8(vb, va));
    const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
    acc = _mm256_fmadd_ps(sums, _mm256_set1_ps(a_scale[i / QBLOCK]), acc);
  }
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  sum = _mm_hadd_ps(sum, sum);
  sum = _mm_hadd_ps(sum, sum);
  return _mm_cvtss_f32(sum);
}
#else
static inline float dot_i8(const int8_t *a, const float *a_scale, const int8_t *b, int64_t n) {
  float total = 0.0f;
  for (int64_t i = 0; i < n; i += QBLOCK) {
    int32_t sum = 0;
    for (int64_t k = i; k < i + QBLOCK; k++) sum += (int32_t)a[k] * b[k];
    total += (float)sum * a_scale[i / QBLOCK];
  }
  return total;
}
#endif

/* x: [rows, in] float32 (rows contiguous; a few rows: they are quantized on the stack); w: [out, in] int8;
   w_scale: [out]; bias: [out] or NULL; y: [rows, out]. */
void linear_i8_f32(const float *x, const int8_t *w, const float *w_scale, const float *bias, float *y,
                   int64_t rows, int64_t in, int64_t out, int num_threads) {
  const int64_t blocks = in / QBLOCK;
  float x_scale[rows * blocks];
  int8_t xq[rows * in];
  for (int64_t b = 0; b < rows * blocks; b++) {
    const float *xb = x + b * QBLOCK;
    float amax = 0.0f;
    for (int64_t i = 0; i < QBLOCK; i++) amax = fabsf(xb[i]) > amax ? fabsf(xb[i]) : amax;
    x_scale[b] = amax / 127.0f;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int64_t i = 0; i < QBLOCK; i++) xq[b * QBLOCK + i] = (int8_t)lrintf(xb[i] * inv);
  }
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t j = 0; j < out; j++) {
    const int8_t *wj = w + j * in;
    for (int64_t r = 0; r < rows; r++) {
      const float value = dot_i8(xq + r * in, x_scale + r * blocks, wj, in) * w_scale[j];
      y[r * out + j] = bias ? value + bias[j] : value;
    }
  }
}
