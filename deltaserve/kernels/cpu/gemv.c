/* y[m, n] = sum_k x[m, k] * w[n, k] for m < M <= 4: float32, the weight output-major [N, K] and read once for all M
 * rows, each output row a dot product over k in vector strips (AVX-512, or AVX2 with FMA; built by
 * deltaserve.kernels.cpu_gemv with -march=native). OpenMP splits the output rows over `threads`; one call serves
 * several weights (a token's experts). */
#include <immintrin.h>
#include <omp.h>

#if defined(__AVX512F__)
#define W 16
typedef __m512 vec;
#define ZERO() _mm512_setzero_ps()
#define LOAD(p) _mm512_loadu_ps(p)
#define FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define ADD(a, b) _mm512_add_ps(a, b)
static inline float hsum(vec v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
#define W 8
typedef __m256 vec;
#define ZERO() _mm256_setzero_ps()
#define LOAD(p) _mm256_loadu_ps(p)
#define FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define ADD(a, b) _mm256_add_ps(a, b)
static inline float hsum(vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#else
#error "cpu_gemv needs AVX-512 or AVX2 with FMA"
#endif

/* Every row of x takes the same sums in the same order (four independent accumulators, which hide the FMA latency,
 * then (a0 + a1) + (a2 + a3) and the tail), so a row's result does not depend on the rows beside it. M is a
 * constant in each call below, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void rows_of(const float *x, const float *w, float *y, const long M,
                                                         long K, long N, long n0, long n1) {
  long Kv = K - K % (4 * W);
  for (long n = n0; n < n1; n++) {
    const float *r = w + n * K;
    vec a[4][4];
    for (long m = 0; m < M; m++) a[m][0] = a[m][1] = a[m][2] = a[m][3] = ZERO();
    for (long k = 0; k < Kv; k += 4 * W) {
      for (long j = 0; j < 4; j++) {
        vec strip = LOAD(r + k + j * W);
        for (long m = 0; m < M; m++) a[m][j] = FMA(strip, LOAD(x + m * K + k + j * W), a[m][j]);
      }
    }
    for (long m = 0; m < M; m++) {
      float s = hsum(ADD(ADD(a[m][0], a[m][1]), ADD(a[m][2], a[m][3])));
      for (long k = Kv; k < K; k++) s += r[k] * x[m * K + k];
      y[m * N + n] = s;
    }
  }
}

static void rows(const float *x, const float *w, float *y, long M, long K, long N, long n0, long n1) {
  switch (M) {
    case 1: rows_of(x, w, y, 1, K, N, n0, n1); break;
    case 2: rows_of(x, w, y, 2, K, N, n0, n1); break;
    case 3: rows_of(x, w, y, 3, K, N, n0, n1); break;
    default: rows_of(x, w, y, 4, K, N, n0, n1); break;
  }
}

/* output rows [i0, i1) of the G * N rows of gemv_f32 */
static void span(const float *x, long x_stride, const float *const *w, float *y, long G, long M, long K, long N,
                 long i0, long i1) {
  for (long g = i0 / N; g < G && g * N < i1; g++) {
    long n0 = i0 > g * N ? i0 - g * N : 0, n1 = i1 - g * N < N ? i1 - g * N : N;
    rows(x + g * x_stride, w[g], y + g * M * N, M, K, N, n0, n1);
  }
}

/* G products y[g] = x_g w[g]^T (x_g = x + g * x_stride; a stride of 0 gives every weight the same x), y [G, M, N]:
 * the G * N output rows split evenly over the threads, so one parallel region serves all G weights */
int gemv_f32(const float *x, long x_stride, const float *const *w, float *y, long G, long M, long K, long N,
             int threads) {
  if (M < 1 || M > 4 || G < 1 || K < 0 || N < 0) return 1;
  long total = G * N;
  if (total == 0) return 0;
  if (threads <= 1) {
    span(x, x_stride, w, y, G, M, K, N, 0, total);
    return 0;
  }
#pragma omp parallel num_threads(threads)
  {
    long t = omp_get_thread_num(), T = omp_get_num_threads();
    long per = (total + T - 1) / T, i0 = t * per, i1 = i0 + per < total ? i0 + per : total;
    if (i0 < i1) span(x, x_stride, w, y, G, M, K, N, i0, i1);
  }
  return 0;
}
