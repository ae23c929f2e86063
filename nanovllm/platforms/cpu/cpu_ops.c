/* The CPU's fused ops: float32, compiled on first use by nanovllm/platforms/cpu/cpu_ops.py.

   Why C: on a small CPU a decode step of one request runs ~30 small torch ops per layer at 3-90 us each
   (dispatch, allocation, and thread wake-ups for tensors of a few hundred floats), as long as its matmuls.
   Each function here is one call instead of several. They run their loops on OpenMP, which the library
   shares with torch (the same libgomp is loaded once), so they use torch's worker threads instead of
   competing with them. Every function has a torch reference it is tested against. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HAVE_AVX2 1
#include <immintrin.h>

/* e^x for 8 floats: x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor series to r^6 (relative error
   ~2e-7), times 2^n built in the exponent bits. Below -87.3 it returns 0 (-inf included: the online
   softmax's first rescale), above 88 it saturates at ~1.6e38. (glibc's vector expf needs -ffast-math,
   which a library loaded into torch's process must not bring: it would flush denormals process-wide.) */
static inline __m256 exp_avx2(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  /* 2^n: n + 127 in the exponent field; n = -127 (x <= -88) gives the bits of 0.0 */
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

static inline float hsum_avx2(__m256 v) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  sum = _mm_hadd_ps(sum, sum);
  sum = _mm_hadd_ps(sum, sum);
  return _mm_cvtss_f32(sum);
}
#endif

/* sum a[i] * b[i] */
static inline float dot_f32(const float *a, const float *b, int64_t n) {
  int64_t i = 0;
  float sum = 0.0f;
#ifdef HAVE_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  sum = hsum_avx2(acc);
#endif
  for (; i < n; i++) sum += a[i] * b[i];
  return sum;
}

/* y = y * keep + p * x (the online softmax's rescale and accumulate in one pass) */
static inline void scale_add_f32(float *y, float keep, float p, const float *x, int64_t n) {
  int64_t i = 0;
#ifdef HAVE_AVX2
  const __m256 vk = _mm256_set1_ps(keep), vp = _mm256_set1_ps(p);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(vp, _mm256_loadu_ps(x + i), _mm256_mul_ps(vk, _mm256_loadu_ps(y + i))));
#endif
  for (; i < n; i++) y[i] = y[i] * keep + p * x[i];
}

/* s[i] = e^(s[i] - shift); returns their sum */
static inline float exp_shifted_sum(float *s, float shift, int64_t n) {
  int64_t i = 0;
  float sum = 0.0f;
#ifdef HAVE_AVX2
  const __m256 vs = _mm256_set1_ps(shift);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + i), vs));
    _mm256_storeu_ps(s + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum_avx2(acc);
#endif
  for (; i < n; i++) {
    s[i] = expf(s[i] - shift);
    sum += s[i];
  }
  return sum;
}

/* How the KV cache holds one (token, KV head) row of head_dim values: float32, float16 (kv_f16_supported()), or
   int8 followed by the row's float32 scale (value = int8 * scale; symmetric, the row's largest magnitude / 127).
   The readers below take int8 rows unscaled: the attention applies a key row's scale to its score and a value
   row's to its softmax weight, one multiply per row instead of one per value. */
enum { KV_F32 = 0, KV_F16 = 1, KV_I8 = 2 };

int kv_f16_supported(void) {
#ifdef HAVE_AVX2
  return 1;
#else
  return 0;
#endif
}

/* bytes of one (token, KV head) row */
static inline int64_t kv_row_bytes(int kind, int64_t head_dim) {
  return kind == KV_I8 ? head_dim + (int64_t)sizeof(float) : kind == KV_F16 ? 2 * head_dim : 4 * head_dim;
}

/* an int8 row's scale, stored after its head_dim values */
static inline float kv_row_scale(const char *row, int64_t head_dim) {
  float scale;
  memcpy(&scale, row + head_dim, sizeof(scale));
  return scale;
}

/* value i of a row as float32 (an int8 row's unscaled) */
static inline float kv_value(const char *row, int64_t i, int kind) {
#ifdef HAVE_AVX2
  if (kind == KV_F16) return _cvtsh_ss(((const uint16_t *)row)[i]);
#endif
  return kind == KV_I8 ? (float)((const int8_t *)row)[i] : ((const float *)row)[i];
}

#ifdef HAVE_AVX2
/* values i..i+7 of a row as float32 (an int8 row's unscaled) */
static inline __m256 load8_kv(const char *row, int64_t i, int kind) {
  if (kind == KV_I8)
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)row + i))));
  return kind == KV_F16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i)))
                        : _mm256_loadu_ps((const float *)row + i);
}
#endif

static inline float dot_kv(const float *q, const char *key, int64_t n, int kind) {
  if (kind == KV_F32) return dot_f32(q, (const float *)key, n);
  int64_t i = 0;
  float sum = 0.0f;
#ifdef HAVE_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8_kv(key, i, kind), acc);
  sum = hsum_avx2(acc);
#endif
  for (; i < n; i++) sum += q[i] * kv_value(key, i, kind);
  return sum;
}

/* y = y * keep + p * value (an int8 row's unscaled) */
static inline void scale_add_kv(float *y, float keep, float p, const char *value, int64_t n, int kind) {
  if (kind == KV_F32) {
    scale_add_f32(y, keep, p, (const float *)value, n);
    return;
  }
  int64_t i = 0;
#ifdef HAVE_AVX2
  const __m256 vk = _mm256_set1_ps(keep), vp = _mm256_set1_ps(p);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(vp, load8_kv(value, i, kind), _mm256_mul_ps(vk, _mm256_loadu_ps(y + i))));
#endif
  for (; i < n; i++) y[i] = y[i] * keep + p * kv_value(value, i, kind);
}

/* out[t] = sum q[i] * key_t[i] for the four rows key + t * stride (bytes): four independent sums, so the FMAs do
   not wait on each other */
static inline void dot4_kv(const float *q, const char *key, int64_t stride, int64_t n, int kv_kind, float *out) {
#ifdef HAVE_AVX2
  if (n % 8 == 0) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i < n; i += 8) {
      const __m256 vq = _mm256_loadu_ps(q + i);
      a0 = _mm256_fmadd_ps(vq, load8_kv(key, i, kv_kind), a0);
      a1 = _mm256_fmadd_ps(vq, load8_kv(key + stride, i, kv_kind), a1);
      a2 = _mm256_fmadd_ps(vq, load8_kv(key + 2 * stride, i, kv_kind), a2);
      a3 = _mm256_fmadd_ps(vq, load8_kv(key + 3 * stride, i, kv_kind), a3);
    }
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    return;
  }
#endif
  for (int t = 0; t < 4; t++) out[t] = dot_kv(q, key + t * stride, n, kv_kind);
}

/* scores[t] = q . key_t for the n rows key + t * stride (bytes), four keys at a time */
static inline void block_scores(const float *q, const char *key, int64_t stride, int64_t n, int64_t head_dim,
                                int kv_kind, float *scores) {
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) dot4_kv(q, key + t * stride, stride, head_dim, kv_kind, scores + t);
  for (; t < n; t++) scores[t] = dot_kv(q, key + t * stride, head_dim, kv_kind);
  if (kv_kind == KV_I8)
    for (t = 0; t < n; t++) scores[t] *= kv_row_scale(key + t * stride, head_dim);
}

#ifdef HAVE_AVX2
/* GROUP query heads (a compile-time 1..4 once inlined) at once over 16 dims at a time: every value row is
   loaded once for all of them, and the 2 * GROUP sums are independent, so the FMAs do not wait on each other. */
static inline __attribute__((always_inline)) void accumulate_heads(float *acc, const float *rescale,
                                                                   const float *p, int64_t p_stride,
                                                                   const char *value, int64_t stride, int64_t n,
                                                                   int64_t head_dim, int kv_kind, const int group) {
  for (int64_t d = 0; d < head_dim; d += 16) {
    __m256 lo[4], hi[4];
    for (int g = 0; g < group; g++) {
      const __m256 keep = _mm256_set1_ps(rescale[g]);
      lo[g] = _mm256_mul_ps(keep, _mm256_loadu_ps(acc + g * head_dim + d));
      hi[g] = _mm256_mul_ps(keep, _mm256_loadu_ps(acc + g * head_dim + d + 8));
    }
    for (int64_t t = 0; t < n; t++) {
      const char *row = value + t * stride;
      const __m256 v0 = load8_kv(row, d, kv_kind), v1 = load8_kv(row, d + 8, kv_kind);
      for (int g = 0; g < group; g++) {
        const __m256 w = _mm256_set1_ps(p[g * p_stride + t]);
        lo[g] = _mm256_fmadd_ps(w, v0, lo[g]);
        hi[g] = _mm256_fmadd_ps(w, v1, hi[g]);
      }
    }
    for (int g = 0; g < group; g++) {
      _mm256_storeu_ps(acc + g * head_dim + d, lo[g]);
      _mm256_storeu_ps(acc + g * head_dim + d + 8, hi[g]);
    }
  }
}
#endif

/* acc[g] = acc[g] * rescale[g] + sum_t p[g * p_stride + t] * value_t for the `heads` query heads of one KV head
   (acc rows of head_dim floats) over the n value rows value + t * stride (bytes). */
static void block_accumulate(float *acc, const float *rescale, const float *p, int64_t p_stride, const char *value,
                             int64_t stride, int64_t n, int64_t head_dim, int kv_kind, int64_t heads) {
#ifdef HAVE_AVX2
  if (head_dim % 16 == 0) {
    for (int64_t g = 0; g < heads; g += 4) {
      float *a = acc + g * head_dim;
      const float *r = rescale + g, *pg = p + g * p_stride;
      switch (heads - g < 4 ? heads - g : 4) {
        case 1: accumulate_heads(a, r, pg, p_stride, value, stride, n, head_dim, kv_kind, 1); break;
        case 2: accumulate_heads(a, r, pg, p_stride, value, stride, n, head_dim, kv_kind, 2); break;
        case 3: accumulate_heads(a, r, pg, p_stride, value, stride, n, head_dim, kv_kind, 3); break;
        default: accumulate_heads(a, r, pg, p_stride, value, stride, n, head_dim, kv_kind, 4); break;
      }
    }
    return;
  }
#endif
  for (int64_t g = 0; g < heads; g++)
    for (int64_t t = 0; t < n; t++)
      scale_add_kv(acc + g * head_dim, t == 0 ? rescale[g] : 1.0f, p[g * p_stride + t], value + t * stride,
                   head_dim, kv_kind);
}

/* max_i |x[i]|, or 1 when every x[i] is 0 (a row's int8 scale: see normalize_rows_f32). */
static inline float abs_max_or_one(const float *x, int64_t n) {
  float m = 0.0f;
  int64_t i = 0;
#ifdef HAVE_AVX2
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 vm = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) vm = _mm256_max_ps(vm, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  m = _mm_cvtss_f32(h);
#endif
  for (; i < n; i++) m = fabsf(x[i]) > m ? fabsf(x[i]) : m;
  return m > 0.0f ? m : 1.0f;
}

/* n values as a cache row (see kv_row_bytes); an int8 row rounds to the nearest step of its scale */
static inline void store_kv(char *dst, const float *src, int64_t n, int kv_kind) {
  if (kv_kind == KV_I8) {
    const float largest = abs_max_or_one(src, n), scale = largest / 127.0f, inverse = 127.0f / largest;
    for (int64_t i = 0; i < n; i++) ((int8_t *)dst)[i] = (int8_t)lrintf(src[i] * inverse);
    memcpy(dst + n, &scale, sizeof(scale));
    return;
  }
#ifdef HAVE_AVX2
  if (kv_kind == KV_F16) {
    uint16_t *d = (uint16_t *)dst;
    for (int64_t i = 0; i < n; i++) d[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
    return;
  }
#endif
  memcpy(dst, src, n * sizeof(float));
}

/* out[i] = x[i] * s (out may be x) */
static inline void scale_f32(float *out, const float *x, float s, int64_t n) {
  int64_t i = 0;
#ifdef HAVE_AVX2
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(s)));
#endif
  for (; i < n; i++) out[i] = x[i] * s;
}

/* With row_max (not NULL): row_max[r] = abs_max_or_one(out row r), and the row divided by it, as
   normalize_rows_f32 would do next, while the row is still in L1. */
static inline void normalize_row_into(float *o, int64_t n, float *row_max, int64_t r) {
  if (!row_max) return;
  const float m = abs_max_or_one(o, n);
  row_max[r] = m;
  scale_f32(o, o, 1.0f / m, n);
}

/* out = RMSNorm(x [+ residual]) * weight, row by row; with a residual, summed = x + residual too. x_scale (or
   NULL): x's row r is x[r] * x_scale[r] (an int8 linear's product, its row scale not yet applied; only with a
   residual). out_max (or NULL): normalize out's rows for the int8 linear that reads them (normalize_row_into). */
void add_rms_norm_f32(const float *x, const float *x_scale, const float *residual, float *summed,
                      const float *weight, float *out, float *out_max, int64_t rows, int64_t dim, float eps,
                      int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * dim >= 16384)
  for (int64_t r = 0; r < rows; r++) {
    const float *xr = x + r * dim, *src = xr;
    if (residual) {
      const float *rr = residual + r * dim;
      float *sum = summed + r * dim;
      if (x_scale) {
        /* two loops: the product is rounded before the add (not one fused multiply-add), so the result is the
           one of scaling x first, bit for bit */
        scale_f32(sum, xr, x_scale[r], dim);
        for (int64_t i = 0; i < dim; i++) sum[i] += rr[i];
      } else {
        for (int64_t i = 0; i < dim; i++) sum[i] = xr[i] + rr[i];
      }
      src = sum;
    }
    double sum_sq = 0.0;
#pragma omp simd reduction(+ : sum_sq)
    for (int64_t i = 0; i < dim; i++) sum_sq += (double)src[i] * src[i];
    const float inv = (float)(1.0 / sqrt(sum_sq / dim + eps));
    float *o = out + r * dim;
    for (int64_t i = 0; i < dim; i++) o[i] = weight[i] * (src[i] * inv);
    normalize_row_into(o, dim, out_max, r);
  }
}

/* scales[r] = max_i |x[r, i]| (1 for a row of zeros), out[r] = x[r] / scales[r]: every row's largest magnitude
   becomes 1, so one int8 scale for the whole tensor (torch's dynamic int8 linear) quantizes each row on its own
   range. */
void normalize_rows_f32(const float *x, float *out, float *scales, int64_t rows, int64_t dim, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * dim >= 65536)
  for (int64_t r = 0; r < rows; r++) {
    const float m = abs_max_or_one(x + r * dim, dim);
    scales[r] = m;
    scale_f32(out + r * dim, x + r * dim, 1.0f / m, dim);
  }
}

/* out[r, i] = silu(gate[r, i]) * up[r, i] over a packed [gate | up] row of 2 * half. in_scale (or NULL): the
   row is gate_up[r] * in_scale[r] (see add_rms_norm_f32's x_scale); out_max (or NULL): see add_rms_norm_f32. */
void silu_and_mul_f32(const float *gate_up, const float *in_scale, float *out, float *out_max, int64_t rows,
                      int64_t half, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * half >= 65536)
  for (int64_t r = 0; r < rows; r++) {
    const float *g = gate_up + r * 2 * half, *u = g + half;
    const float s = in_scale ? in_scale[r] : 1.0f;
    float *o = out + r * half;
    int64_t i = 0;
#ifdef HAVE_AVX2
    const __m256 one = _mm256_set1_ps(1.0f), vs = _mm256_set1_ps(s);
    for (; i + 8 <= half; i += 8) {
      const __m256 vg = _mm256_mul_ps(_mm256_loadu_ps(g + i), vs);
      const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), vg))));
      _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(vg, sig), _mm256_mul_ps(_mm256_loadu_ps(u + i), vs)));
    }
#endif
    for (; i < half; i++) {
      const float gi = g[i] * s;
      o[i] = gi / (1.0f + expf(-gi)) * (u[i] * s);
    }
    normalize_row_into(o, half, out_max, r);
  }
}

/* The index of row's largest value, as torch.argmax gives it: the first of equal maxima, and the first NaN if
   there is one. */
static int64_t argmax_row(const float *x, int64_t n) {
  float best = -INFINITY;
  int has_nan = 0;
  int64_t i = 0;
#ifdef HAVE_AVX2
  __m256 vmax = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    vmax = _mm256_max_ps(vmax, v);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, vmax);
  for (int j = 0; j < 8; j++) best = lanes[j] > best ? lanes[j] : best;
  has_nan = _mm256_movemask_ps(nan) != 0;
#endif
  for (; i < n; i++) {
    has_nan |= x[i] != x[i];
    best = x[i] > best ? x[i] : best;
  }
  for (i = 0; i < n; i++)
    if (has_nan ? x[i] != x[i] : x[i] == best) return i;
  return 0;
}

/* out[r] = argmax of row r (argmax_row); rows lie row_stride floats apart. A greedy step's [rows, vocab] logits
   in one pass per row, where torch's argmax takes ~4 ms for 64 x 49152 on one core. */
void argmax_rows_f32(const float *x, int64_t *out, int64_t rows, int64_t cols, int64_t row_stride,
                     int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * cols >= 65536)
  for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * row_stride, cols);
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

/* Software prefetch of `rows` rows of `bytes` bytes each, `stride` bytes apart: the hardware prefetcher does not
   follow a request's blocks, which lie anywhere in the cache pool. */
static inline void prefetch_rows(const char *p, int64_t stride, int64_t rows, int64_t bytes) {
  for (int64_t r = 0; r < rows; r++)
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + r * stride + b, 0, 2);
}

/* One token's K/V, every KV head: k norm, RoPE, and both stored at `slot` (skipped when < 0). */
static void store_row(const float *row, const float *cos, const float *sin, const float *k_norm, float norm_eps,
                      char *k_cache, char *v_cache, int kv_kind, int64_t slot, int64_t num_heads, int64_t num_kv_heads,
                      int64_t head_dim) {
  if (slot < 0) return;
  const int64_t head_bytes = kv_row_bytes(kv_kind, head_dim), token_bytes = num_kv_heads * head_bytes;
  for (int64_t h = 0; h < num_kv_heads; h++) {
    float k[head_dim], rotated[head_dim];
    memcpy(k, row + (num_heads + h) * head_dim, head_dim * sizeof(float));
    if (k_norm) head_rms_norm(k, k_norm, head_dim, norm_eps);
    rope(k, rotated, cos, sin, head_dim);
    store_kv(k_cache + slot * token_bytes + h * head_bytes, rotated, head_dim, kv_kind);
    store_kv(v_cache + slot * token_bytes + h * head_bytes, row + (num_heads + num_kv_heads + h) * head_dim,
             head_dim, kv_kind);
  }
}

/* One token's query heads of KV heads [h0, h1): q norm, RoPE, attention over the first seq_len tokens of its
   request (block table `table`) in the cache. */
static void attend_row(const float *row, const float *cos, const float *sin, const float *q_norm, float norm_eps,
                       const char *k_cache, const char *v_cache, int kv_kind, const int32_t *table, int64_t seq_len,
                       float *out, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                       float scale, int64_t h0, int64_t h1) {
  const int64_t group = num_heads / num_kv_heads, heads = (h1 - h0) * group; /* the query heads here */
  const int64_t head_bytes = kv_row_bytes(kv_kind, head_dim);                /* a (token, KV head) row */
  const int64_t row_bytes = num_kv_heads * head_bytes;                        /* from token to token */
  float q[heads * head_dim], acc[heads * head_dim], scores[heads * block_size];
  float running_max[heads], running_sum[heads], rescale[heads];

  for (int64_t i = 0; i < heads; i++) {
    float tmp[head_dim];
    memcpy(tmp, row + (h0 * group + i) * head_dim, head_dim * sizeof(float));
    if (q_norm) head_rms_norm(tmp, q_norm, head_dim, norm_eps);
    rope(tmp, q + i * head_dim, cos, sin, head_dim);
    for (int64_t d = 0; d < head_dim; d++) q[i * head_dim + d] *= scale;
    running_max[i] = -INFINITY;
    running_sum[i] = 0.0f;
  }
  memset(acc, 0, sizeof(acc));

  /* block by block, and in a block KV head by KV head: the scores of the head's query heads, an online softmax
     (rescale what came before), then their values; a block's K and V rows are read front to back */
  for (int64_t start = 0; start < seq_len; start += block_size) {
    const int64_t n = seq_len - start < block_size ? seq_len - start : block_size;
    const int64_t base = (int64_t)table[start / block_size] * block_size * row_bytes;
    /* the next block, asked for while this one computes: a share of its rows per query head, so the prefetches
       spread over the work instead of filling the miss buffers at once (measured: 1.5 -> 1.2 ms a layer, float16
       cache, 64 requests of 150 tokens; 2.0 without) */
    const int64_t next = start + block_size < seq_len
                             ? (int64_t)table[start / block_size + 1] * block_size * row_bytes : -1;
    for (int64_t h = h0; h < h1; h++) {
      const int64_t first = (h - h0) * group; /* this KV head's query heads among the task's */
      const char *key = k_cache + base + h * head_bytes, *value = v_cache + base + h * head_bytes;
      const int64_t share = (block_size + group - 1) / group; /* rows of the next block asked for per query head */
      for (int64_t i = first; i < first + group; i++) {
        float *si = scores + i * block_size;
        if (next >= 0) {
          const int64_t r0 = (i - first) * share, rows = r0 + share > block_size ? block_size - r0 : share;
          if (rows > 0) {
            prefetch_rows(k_cache + next + r0 * row_bytes + h * head_bytes, row_bytes, rows, head_bytes);
            prefetch_rows(v_cache + next + r0 * row_bytes + h * head_bytes, row_bytes, rows, head_bytes);
          }
        }
        block_scores(q + i * head_dim, key, row_bytes, n, head_dim, kv_kind, si);
        float block_max = running_max[i];
        for (int64_t j = 0; j < n; j++) block_max = si[j] > block_max ? si[j] : block_max;
        rescale[i] = expf(running_max[i] - block_max); /* 0 on the first block (the max was -inf) */
        running_sum[i] = running_sum[i] * rescale[i] + exp_shifted_sum(si, block_max, n);
        running_max[i] = block_max;
      }
      if (kv_kind == KV_I8) /* a value row's scale goes into its softmax weights (their sum is taken) */
        for (int64_t j = 0; j < n; j++) {
          const float value_scale = kv_row_scale(value + j * row_bytes, head_dim);
          for (int64_t i = first; i < first + group; i++) scores[i * block_size + j] *= value_scale;
        }
      block_accumulate(acc + first * head_dim, rescale + first, scores + first * block_size, block_size, value,
                       row_bytes, n, head_dim, kv_kind, group);
    }
  }
  for (int64_t i = 0; i < heads; i++) {
    float *o = out + (h0 * group + i) * head_dim;
    const float inv = running_sum[i] > 0.0f ? 1.0f / running_sum[i] : 0.0f;
    for (int64_t d = 0; d < head_dim; d++) o[d] = acc[i * head_dim + d] * inv;
  }
}

/* A step's attention straight from the fused qkv projection, a row per token (decodes and prefill chunks).

   qkv: [num_rows, qkv_stride], each row [q heads | k heads | v heads] x head_dim. First every row's K/V: optional
   per-head RMSNorm of k (k_norm, NULL when the model has none), RoPE at positions[r], stored at slot_mapping[r]
   (skipped when < 0). Then every row's attention: q norm (q_norm) and RoPE, then its query heads over the first
   attend_lens[r] tokens of its request (block table row row_seq[r], or r when row_seq is NULL; for causal
   attention attend_lens[r] = positions[r] + 1), read in place from the paged cache ([num_blocks, block_size,
   num_kv_heads, head_dim]) block by block with an online softmax. out: [num_rows, num_heads, head_dim]; a row
   of length 0 gives zeros. The cache holds float32, float16 (when kv_f16_supported()) or int8 rows (kv_kind: see
   kv_row_bytes; the int8 cache's last dimension is head_dim + 4).
   An attention task is a whole row (its K/V rows are read front to back) when there are enough rows to share
   out, else one KV head of one row. */
void rope_store_attention_f32(const float *qkv, int64_t qkv_stride, const int64_t *positions,
                              const float *cos_table, const float *sin_table, const float *q_norm,
                              const float *k_norm, float norm_eps, void *k_cache, void *v_cache, int kv_kind,
                              const int32_t *block_tables, int64_t table_stride, const int32_t *row_seq,
                              const int32_t *attend_lens, const int64_t *slot_mapping, float *out, int64_t num_rows,
                              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                              float scale, int num_threads) {
  const int64_t heads_per_task = num_rows >= 4 * num_threads ? num_kv_heads : 1;
  const int64_t tasks_per_row = num_kv_heads / heads_per_task;
#pragma omp parallel num_threads(num_threads)
  {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < num_rows; r++)
      store_row(qkv + r * qkv_stride, cos_table + positions[r] * head_dim, sin_table + positions[r] * head_dim, k_norm,
                norm_eps, (char *)k_cache, (char *)v_cache, kv_kind, slot_mapping[r], num_heads, num_kv_heads,
                head_dim);
    /* (the implicit barrier: a prefill row reads the K/V its request's other rows just stored) */
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_rows * tasks_per_row; task++) {
      const int64_t r = task / tasks_per_row, h0 = task % tasks_per_row * heads_per_task;
      const int64_t seq = row_seq ? row_seq[r] : r;
      attend_row(qkv + r * qkv_stride, cos_table + positions[r] * head_dim, sin_table + positions[r] * head_dim,
                 q_norm, norm_eps, (const char *)k_cache, (const char *)v_cache, kv_kind,
                 block_tables + seq * table_stride, attend_lens[r], out + r * num_heads * head_dim, num_heads,
                 num_kv_heads, head_dim, block_size, scale, h0, h0 + heads_per_task);
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

#ifdef HAVE_AVX2
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
  return hsum_avx2(acc);
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

/* QBLOCK values of x -> q in [-127, 127], steps of their largest magnitude / 127 (returned; 0 for zeros) */
static inline float quantize_block_i8(const float *x, int8_t *q) {
  float amax = 0.0f;
  for (int64_t i = 0; i < QBLOCK; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  for (int64_t i = 0; i < QBLOCK; i++) q[i] = (int8_t)lrintf(x[i] * inv);
  return amax / 127.0f;
}

/* x: [rows, in] float32 (rows contiguous; a few rows: they are quantized on the stack); w: [out, in] int8;
   w_scale: [out]; bias: [out] or NULL; y: [rows, out]. */
void linear_i8_f32(const float *x, const int8_t *w, const float *w_scale, const float *bias, float *y,
                   int64_t rows, int64_t in, int64_t out, int num_threads) {
  const int64_t blocks = in / QBLOCK;
  float x_scale[rows * blocks];
  int8_t xq[rows * in];
  for (int64_t b = 0; b < rows * blocks; b++) x_scale[b] = quantize_block_i8(x + b * QBLOCK, xq + b * QBLOCK);
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t j = 0; j < out; j++) {
    const int8_t *wj = w + j * in;
    for (int64_t r = 0; r < rows; r++) {
      const float value = dot_i8(xq + r * in, x_scale + r * blocks, wj, in) * w_scale[j];
      y[r * out + j] = bias ? value + bias[j] : value;
    }
  }
}

/* ---- int8 products in column tiles, for any number of rows ----------------------------------------------
   The same numbers as linear_i8 (int8 weights with a scale per output channel; each row of x quantized in blocks
   of 32 values, each with its own scale), for any number of rows, with the weight laid out for the product:
   tiles of 16 output channels, each tile [in / 4][16][4] (4 consecutive input values of a channel side by side,
   what AVX512-VNNI's dpbusd multiplies and sums into one int32). dpbusd multiplies an unsigned byte by a signed
   one, so x goes in as q + 128 (no saturation: its sums are int32) and each block's sum is corrected by
   128 * the block's weight sum (w_sum: [out / 16][in / 32][16], computed once with the layout). Measured on a
   2-core AVX512-VNNI CPU: as fast as or faster than fbgemm's int8 GEMM (per-row scales, 7-bit activations) at
   16-1024 rows, with half its error; at one row, with the weights streamed from memory, ~15 % slower than the
   few-row kernel above, which keeps its steps of one or two rows. Without VNNI a plain C loop computes the same
   numbers (the tests run it anywhere; the engine takes it only with VNNI). */
#define TILE 16

int linear_i8_tiles_vnni(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return 1;
#else
  return 0;
#endif
}

/* one row of x -> in bytes (q + 128) and in / 32 scales (times row_scale: x's rows may come normalized) */
static void quantize_row_u8(const float *x, uint8_t *q, float *scale, int64_t in, float row_scale) {
  for (int64_t b = 0; b < in / QBLOCK; b++) {
    const float *xb = x + b * QBLOCK;
    uint8_t *qb = q + b * QBLOCK;
    /* + 128 of a byte in [-127, 127] is its top bit flipped */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    const __m128i offset = _mm_set1_epi8((char)0x80);
    _mm_storeu_si128((__m128i *)qb,
                     _mm_xor_si128(_mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, inv))), offset));
    _mm_storeu_si128((__m128i *)(qb + 16),
                     _mm_xor_si128(_mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, inv))), offset));
    scale[b] = amax / 127.0f * row_scale;
#else
    scale[b] = quantize_block_i8(xb, (int8_t *)qb) * row_scale;
    for (int64_t i = 0; i < QBLOCK; i++) qb[i] ^= 0x80;
#endif
  }
}

#define TILE_ROWS 6
#define TILE_GROUP 2
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* y[R rows, T tiles of 16 channels] from R quantized rows and T consecutive weight tiles (R, T constants where
   inlined: 12 int32 and 12 float accumulators in registers at R = 6, T = 2). Per block of 32 inputs: 8 dpbusd a
   (row, tile), then the block's correction and scale into the float sums. */
static inline __attribute__((always_inline)) void tiles_kernel(const int R, const int T, const uint8_t *xq,
                                                               const float *xs, const int8_t *w, const int32_t *w_sum,
                                                               int64_t in, float *sums) {
  const int64_t blocks = in / QBLOCK;
  __m512 acc[TILE_ROWS][TILE_GROUP];
  for (int r = 0; r < R; r++)
    for (int t = 0; t < T; t++) acc[r][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; b++) {
    __m512i dot[TILE_ROWS][TILE_GROUP];
    for (int r = 0; r < R; r++)
      for (int t = 0; t < T; t++) dot[r][t] = _mm512_setzero_si512();
    for (int64_t k4 = b * (QBLOCK / 4); k4 < (b + 1) * (QBLOCK / 4); k4++) {
      __m512i wv[TILE_GROUP];
      for (int t = 0; t < T; t++) wv[t] = _mm512_loadu_si512((const void *)(w + t * TILE * in + k4 * 64));
      for (int r = 0; r < R; r++) {
        const __m512i xv = _mm512_set1_epi32(*(const int32_t *)(xq + r * in + k4 * 4));
        for (int t = 0; t < T; t++) dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], xv, wv[t]);
      }
    }
    for (int r = 0; r < R; r++) {
      const __m512 scale = _mm512_set1_ps(xs[r * blocks + b]);
      for (int t = 0; t < T; t++) {
        const __m512i correction = _mm512_loadu_si512((const void *)(w_sum + (t * blocks + b) * TILE));
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot[r][t], correction)), scale, acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; r++)
    for (int t = 0; t < T; t++) _mm512_storeu_ps(sums + (r * TILE_GROUP + t) * TILE, acc[r][t]);
}
#endif

/* sums [rows][TILE_GROUP][16]: the scaled block sums of `rows` (<= TILE_ROWS) rows by T (<= TILE_GROUP)
   consecutive tiles */
static void tiles_rows(int64_t rows, int T, const uint8_t *xq, const float *xs, const int8_t *w,
                       const int32_t *w_sum, int64_t in, float *sums) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define ROWS(R) case R: if (T == 2) tiles_kernel(R, 2, xq, xs, w, w_sum, in, sums); \
                      else tiles_kernel(R, 1, xq, xs, w, w_sum, in, sums); break;
  switch (rows) { ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) }
#undef ROWS
#else
  const int64_t blocks = in / QBLOCK;
  for (int64_t r = 0; r < rows; r++)
    for (int t = 0; t < T; t++) {
      float total[TILE] = {0};
      for (int64_t b = 0; b < blocks; b++) {
        int32_t dot[TILE] = {0};
        for (int64_t k4 = b * (QBLOCK / 4); k4 < (b + 1) * (QBLOCK / 4); k4++) {
          const uint8_t *xk = xq + r * in + k4 * 4;
          const int8_t *wk = w + t * TILE * in + k4 * 4 * TILE;
          for (int c = 0; c < TILE; c++)
            for (int i = 0; i < 4; i++) dot[c] += (int32_t)xk[i] * wk[c * 4 + i];
        }
        for (int c = 0; c < TILE; c++)
          total[c] += (float)(dot[c] - w_sum[(t * blocks + b) * TILE + c]) * xs[r * blocks + b];
      }
      for (int c = 0; c < TILE; c++) sums[(r * TILE_GROUP + t) * TILE + c] = total[c];
    }
#endif
}

/* x: [rows, in] float32 (rows contiguous); row_scale: [rows] or NULL (x's rows times it are the input);
   w: [out / 16] tiles as above; w_sum: [out / 16][in / 32][16]; w_scale, bias (or NULL): [out]; y: [rows, out].
   in a multiple of 32, out of 16. Threads share out pairs of tiles: each reads its weights once. */
void linear_i8_tiles_f32(const float *x, const float *row_scale, const int8_t *w, const int32_t *w_sum,
                         const float *w_scale, const float *bias, float *y, int64_t rows, int64_t in, int64_t out,
                         int num_threads) {
  const int64_t blocks = in / QBLOCK, tiles = out / TILE;
  uint8_t *xq = malloc(rows * in);
  float *xs = malloc(sizeof(float) * rows * blocks);
#pragma omp parallel num_threads(num_threads)
  {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++)
      quantize_row_u8(x + r * in, xq + r * in, xs + r * blocks, in, row_scale ? row_scale[r] : 1.0f);
#pragma omp for schedule(static)
    for (int64_t g = 0; g < (tiles + TILE_GROUP - 1) / TILE_GROUP; g++) {
      const int64_t t0 = g * TILE_GROUP;
      const int T = tiles - t0 < TILE_GROUP ? (int)(tiles - t0) : TILE_GROUP;
      float sums[TILE_ROWS * TILE_GROUP * TILE];
      for (int64_t r0 = 0; r0 < rows; r0 += TILE_ROWS) {
        const int64_t n = rows - r0 < TILE_ROWS ? rows - r0 : TILE_ROWS;
        tiles_rows(n, T, xq + r0 * in, xs + r0 * blocks, w + t0 * TILE * in, w_sum + t0 * blocks * TILE, in, sums);
        for (int64_t r = 0; r < n; r++)
          for (int t = 0; t < T; t++) {
            const int64_t col = (t0 + t) * TILE;
            const float *sum = sums + (r * TILE_GROUP + t) * TILE;
            float *y_row = y + (r0 + r) * out + col;
            for (int c = 0; c < TILE; c++) y_row[c] = sum[c] * w_scale[col + c] + (bias ? bias[col + c] : 0.0f);
          }
      }
    }
  }
  free(xq);
  free(xs);
}

/* ---- products on 4- and 8-bit weight blocks (GGUF's Q4_0 / Q4_1 / Q8_0 numbers) -------------------------
   y[r, c] = sum_b xs[r, b] * (d[c, b] * sum_{i in b} q[c, i] * xq[r, i] + m[c, b] * sum_{i in b} xq[r, i]):
   weights in blocks of 32 inputs of one output channel, each block with a float16 scale d and (4-bit) a float16
   offset m: w = d * q + m with q in [0, 15] (Q4_1 as GGUF stores it; Q4_0 is m = -8 d), or w = d * q with q in
   [-127, 127] (Q8_0). Weights are laid out in tiles of 16 output channels: 8-bit tiles [in / 4][16][4] bytes
   (linear_i8_tiles' layout), 4-bit tiles [in / 8][16][4] bytes, byte i of a channel's group of 8 inputs holding
   input i in its low nibble and input i + 4 in its high one; d and m [out / 16][in / 32][16]. Multiplying an
   unsigned by a signed byte (VNNI's dpbusd, AVX2's maddubs), the 4-bit q go in as they are and the 8-bit ones as
   q + 128, the excess taken back through 128 * the block's sum of xq. One kernel takes every row count: a tile's
   weights are read once for up to 6 int8 rows (a step of a row or two is bound by reading the weights: 4-bit
   blocks are 0.625 bytes a weight).

   Activations (quantize_row_blocks): each row of x in blocks of 32, pass 1 to int8 steps of the block's largest
   magnitude / 127; with two passes, what that rounding left out (at most half a step) to int8 steps 256 times
   finer. A block's input is then xq = 256 q1 + q2 (~15 bits) in steps of step / 256, and the two passes' integer
   sums are joined as 256 dot1 + dot2 before one conversion to float: the second pass costs its integer products
   only. */
#define QTILE_ROWS 6 /* int8 rows a kernel call multiplies: 6 rows of one pass, 3 of two */
#define QTILE_GROUP 2
#define QPASS_SHIFT 8 /* pass 2's steps are 2^8 times finer than pass 1's */
/* each weight line is asked for this far ahead of its read: a thread walks its tiles as one stream, which the
   hardware prefetchers restart at every 4 KiB page; at a few rows nothing else hides that wait */
#define QPREFETCH_BYTES 2048
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define QBLOCKS_SIMD 2
#elif defined(HAVE_AVX2)
#define QBLOCKS_SIMD 1
#else
#define QBLOCKS_SIMD 0
#endif

/* 2: AVX512-VNNI, 1: AVX2 (maddubs), 0: the plain loop */
int linear_blocks_simd(void) { return QBLOCKS_SIMD; }

static inline float half_to_float(uint16_t h) {
#ifdef HAVE_AVX2
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  uint32_t bits;
  if (exponent == 0x1f) bits = sign | 0x7f800000 | (mantissa << 13);
  else if (exponent) bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  else if (!mantissa) bits = sign;
  else {  /* subnormal: normalize */
    int e = -1;
    uint32_t m = mantissa;
    do { e++; m <<= 1; } while (!(m & 0x400));
    bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3ff) << 13);
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
#endif
}

/* QBLOCK floats times inv, rounded to the nearest integer (ties to even, as lrintf and cvtps in the default
   rounding mode), clamped to [-127, 127], into q; returns their sum. left (or NULL): src - q * step, with one
   rounding (a fused multiply-add in every build). */
static inline int32_t round_block(const float *src, float inv, float step, int8_t *q, float *left) {
#if QBLOCKS_SIMD == 2
  const __m512 vi = _mm512_set1_ps(inv), vs = _mm512_set1_ps(step);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  __m512i total = _mm512_setzero_si512();
  for (int i = 0; i < QBLOCK; i += 16) {
    const __m512 v = _mm512_loadu_ps(src + i);
    const __m512i n = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v, vi)), lo), hi);
    _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtepi32_epi8(n));
    total = _mm512_add_epi32(total, n);
    if (left) _mm512_storeu_ps(left + i, _mm512_fnmadd_ps(_mm512_cvtepi32_ps(n), vs, v));
  }
  return _mm512_reduce_add_epi32(total);
#elif QBLOCKS_SIMD == 1
  const __m256 vi = _mm256_set1_ps(inv), vs = _mm256_set1_ps(step);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  __m256i n[4], total = _mm256_setzero_si256();
  for (int k = 0; k < 4; k++) {
    const __m256 v = _mm256_loadu_ps(src + 8 * k);
    n[k] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v, vi)), lo), hi);
    total = _mm256_add_epi32(total, n[k]);
    if (left) _mm256_storeu_ps(left + 8 * k, _mm256_fnmadd_ps(_mm256_cvtepi32_ps(n[k]), vs, v));
  }
  /* packs work within 128-bit lanes: [0-3 8-11 | 4-7 12-15] then [.. 16-19 24-27 ..]; the permute puts them back */
  const __m256i words = _mm256_packs_epi32(n[0], n[1]), words2 = _mm256_packs_epi32(n[2], n[3]);
  const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words, words2),
                                                    _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256((__m256i *)q, bytes);
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
#else
  int32_t total = 0;
  for (int i = 0; i < QBLOCK; i++) {
    long n = lrintf(src[i] * inv);
    n = n < -127 ? -127 : n > 127 ? 127 : n;
    q[i] = (int8_t)n;
    total += (int32_t)n;
    if (left) left[i] = fmaf(-(float)n, step, src[i]);
  }
  return total;
#endif
}

/* the largest magnitude of QBLOCK floats (0 for zeros, NaNs passed over; exact in any order: every build gives
   the same) */
static inline float abs_max32(const float *src) {
#if QBLOCKS_SIMD == 2
  const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(src)), b = _mm512_abs_ps(_mm512_loadu_ps(src + 16));
  return _mm512_reduce_max_ps(_mm512_max_ps(a, _mm512_max_ps(b, _mm512_setzero_ps())));
#elif QBLOCKS_SIMD == 1
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v = _mm256_setzero_ps();
  for (int i = 0; i < QBLOCK; i += 8) v = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(src + i)), v);
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
#else
  float amax = 0.0f;
  for (int i = 0; i < QBLOCK; i++) amax = fabsf(src[i]) > amax ? fabsf(src[i]) : amax;
  return amax;
#endif
}

/* One row of x (in floats; row_scale: the input is x times it) as the block kernels read it: q [passes][in] int8,
   and per block xs (the step of xq = 256 q1 + q2, or q1), xsum (the block's sum of xq) and xms = xs * xsum. */
static void quantize_row_blocks(const float *x, int64_t in, int passes, float row_scale, int8_t *q, float *xs,
                                int32_t *xsum, float *xms) {
  for (int64_t b = 0; b < in / QBLOCK; b++) {
    const float *src = x + b * QBLOCK;
    const float amax = abs_max32(src);
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    float step = amax / 127.0f, left[QBLOCK];
    int32_t total = round_block(src, inv, step, q + b * QBLOCK, passes == 2 ? left : NULL);
    if (passes == 2) {
      const float fine = (float)(1 << QPASS_SHIFT);
      total = total * (1 << QPASS_SHIFT) + round_block(left, inv * fine, 0.0f, q + in + b * QBLOCK, NULL);
      step /= fine;
    }
    xs[b] = step * row_scale;
    xsum[b] = total;
    xms[b] = xs[b] * (float)total;
  }
}

#if QBLOCKS_SIMD == 2
/* R int8 rows (R / P rows of P passes) x T tiles; dot: int32 sums of one block, acc: float sums */
static inline __attribute__((always_inline)) void blocks_kernel(const int R, const int T, const int bits,
    const int P, const int8_t *xq, const float *xs, const float *xms, const int32_t *xsum, const uint8_t *w,
    int64_t tile_bytes, const uint16_t *d, const uint16_t *m, int64_t in, float *sums) {
  const int64_t blocks = in / QBLOCK;
  __m512 acc[QTILE_ROWS][QTILE_GROUP];
  for (int r = 0; r < R / P; r++)
    for (int t = 0; t < T; t++) acc[r][t] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8((char)0x80);
  /* a row or two: each (row, tile)'s products would form one chain of dependent dpbusd (several cycles each), which
     bounds the kernel below the memory's pace; two sums a (row, tile), joined after the block, halve the chains */
  const int two_sums = R * T <= 4;
  for (int64_t b = 0; b < blocks; b++) {
    __m512i dot[QTILE_ROWS][QTILE_GROUP], dot2[QTILE_ROWS][QTILE_GROUP];
    for (int r = 0; r < R; r++)
      for (int t = 0; t < T; t++) dot[r][t] = dot2[r][t] = _mm512_setzero_si512();
    if (bits == 4) {
      for (int64_t g = b * (QBLOCK / 8); g < (b + 1) * (QBLOCK / 8); g++) {
        __m512i lo[QTILE_GROUP], hi[QTILE_GROUP];
        for (int t = 0; t < T; t++) {
          _mm_prefetch((const char *)(w + t * tile_bytes + g * 64 + QPREFETCH_BYTES), _MM_HINT_T0);
          const __m512i v = _mm512_loadu_si512((const void *)(w + t * tile_bytes + g * 64));
          lo[t] = _mm512_and_si512(v, low);
          hi[t] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
        for (int r = 0; r < R; r++) {
          const __m512i xl = _mm512_set1_epi32(*(const int32_t *)(xq + r * in + g * 8));
          const __m512i xh = _mm512_set1_epi32(*(const int32_t *)(xq + r * in + g * 8 + 4));
          for (int t = 0; t < T; t++) {
            dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], lo[t], xl);
            if (two_sums) dot2[r][t] = _mm512_dpbusd_epi32(dot2[r][t], hi[t], xh);
            else dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], hi[t], xh);
          }
        }
      }
    } else {
      for (int k = 0; k < QBLOCK / 4; k++) {
        const int64_t k4 = b * (QBLOCK / 4) + k;
        __m512i wv[QTILE_GROUP];
        for (int t = 0; t < T; t++) {
          _mm_prefetch((const char *)(w + t * tile_bytes + k4 * 64 + QPREFETCH_BYTES), _MM_HINT_T0);
          wv[t] = _mm512_xor_si512(_mm512_loadu_si512((const void *)(w + t * tile_bytes + k4 * 64)), flip);
        }
        for (int r = 0; r < R; r++) {
          const __m512i xv = _mm512_set1_epi32(*(const int32_t *)(xq + r * in + k4 * 4));
          for (int t = 0; t < T; t++) {
            if (two_sums && (k & 1)) dot2[r][t] = _mm512_dpbusd_epi32(dot2[r][t], wv[t], xv);
            else dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], wv[t], xv);
          }
        }
      }
    }
    if (two_sums)
      for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) dot[r][t] = _mm512_add_epi32(dot[r][t], dot2[r][t]);
    for (int t = 0; t < T; t++) {
      const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + (t * blocks + b) * TILE)));
      const __m512 mv = bits == 4 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m + (t * blocks + b) * TILE)))
                                  : _mm512_setzero_ps();
      for (int r = 0; r < R / P; r++) {
        __m512i sum = P == 2 ? _mm512_add_epi32(_mm512_slli_epi32(dot[2 * r][t], QPASS_SHIFT), dot[2 * r + 1][t])
                             : dot[r][t];
        if (bits == 8) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(128 * xsum[r * blocks + b]));
        acc[r][t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum), dv), _mm512_set1_ps(xs[r * blocks + b]),
                                    acc[r][t]);
        if (bits == 4) acc[r][t] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xms[r * blocks + b]), acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R / P; r++)
    for (int t = 0; t < T; t++) _mm512_storeu_ps(sums + (r * QTILE_GROUP + t) * TILE, acc[r][t]);
}
#elif QBLOCKS_SIMD == 1
/* AVX2: a tile is two halves of 8 channels (one 256-bit register of 8 x 4 bytes each); H (1 or 2) halves at a time,
   from w, d, m (the first half's) over every block, R int8 rows (R / P rows of P passes). Both halves at once read
   a tile's weights in one sweep (what a row or two, bound by reading memory, wants); one half at a time keeps more
   rows' sums in the 16 registers (both halves of 6 rows spilled every block: ~10 % slower at 64 rows). 4-bit:
   maddubs' 16-bit pair sums (<= 2 * 15 * 127) add up over a block's 8 products before widening (<= 30,480). 8-bit:
   |q| times xq with q's sign (pair sums <= 2 * 127^2), widened after each product. sums: [R / P][8 H] at a row
   stride of QTILE_GROUP * TILE. */
static inline __attribute__((always_inline)) void blocks_kernel(const int R, const int H, const int bits,
    const int P, const int8_t *xq, const float *xs, const float *xms, const uint8_t *w, const uint16_t *d,
    const uint16_t *m, int64_t in, float *sums) {
  const int64_t blocks = in / QBLOCK;
  __m256 acc[QTILE_ROWS][2];
  for (int r = 0; r < R / P; r++)
    for (int h = 0; h < H; h++) acc[r][h] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < blocks; b++) {
    __m256i dot[QTILE_ROWS][2];
    if (bits == 4) {
      __m256i pairs[QTILE_ROWS][2];
      for (int r = 0; r < R; r++)
        for (int h = 0; h < H; h++) pairs[r][h] = _mm256_setzero_si256();
/* unrolled: a block's 4 groups in one body, the loop's own instructions gone (the kernel is issue-bound at many rows) */
#pragma GCC unroll 4
      for (int64_t g = b * (QBLOCK / 8); g < (b + 1) * (QBLOCK / 8); g++)
        for (int h = 0; h < H; h++) {
          if (h == 0) _mm_prefetch((const char *)(w + g * 64 + QPREFETCH_BYTES), _MM_HINT_T0);
          const __m256i v = _mm256_loadu_si256((const __m256i *)(w + g * 64 + h * 32));
          const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
          for (int r = 0; r < R; r++) {
            const __m256i xl = _mm256_set1_epi32(*(const int32_t *)(xq + r * in + g * 8));
            const __m256i xh = _mm256_set1_epi32(*(const int32_t *)(xq + r * in + g * 8 + 4));
            pairs[r][h] = _mm256_add_epi16(pairs[r][h], _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl),
                                                                           _mm256_maddubs_epi16(hi, xh)));
          }
        }
      for (int r = 0; r < R; r++)
        for (int h = 0; h < H; h++) dot[r][h] = _mm256_madd_epi16(pairs[r][h], ones);
    } else {
      for (int r = 0; r < R; r++)
        for (int h = 0; h < H; h++) dot[r][h] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int64_t k4 = b * (QBLOCK / 4); k4 < (b + 1) * (QBLOCK / 4); k4++)
        for (int h = 0; h < H; h++) {
          if (h == 0) _mm_prefetch((const char *)(w + k4 * 64 + QPREFETCH_BYTES), _MM_HINT_T0);
          const __m256i v = _mm256_loadu_si256((const __m256i *)(w + k4 * 64 + h * 32));
          const __m256i magnitude = _mm256_sign_epi8(v, v);
          for (int r = 0; r < R; r++) {
            const __m256i xv = _mm256_set1_epi32(*(const int32_t *)(xq + r * in + k4 * 4));
            dot[r][h] = _mm256_add_epi32(dot[r][h], _mm256_madd_epi16(
                _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xv, v)), ones));
          }
        }
    }
    for (int h = 0; h < H; h++) {
      const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + b * TILE + h * 8)));
      const __m256 mv = bits == 4 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m + b * TILE + h * 8)))
                                  : _mm256_setzero_ps();
      for (int r = 0; r < R / P; r++) {
        const __m256i sum = P == 2 ? _mm256_add_epi32(_mm256_slli_epi32(dot[2 * r][h], QPASS_SHIFT), dot[2 * r + 1][h])
                                   : dot[r][h];
        acc[r][h] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sum), dv), _mm256_set1_ps(xs[r * blocks + b]),
                                    acc[r][h]);
        if (bits == 4) acc[r][h] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xms[r * blocks + b]), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R / P; r++)
    for (int h = 0; h < H; h++) _mm256_storeu_ps(sums + r * QTILE_GROUP * TILE + h * 8, acc[r][h]);
}
#endif

/* sums [rows / passes][QTILE_GROUP][16] of `rows` (<= QTILE_ROWS, a multiple of passes) int8 rows by T
   (<= QTILE_GROUP) consecutive tiles */
static void blocks_rows(int64_t rows, int T, int bits, int passes, const int8_t *xq, const float *xs,
                        const float *xms, const int32_t *xsum, const uint8_t *w, int64_t tile_bytes,
                        const uint16_t *d, const uint16_t *m, int64_t in, float *sums) {
  const int64_t blocks = in / QBLOCK;
#if QBLOCKS_SIMD == 2
#define KERNEL(R, P) \
    if (bits == 4) { if (T == 2) blocks_kernel(R, 2, 4, P, xq, xs, xms, xsum, w, tile_bytes, d, m, in, sums); \
                     else blocks_kernel(R, 1, 4, P, xq, xs, xms, xsum, w, tile_bytes, d, m, in, sums); } \
    else { if (T == 2) blocks_kernel(R, 2, 8, P, xq, xs, xms, xsum, w, tile_bytes, d, m, in, sums); \
           else blocks_kernel(R, 1, 8, P, xq, xs, xms, xsum, w, tile_bytes, d, m, in, sums); }
#define ROWS(R) case R: if (passes == 2) { KERNEL(R, 2) } else { KERNEL(R, 1) } break;
  switch (rows) { ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) }
#undef ROWS
#undef KERNEL
  (void)blocks;
#elif QBLOCKS_SIMD == 1
  /* up to 3 int8 rows: whole tiles; more: half a tile at a time (blocks_kernel) */
  for (int t = 0; t < T; t++)
    for (int h = 0; h < 2; h += rows <= 3 ? 2 : 1) {
      const uint8_t *wh = w + t * tile_bytes + h * 32;
      const uint16_t *dh = d + t * blocks * TILE + h * 8, *mh = m ? m + t * blocks * TILE + h * 8 : NULL;
      float *out = sums + t * TILE + h * 8;
#define KERNEL(R, H, P) if (bits == 4) blocks_kernel(R, H, 4, P, xq, xs, xms, wh, dh, mh, in, out); \
                        else blocks_kernel(R, H, 8, P, xq, xs, xms, wh, dh, mh, in, out);
#define ROWS(R, H) case R: if (passes == 2) { KERNEL(R, H, 2) } else { KERNEL(R, H, 1) } break;
      switch (rows) { ROWS(1, 2) ROWS(2, 2) ROWS(3, 2) ROWS(4, 1) ROWS(5, 1) ROWS(6, 1) }
#undef ROWS
#undef KERNEL
    }
  (void)xsum;
#else
  for (int64_t r = 0; r < rows / passes; r++)
    for (int t = 0; t < T; t++) {
      float total[TILE] = {0};
      const uint8_t *wt = w + t * tile_bytes;
      for (int64_t b = 0; b < blocks; b++) {
        int32_t dot[2][TILE] = {{0}};
        for (int p = 0; p < passes; p++) {
          const int8_t *xr = xq + (r * passes + p) * in;
          for (int64_t i = b * QBLOCK; i < (b + 1) * QBLOCK; i++) {
            const int32_t xi = xr[i];
            for (int c = 0; c < TILE; c++) {
              int32_t q;
              if (bits == 4) {
                const uint8_t byte = wt[(i / 8) * 64 + c * 4 + i % 4];
                q = i % 8 < 4 ? byte & 0x0f : byte >> 4;
              } else {
                q = (int32_t)(int8_t)wt[(i / 4) * 64 + c * 4 + i % 4] + 128;
              }
              dot[p][c] += q * xi;
            }
          }
        }
        const int64_t s = (t * blocks + b) * TILE;
        for (int c = 0; c < TILE; c++) {
          int32_t sum = passes == 2 ? dot[0][c] * (1 << QPASS_SHIFT) + dot[1][c] : dot[0][c];
          if (bits == 8) sum -= 128 * xsum[r * blocks + b];
          total[c] = fmaf((float)sum * half_to_float(d[s + c]), xs[r * blocks + b], total[c]);
          if (bits == 4) total[c] = fmaf(half_to_float(m[s + c]), xms[r * blocks + b], total[c]);
        }
      }
      memcpy(sums + (r * QTILE_GROUP + t) * TILE, total, sizeof total);
    }
#endif
}

/* Rows of x quantized for the block kernels (quantize_row_blocks), and the product of them by a block weight:
   what linear_blocks_f32 and linear_blocks_top_f32 share. */
typedef struct {
  int8_t *xq;  /* [rows * passes][in] */
  float *xs, *xms;  /* [rows][blocks] */
  int32_t *xsum;
} QuantRows;

static QuantRows quant_rows_new(int64_t rows, int64_t in, int passes) {
  const int64_t blocks = in / QBLOCK;
  QuantRows q = {malloc(rows * passes * in), malloc(sizeof(float) * rows * blocks),
                 malloc(sizeof(float) * rows * blocks), malloc(sizeof(int32_t) * rows * blocks)};
  return q;
}

static void quant_rows_free(QuantRows q) {
  free(q.xq);
  free(q.xs);
  free(q.xms);
  free(q.xsum);
}

static void quantize_row_at(const QuantRows *q, const float *x, const float *row_scale, int64_t r, int64_t in,
                            int passes) {
  const int64_t blocks = in / QBLOCK;
  quantize_row_blocks(x + r * in, in, passes, row_scale ? row_scale[r] : 1.0f, q->xq + r * passes * in,
                      q->xs + r * blocks, q->xsum + r * blocks, q->xms + r * blocks);
}

/* y [rows, out] = the quantized rows times the weight (+ bias); inside a parallel region, threads sharing out pairs
   of tiles (each reads its weights once) */
static void blocks_product(const QuantRows *q, int64_t rows, int passes, const uint8_t *w, const uint16_t *d,
                           const uint16_t *m, int bits, const float *bias, float *y, int64_t in, int64_t out) {
  const int64_t blocks = in / QBLOCK, tiles = out / TILE, tile_bytes = TILE * in * bits / 8;
  const int64_t qrows = rows * passes;
#pragma omp for schedule(static)
  for (int64_t g = 0; g < (tiles + QTILE_GROUP - 1) / QTILE_GROUP; g++) {
    const int64_t t0 = g * QTILE_GROUP;
    const int T = tiles - t0 < QTILE_GROUP ? (int)(tiles - t0) : QTILE_GROUP;
    float sums[QTILE_ROWS * QTILE_GROUP * TILE];
    /* the next group's weights asked for a slice a chunk of rows, while this group's are multiplied (else its
       first chunk waits on memory) */
    const int64_t chunks = (qrows + QTILE_ROWS - 1) / QTILE_ROWS;
    const int64_t ahead = tiles - t0 - T < QTILE_GROUP ? tiles - t0 - T : QTILE_GROUP;
    const char *next = (const char *)(w + (t0 + T) * tile_bytes);
    const int64_t slice = (ahead * tile_bytes / chunks + 63) / 64 * 64;
    /* whole rows a chunk: QTILE_ROWS is a multiple of passes (1 or 2) */
    for (int64_t r0 = 0; r0 < qrows; r0 += QTILE_ROWS) {
      const int64_t n = qrows - r0 < QTILE_ROWS ? qrows - r0 : QTILE_ROWS, first = r0 / passes;
      if (chunks > 1)
        for (int64_t b = r0 / QTILE_ROWS * slice; b < (r0 / QTILE_ROWS + 1) * slice && b < ahead * tile_bytes; b += 64)
          __builtin_prefetch(next + b, 0, 2);
      blocks_rows(n, T, bits, passes, q->xq + r0 * in, q->xs + first * blocks, q->xms + first * blocks,
                  q->xsum + first * blocks, w + t0 * tile_bytes, tile_bytes, d + t0 * blocks * TILE,
                  m ? m + t0 * blocks * TILE : NULL, in, sums);
      for (int64_t r = 0; r < n / passes; r++)
        for (int t = 0; t < T; t++) {
          const int64_t col = (t0 + t) * TILE;
          const float *sum = sums + (r * QTILE_GROUP + t) * TILE;
          float *y_row = y + (first + r) * out + col;
          for (int c = 0; c < TILE; c++) y_row[c] = bias ? sum[c] + bias[col + c] : sum[c];
        }
    }
  }
}

/* x: [rows, in] float32 (rows contiguous); row_scale: [rows] or NULL (x's rows times it are the input); w, d, m
   (NULL for 8 bits): the tiles above; bias (or NULL): [out]; y: [rows, out]. in a multiple of 32, out of 16.
   passes 2: each row goes in twice (quantize_row_blocks), activations to ~15 bits for the price of a second int8
   row's products (what a step bound by reading the weights barely notices). A few rows are quantized before the
   threads start (one barrier fewer). */
void linear_blocks_f32(const float *x, const float *row_scale, const uint8_t *w, const uint16_t *d,
                       const uint16_t *m, int bits, int passes, const float *bias, float *y, int64_t rows,
                       int64_t in, int64_t out, int num_threads) {
  const QuantRows q = quant_rows_new(rows, in, passes);
  const int quantize_first = rows * in <= 8192;
  if (quantize_first)
    for (int64_t r = 0; r < rows; r++) quantize_row_at(&q, x, row_scale, r, in, passes);
#pragma omp parallel num_threads(num_threads)
  {
    if (!quantize_first) {
#pragma omp for schedule(static)
      for (int64_t r = 0; r < rows; r++) quantize_row_at(&q, x, row_scale, r, in, passes);
    }
    blocks_product(&q, rows, passes, w, d, m, bits, bias, y, in, out);
  }
  quant_rows_free(q);
}

/* the largest of 16 floats (exact in any order: every build gives the same) */
static inline float max16(const float *x) {
#if QBLOCKS_SIMD == 2
  return _mm512_reduce_max_ps(_mm512_loadu_ps(x));
#elif QBLOCKS_SIMD == 1
  __m256 v = _mm256_max_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
#else
  float top = x[0];
  for (int c = 1; c < TILE; c++) top = x[c] > top ? x[c] : top;
  return top;
#endif
}

/* One pass, then each row's outputs that may hold its two-pass maximum again with two passes (an LM head: a
   greedy token is the two-pass product's, at about the price of one pass). Two passes differ from one by pass 2's
   products alone: per block, its step (pass 1's / 256) times sum_i w[c, i] q2[i] with |q2| <= 128, so
   |y2[r, c] - y1[r, c]| <= E[r, c] = sum_b xs1[r, b] / 2 * w_bound[c, b], w_bound[c, b] >= channel c's sum of
   |w| over block b (w_bound_max[b] >= every channel's). The two-pass maximum is at least L = max_c (y1 - E), and a
   channel with y1 + E < L cannot reach it; every tile of 16 channels holding one that can is multiplied again
   with two passes, its 16 outputs replaced. E is first taken at its largest over channels (every channel below
   the row's maximum - 2 of that is out), then per channel for the rest. Each E is widened by (blocks + 4) 2^-10
   of itself and 2^-20 of the row's |max| + 2 E for the float roundings of either product; the tests are in double (products of
   floats exact: the same in every build). */
void linear_blocks_top_f32(const float *x, const float *row_scale, const uint8_t *w, const uint16_t *d,
                           const uint16_t *m, int bits, const uint16_t *w_bound, const float *w_bound_max,
                           const float *bias, float *y, int64_t rows, int64_t in, int64_t out, int num_threads) {
  const int64_t blocks = in / QBLOCK, tiles = out / TILE, tile_bytes = TILE * in * bits / 8;
  const double widen = 1.0 + (double)(blocks + 4) / 1024;
  const QuantRows q = quant_rows_new(rows, in, 1), q2 = quant_rows_new(rows, in, 2);
  uint8_t *again = calloc(rows * tiles, 1);  /* [rows][tiles]: the tile goes again with two passes */
#pragma omp parallel num_threads(num_threads)
  {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
      quantize_row_at(&q, x, row_scale, r, in, 1);
      quantize_row_at(&q2, x, row_scale, r, in, 2);
    }
    blocks_product(&q, rows, 1, w, d, m, bits, bias, y, in, out);
    int64_t *near = malloc(sizeof(int64_t) * out);
    double *reach = malloc(sizeof(double) * out);
    float *tile_top = malloc(sizeof(float) * tiles);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
      const float *y_row = y + r * out, *half_step = q.xs + r * blocks;
      float top = -INFINITY;
      for (int64_t t = 0; t < tiles; t++) {
        tile_top[t] = max16(y_row + t * TILE);
        top = tile_top[t] > top ? tile_top[t] : top;
      }
      double largest = 0.0;  /* 2 E at its largest */
      for (int64_t b = 0; b < blocks; b++) largest += (double)half_step[b] * (double)w_bound_max[b];
      const double slack = (fabs((double)top) + largest) / 1048576, floor = (double)top - largest * widen - 2 * slack;
      int64_t n = 0;
      double lower = -INFINITY;  /* L */
      for (int64_t c = 0; c < out; c++) {
        if ((double)tile_top[c / TILE] < floor) {
          c += TILE - 1 - c % TILE;  /* the tile's next */
          continue;
        }
        if ((double)y_row[c] < floor) continue;
        double e = 0.0;  /* 2 E[r, c] */
        for (int64_t b = 0; b < blocks; b++) e += (double)half_step[b] * (double)half_to_float(w_bound[c * blocks + b]);
        e = e / 2 * widen + slack;
        const double low = (double)y_row[c] - e;
        lower = low > lower ? low : lower;
        near[n] = c;
        reach[n++] = (double)y_row[c] + e;
      }
      for (int64_t k = 0; k < n; k++)
        if (reach[k] >= lower) again[r * tiles + near[k] / TILE] = 1;
    }
    free(near);
    free(reach);
    free(tile_top);
    /* tile by tile, its rows gathered QTILE_ROWS / 2 at a time: each tile's weights read once */
    const QuantRows chunk = quant_rows_new(QTILE_ROWS / 2, in, 2);
    int8_t *xq = chunk.xq;
    float *xs = chunk.xs, *xms = chunk.xms;
    int32_t *xsum = chunk.xsum;
#pragma omp for schedule(dynamic, 8)
    for (int64_t t = 0; t < tiles; t++) {
      int64_t picked[QTILE_ROWS / 2];
      int n = 0;
      for (int64_t r = 0; r <= rows; r++) {
        if (r < rows && again[r * tiles + t]) {
          memcpy(xq + 2 * n * in, q2.xq + 2 * r * in, 2 * in);
          memcpy(xs + n * blocks, q2.xs + r * blocks, sizeof(float) * blocks);
          memcpy(xms + n * blocks, q2.xms + r * blocks, sizeof(float) * blocks);
          memcpy(xsum + n * blocks, q2.xsum + r * blocks, sizeof(int32_t) * blocks);
          picked[n++] = r;
        }
        if (n == QTILE_ROWS / 2 || (r == rows && n)) {
          float sums[QTILE_ROWS * QTILE_GROUP * TILE];
          blocks_rows(2 * n, 1, bits, 2, xq, xs, xms, xsum, w + t * tile_bytes, tile_bytes, d + t * blocks * TILE,
                      m ? m + t * blocks * TILE : NULL, in, sums);
          for (int k = 0; k < n; k++)
            for (int c = 0; c < TILE; c++) {
              const float sum = sums[k * QTILE_GROUP * TILE + c];
              y[picked[k] * out + t * TILE + c] = bias ? sum + bias[t * TILE + c] : sum;
            }
          n = 0;
        }
      }
    }
    quant_rows_free(chunk);
  }
  free(again);
  quant_rows_free(q);
  quant_rows_free(q2);
}

/* out [n, in] = rows ids[k] of a block weight (the tiles above) as float32: d * q, then + m (two roundings, as
   cpu_ops.dequantize_rows' torch ops: no fused multiply-add), 16 rows (out features) a tile. A token embedding's
   lookup from its tied LM head's blocks. Returns how many ids lie outside [0, out) (their rows are left as they
   were). */
__attribute__((optimize("fp-contract=off")))
int64_t dequantize_rows_blocks(const uint8_t *w, const uint16_t *d, const uint16_t *m, int bits, const int64_t *ids,
                               int64_t n, int64_t in, int64_t out, float *rows) {
  const int64_t blocks = in / QBLOCK, tile_bytes = TILE * in * bits / 8;
  int64_t bad = 0;
  for (int64_t k = 0; k < n; k++) {
    const int64_t id = ids[k];
    if (id < 0 || id >= out) {
      bad++;
      continue;
    }
    const int64_t lane = id % TILE;
    const uint8_t *wt = w + id / TILE * tile_bytes;
    const uint16_t *dt = d + id / TILE * blocks * TILE, *mt = m ? m + id / TILE * blocks * TILE : NULL;
    float *row = rows + k * in;
    for (int64_t b = 0; b < blocks; b++) {
      const float scale = half_to_float(dt[b * TILE + lane]), offset = mt ? half_to_float(mt[b * TILE + lane]) : 0.0f;
      for (int64_t i = b * QBLOCK; i < (b + 1) * QBLOCK; i++) {
        float q;
        if (bits == 4) {
          const uint8_t byte = wt[(i / 8) * 64 + lane * 4 + i % 4];
          q = (float)(i % 8 < 4 ? byte & 0x0f : byte >> 4);
          const float product = scale * q;
          row[i] = product + offset;
        } else {
          row[i] = scale * (float)(int8_t)wt[(i / 4) * 64 + lane * 4 + i % 4];
        }
      }
    }
  }
  return bad;
}

/* ---- a whole decoder layer in one call --------------------------------------------------------------------
   The dense decoder layer of a model whose four linears are block weights (linear_blocks_f32) in one call from
   Python instead of seven: a decode step of one request calls ~200 ops, and each call from Python costs
   microseconds the products at one row cannot hide. The steps are the ops above, in the general layer's order. */
typedef struct {
  const uint8_t *w;
  const uint16_t *d, *m;
  const float *bias;
  int32_t bits, passes;
  int64_t in, out;
} BlockLinearArgs;

typedef struct {
  const float *input_norm, *post_norm, *q_norm, *k_norm; /* q_norm, k_norm: NULL without per-head norms */
  float norm_eps, head_norm_eps, scale;
  int32_t kv_kind;
  BlockLinearArgs qkv, o, gate_up, down;
  void *k_cache, *v_cache;
  int64_t num_heads, num_kv_heads, head_dim, block_size;
} DecoderLayerArgs;

/* what every layer of a step shares: rope_store_attention_f32's arguments of the step */
typedef struct {
  const int64_t *positions, *slot_mapping;
  const float *cos, *sin;
  const int32_t *block_tables, *row_seq, *attend_lens;
  int64_t table_stride, rows;
  int32_t num_threads;
} DecoderStepArgs;

static void block_linear(const BlockLinearArgs *l, const float *x, float *y, int64_t rows, int num_threads) {
  linear_blocks_f32(x, NULL, l->w, l->d, l->m, l->bits, l->passes, l->bias, y, rows, l->in, l->out, num_threads);
}

/* x [rows, hidden_size]: the layer's input; out (may be x): its MLP's output; residual [rows, hidden_size]: the
   residual stream, updated in place (with has_residual 0, the first layer's: it becomes x). */
void decoder_layer_blocks_f32(const DecoderLayerArgs *l, const DecoderStepArgs *s, const float *x, float *residual,
                              float *out, int has_residual) {
  const int64_t rows = s->rows, dim = l->o.out, nt = s->num_threads;
  const int64_t qkv_width = l->qkv.out, attn_width = l->o.in, inter = l->down.in;
  float *scratch = malloc(sizeof(float) * rows * (dim + qkv_width + attn_width + dim + 2 * inter + inter));
  float *normed = scratch, *qkv = normed + rows * dim, *attn = qkv + rows * qkv_width;
  float *o = attn + rows * attn_width, *gate_up = o + rows * dim, *act = gate_up + rows * 2 * inter;
  if (has_residual) {
    add_rms_norm_f32(x, NULL, residual, residual, l->input_norm, normed, NULL, rows, dim, l->norm_eps, nt);
  } else {
    memcpy(residual, x, sizeof(float) * rows * dim);
    add_rms_norm_f32(x, NULL, NULL, NULL, l->input_norm, normed, NULL, rows, dim, l->norm_eps, nt);
  }
  block_linear(&l->qkv, normed, qkv, rows, nt);
  rope_store_attention_f32(qkv, qkv_width, s->positions, s->cos, s->sin, l->q_norm, l->k_norm, l->head_norm_eps,
                           l->k_cache, l->v_cache, l->kv_kind, s->block_tables, s->table_stride, s->row_seq,
                           s->attend_lens, s->slot_mapping, attn, rows, l->num_heads, l->num_kv_heads, l->head_dim,
                           l->block_size, l->scale, nt);
  block_linear(&l->o, attn, o, rows, nt);
  add_rms_norm_f32(o, NULL, residual, residual, l->post_norm, normed, NULL, rows, dim, l->norm_eps, nt);
  block_linear(&l->gate_up, normed, gate_up, rows, nt);
  silu_and_mul_f32(gate_up, NULL, act, NULL, rows, inter, nt);
  block_linear(&l->down, act, out, rows, nt);
  free(scratch);
}
