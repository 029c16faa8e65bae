// Three ways to multiply INT4 codes (Int4Linear's layout, group 128) by one row of x on AVX2, one
// thread, timed on the same codes: (a) x rounded to int16 per 128-element chunk and vpmaddwd, what
// gemv.cpp runs; (b) codes widened to fp32 and FMA'd with fp32 x, exact; (c) x rounded to int8
// and vpmaddubsw, as llama.cpp's Q4_0 x Q8_0 dot product does. Prints each one's time and its
// largest difference from (b). Not part of the library:
//   g++ -O3 -mavx2 -mfma kernels/cpu/bench_int4_avx2.cpp -o /tmp/bench_int4 && /tmp/bench_int4 3072 640
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <vector>
#include <cmath>
static float hsum(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s)); s = _mm_add_ss(s, _mm_movehdup_ps(s)); return _mm_cvtss_f32(s);
}
// (a) int16 x, word layout (x'[32t + j] = x[4j + t]), 128 codes per chunk
void rows_madd(const uint8_t* w, const int16_t* xq, const float* xs, const float* sc, const float* mn,
               const float* S, float* y, int N, int K) {
  const int C = K / 128; const __m256i low4 = _mm256_set1_epi16(0x0F);
  for (int n = 0; n < N; n++) {
    const uint8_t* wn = w + (size_t)n * K / 2; __m256 acc = _mm256_setzero_ps(); float cst = 0;
    for (int c = 0; c < C; c++) {
      __m256i s;
      for (int h = 0; h < 2; h++) {
        const __m256i b = _mm256_loadu_si256((const __m256i*)(wn + c * 64 + 32 * h));
        const __m256i v0 = _mm256_and_si256(b, low4), v1 = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4),
                      v2 = _mm256_and_si256(_mm256_srli_epi16(b, 8), low4), v3 = _mm256_srli_epi16(b, 12);
        const int16_t* xm = xq + c * 128 + 16 * h;
        __m256i p = _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(v0, _mm256_loadu_si256((const __m256i*)xm)),
                                                      _mm256_madd_epi16(v1, _mm256_loadu_si256((const __m256i*)(xm + 32)))),
                                     _mm256_add_epi32(_mm256_madd_epi16(v2, _mm256_loadu_si256((const __m256i*)(xm + 64))),
                                                      _mm256_madd_epi16(v3, _mm256_loadu_si256((const __m256i*)(xm + 96)))));
        s = h ? _mm256_add_epi32(s, p) : p;
      }
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(sc[n * C + c] * xs[c]), acc);
      cst += mn[n * C + c] * S[c];
    }
    y[n] = hsum(acc) + cst;
  }
}
// (b) fp32 x, dword layout (x'[8t + i] = x[8i + t] per 64 codes), codes widened to fp32
void rows_float(const uint8_t* w, const float* xr, const float* sc, const float* mn, const float* S,
                float* y, int N, int K) {
  const int C = K / 128; const __m256i low4 = _mm256_set1_epi32(0x0F);
  for (int n = 0; n < N; n++) {
    const uint8_t* wn = w + (size_t)n * K / 2; __m256 acc = _mm256_setzero_ps(); float cst = 0;
    for (int c = 0; c < C; c++) {
      __m256 d0 = _mm256_setzero_ps(), d1 = _mm256_setzero_ps();
      for (int h = 0; h < 2; h++) {
        const __m256i b = _mm256_loadu_si256((const __m256i*)(wn + c * 64 + 32 * h));
        const float* xm = xr + c * 128 + 64 * h;
#define T(t, d) d = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(b, 4 * t), low4)), _mm256_loadu_ps(xm + 8 * t), d);
        d0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, low4)), _mm256_loadu_ps(xm), d0);
        T(1, d1) T(2, d0) T(3, d1) T(4, d0) T(5, d1) T(6, d0)
        d1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 28)), _mm256_loadu_ps(xm + 56), d1);
      }
      acc = _mm256_fmadd_ps(_mm256_add_ps(d0, d1), _mm256_set1_ps(sc[n * C + c]), acc);
      cst += mn[n * C + c] * S[c];
    }
    y[n] = hsum(acc) + cst;
  }
}
// (c) int8 x (llama.cpp's Q8 activations), vpmaddubsw: x'[64h + 32p + i] = x[64h + 2i + p]
void rows_i8(const uint8_t* w, const int8_t* x8, const float* xs, const float* sc, const float* mn,
             const float* S, float* y, int N, int K) {
  const int C = K / 128; const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int n = 0; n < N; n++) {
    const uint8_t* wn = w + (size_t)n * K / 2; __m256 acc = _mm256_setzero_ps(); float cst = 0;
    for (int c = 0; c < C; c++) {
      __m256i s16 = _mm256_setzero_si256();
      for (int h = 0; h < 2; h++) {
        const __m256i b = _mm256_loadu_si256((const __m256i*)(wn + c * 64 + 32 * h));
        const __m256i A = _mm256_and_si256(b, low4), B = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
        const int8_t* xm = x8 + c * 128 + 64 * h;
        s16 = _mm256_add_epi16(s16, _mm256_add_epi16(_mm256_maddubs_epi16(A, _mm256_loadu_si256((const __m256i*)xm)),
                                                     _mm256_maddubs_epi16(B, _mm256_loadu_si256((const __m256i*)(xm + 32)))));
      }
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones)), _mm256_set1_ps(sc[n * C + c] * xs[c]), acc);
      cst += mn[n * C + c] * S[c];
    }
    y[n] = hsum(acc) + cst;
  }
}
int main(int argc, char** argv) {
  const int N = argc > 1 ? atoi(argv[1]) : 3072, K = argc > 2 ? atoi(argv[2]) : 640, C = K / 128, reps = 300;
  std::vector<uint8_t> w((size_t)N * K / 2); for (auto& b : w) b = rand();
  std::vector<float> x(K), xr(K), xs(C), S(C), sc(N * C), mn(N * C), ya(N), yb(N);
  std::vector<int16_t> xq(K);
  for (auto& v : x) v = rand() / (float)RAND_MAX - 0.5f;
  for (int i = 0; i < N * C; i++) { sc[i] = 0.01f; mn[i] = -0.08f; }
  for (int c = 0; c < C; c++) {
    float amax = 0, s = 0; for (int k = 0; k < 128; k++) { amax = fmaxf(amax, fabsf(x[c*128+k])); s += x[c*128+k]; }
    xs[c] = amax / 32767; S[c] = s;
    for (int j = 0; j < 32; j++) for (int t = 0; t < 4; t++) xq[c*128 + 32*t + j] = (int16_t)lrintf(x[c*128 + 4*j + t] / xs[c]);
    for (int h = 0; h < 2; h++) for (int i = 0; i < 8; i++) for (int t = 0; t < 8; t++) xr[c*128 + 64*h + 8*t + i] = x[c*128 + 64*h + 8*i + t];
  }
  std::vector<int8_t> x8(K); std::vector<float> xs8(C), yc(N);
  for (int c = 0; c < C; c++) {
    float amax = 0; for (int k = 0; k < 128; k++) amax = fmaxf(amax, fabsf(x[c*128+k]));
    xs8[c] = amax / 127;
    for (int h = 0; h < 2; h++) for (int i = 0; i < 32; i++) for (int p = 0; p < 2; p++)
      x8[c*128 + 64*h + 32*p + i] = (int8_t)lrintf(x[c*128 + 64*h + 2*i + p] / xs8[c]);
  }
  double ta = 1e9, tb = 1e9, tc = 1e9;
  for (int round = 0; round < 10; round++) {
    auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < reps; r++) rows_madd(w.data(), xq.data(), xs.data(), sc.data(), mn.data(), S.data(), ya.data(), N, K);
    auto t1 = std::chrono::steady_clock::now();
    for (int r = 0; r < reps; r++) rows_float(w.data(), xr.data(), sc.data(), mn.data(), S.data(), yb.data(), N, K);
    auto t2 = std::chrono::steady_clock::now();
    for (int r = 0; r < reps; r++) rows_i8(w.data(), x8.data(), xs8.data(), sc.data(), mn.data(), S.data(), yc.data(), N, K);
    auto t3 = std::chrono::steady_clock::now();
    tc = std::min(tc, std::chrono::duration<double, std::micro>(t3 - t2).count() / reps);
    ta = std::min(ta, std::chrono::duration<double, std::micro>(t1 - t0).count() / reps);
    tb = std::min(tb, std::chrono::duration<double, std::micro>(t2 - t1).count() / reps);
  }
  double err = 0, err8 = 0, mag = 0; for (int n = 0; n < N; n++) { err = fmax(err, fabs(ya[n] - yb[n])); err8 = fmax(err8, fabs(yc[n] - yb[n])); mag = fmax(mag, fabs(yb[n])); }
  printf("N=%d K=%d  vpmaddwd int16 x: %.1f us   fp32 widen: %.1f us   ratio %.2f   max|diff| %.2g\n", N, K, ta, tb, tb / ta, err);
  printf("int8 x (maddubs): %.1f us (fp32 widen / int8 %.2f, int16 / int8 %.2f), max|diff| %.2g, max|y| %.2g\n", tc, tb / tc, ta / tc, err8, mag);
}
