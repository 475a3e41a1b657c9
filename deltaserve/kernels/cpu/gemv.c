/* y[m, n] = sum_k x[m, k] * w[n, k] for m < M <= 4: float32, the weight output-major [N, K] and read once for all M
 * rows, each output row a dot product over k in vector strips (AVX-512, or AVX2 with FMA; built by
 * deltaserve.kernels.cpu_gemv with -march=native). OpenMP splits the output rows over `threads`. */
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

int gemv_f32(const float *x, const float *w, float *y, long M, long K, long N, int threads) {
  if (M < 1 || M > 4) return 1;
  if (threads <= 1) {
    rows(x, w, y, M, K, N, 0, N);
    return 0;
  }
#pragma omp parallel num_threads(threads)
  {
    long t = omp_get_thread_num(), T = omp_get_num_threads();
    long per = (N + T - 1) / T, n0 = t * per, n1 = n0 + per < N ? n0 + per : N;
    if (n0 < n1) rows(x, w, y, M, K, N, n0, n1);
  }
  return 0;
}
