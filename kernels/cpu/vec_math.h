// Vector math shared by paged_attention.cpp and decode_step.cpp, for every build of kernels/cpu.
//
// fp32 arithmetic goes through ATen's Vectorized<float> (16 lanes under AVX-512, 8 under AVX2, the
// NEON or plain-array form elsewhere). What Vectorized does not give, or gives more slowly, is
// here as one small function per ISA, chosen by the WB_ISA_* macros of kernels/cpu/__init__.py:
// bf16 <-> fp32 (round to nearest even, as torch), 2^n, horizontal sums, the transpose-and-add of
// kLanes vectors, and the bf16 dot product (AVX512-BF16's dpbf16, else widen by a shift and FMA).
#pragma once
#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/functional.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(WB_ISA_AVX512) || defined(WB_ISA_AVX2)
#include <immintrin.h>
#endif

namespace wb {

using bf16 = c10::BFloat16;
using Vec = at::vec::Vectorized<float>;
constexpr int kLanes = Vec::size();

inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }   // prefetcht1 on x86

// ---- bf16 <-> fp32 ------------------------------------------------------------------------------
// bf16 is the top half of an fp32: widening is a 16-bit shift; narrowing rounds to nearest even
// (torch's round_to_nearest_even, NaN to 0x7FC0).

inline Vec load(const float* p) { return Vec::loadu(p); }
inline Vec load(const float* p, int n) { return Vec::loadu(p, n); }
inline void store(float* p, Vec v) { v.store(p); }
inline void store(float* p, Vec v, int n) { v.store(p, n); }

#if defined(WB_ISA_AVX512)
inline Vec load(const bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline Vec load(const bf16* p, int n) {
  const __m256i h = _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#if defined(WB_ISA_AVX512BF16)
inline __m256i to_bf16_bits(Vec v) { return (__m256i)_mm512_cvtneps_pbh(v); }
#else
inline __m256i to_bf16_bits(Vec v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16),
                                                         _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7FFF));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}
#endif
inline void store(bf16* p, Vec v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16_bits(v));
}
inline void store(bf16* p, Vec v, int n) {
  _mm256_mask_storeu_epi16(p, static_cast<__mmask16>((1u << n) - 1), to_bf16_bits(v));
}
inline Vec round_bf16(Vec v) {   // to bf16 and back
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16_bits(v)), 16));
}

#elif defined(WB_ISA_AVX2)
inline Vec load(const bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline Vec load(const bf16* p, int n) {
  bf16 tmp[kLanes] = {};
  std::memcpy(tmp, p, n * sizeof(bf16));
  return load(tmp);
}
// The rounded value as fp32 bits (low 16 bits zero).
inline __m256i rounded_bits(Vec v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16),
                                                         _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7FFF));
  const __m256i r = _mm256_and_si256(_mm256_add_epi32(u, bias), _mm256_set1_epi32(0xFFFF0000u));
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r),
                                              _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)),
                                              nan));
}
inline Vec round_bf16(Vec v) { return _mm256_castsi256_ps(rounded_bits(v)); }
inline void store(bf16* p, Vec v) {   // pack the 8 high halves, then gather the two 64-bit halves
  const __m256i hi = _mm256_srli_epi32(rounded_bits(v), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(hi, hi), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline void store(bf16* p, Vec v, int n) {
  bf16 tmp[kLanes];
  store(tmp, v);
  std::memcpy(p, tmp, n * sizeof(bf16));
}

#else   // any CPU: c10's conversions, one value at a time
inline Vec load(const bf16* p, int n) {
  float tmp[kLanes] = {};
  for (int i = 0; i < n; ++i) tmp[i] = static_cast<float>(p[i]);
  return Vec::loadu(tmp);
}
inline Vec load(const bf16* p) { return load(p, kLanes); }
inline void store(bf16* p, Vec v, int n) {
  float tmp[kLanes];
  v.store(tmp);
  for (int i = 0; i < n; ++i) p[i] = static_cast<bf16>(tmp[i]);
}
inline void store(bf16* p, Vec v) { store(p, v, kLanes); }
inline Vec round_bf16(Vec v) {
  float tmp[kLanes];
  v.store(tmp);
  for (int i = 0; i < kLanes; ++i) tmp[i] = static_cast<float>(static_cast<bf16>(tmp[i]));
  return Vec::loadu(tmp);
}
#endif

// Lane-wise max without Vectorized's NaN propagation (scores are finite): one instruction on x86.
#if defined(WB_ISA_AVX512)
inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
#elif defined(WB_ISA_AVX2)
inline Vec vmax(Vec a, Vec b) { return _mm256_max_ps(a, b); }
#else
inline Vec vmax(Vec a, Vec b) { return at::vec::maximum(a, b); }
#endif

// ---- reductions -------------------------------------------------------------------------------

#if defined(WB_ISA_AVX512)
inline float reduce_add(Vec v) { return _mm512_reduce_add_ps(v); }
inline float reduce_max(Vec v) { return _mm512_reduce_max_ps(v); }
#elif defined(WB_ISA_AVX2)
inline float reduce_add(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float reduce_max(Vec v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
#else
inline float reduce_add(Vec v) {
  return at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return a + b; }, v);
}
inline float reduce_max(Vec v) {
  return at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return at::vec::maximum(a, b); }, v);
}
#endif

// Lane j of the result = the sum of the lanes of v[j] (kLanes vectors): one transpose-and-add
// instead of kLanes horizontal sums.
#if defined(WB_ISA_AVX512)
inline Vec transpose_sum(const Vec* v) {
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)          // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)          // per 128-bit lane: one partial sum of v[4i .. 4i+3]
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)          // add the 128-bit lanes pairwise
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#elif defined(WB_ISA_AVX2)
inline Vec transpose_sum(const Vec* v) {
  __m256 t[4], u[2];
  for (int i = 0; i < 4; ++i) t[i] = _mm256_hadd_ps(v[2 * i], v[2 * i + 1]);
  for (int i = 0; i < 2; ++i) u[i] = _mm256_hadd_ps(t[2 * i], t[2 * i + 1]);
  // u[i], per 128-bit lane: the low (high) half's sums of v[4i .. 4i+3]
  return _mm256_add_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20),
                       _mm256_permute2f128_ps(u[0], u[1], 0x31));
}
#else
inline Vec transpose_sum(const Vec* v) {
  float out[kLanes];
  for (int j = 0; j < kLanes; ++j) out[j] = reduce_add(v[j]);
  return Vec::loadu(out);
}
#endif

// ---- e^x ----------------------------------------------------------------------------------------

// v * 2^n for whole-number n in [-126, 0].
#if defined(WB_ISA_AVX512)
inline Vec times_pow2(Vec v, Vec n) { return _mm512_scalef_ps(v, n); }
#elif defined(WB_ISA_AVX2)
inline Vec times_pow2(Vec v, Vec n) {
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                       _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(v, _mm256_castsi256_ps(e));
}
#else
inline Vec times_pow2(Vec v, Vec n) {
  float a[kLanes], b[kLanes];
  v.store(a);
  n.store(b);
  for (int i = 0; i < kLanes; ++i) a[i] = std::ldexp(a[i], static_cast<int>(b[i]));
  return Vec::loadu(a);
}
#endif

// e^x for x <= 0 (softmax scores minus their max; -|x| in silu): x = n ln2 + r with |r| <= ln2 / 2,
// e^r by its degree-7 Taylor polynomial (relative error < 1e-7 on that interval), times 2^n.
inline Vec exp_nonpositive(Vec x) {
  x = vmax(x, Vec(-87.0f));
  const Vec n = (x * Vec(1.44269504088896341f)).round();
  Vec r = at::vec::fnmadd(n, Vec(0.693145751953125f), x);          // ln2, high bits
  r = at::vec::fnmadd(n, Vec(1.42860682030941723212e-6f), r);      // ln2, the rest
  Vec p(1.0f / 5040);
  p = at::vec::fmadd(p, r, Vec(1.0f / 720));
  p = at::vec::fmadd(p, r, Vec(1.0f / 120));
  p = at::vec::fmadd(p, r, Vec(1.0f / 24));
  p = at::vec::fmadd(p, r, Vec(1.0f / 6));
  p = at::vec::fmadd(p, r, Vec(0.5f));
  p = at::vec::fmadd(p, r, Vec(1.0f));
  p = at::vec::fmadd(p, r, Vec(1.0f));
  return times_pow2(p, n);
}

// ---- q.k over bf16 rows -------------------------------------------------------------------------
// kPair = 2 * kLanes bf16 values per step. A query chunk is prepared once (QPair) and dotted with
// many key chunks: acc lane i += q[2i] k[2i] + q[2i+1] k[2i+1], products exact in fp32.

constexpr int kPair = 2 * kLanes;

#if defined(WB_ISA_AVX512BF16)
struct QPair { __m512bh v; };
inline QPair load_qpair(const bf16* q) { return {(__m512bh)_mm512_loadu_si512(q)}; }
inline Vec dot_pair(Vec acc, const QPair& q, const bf16* k) {
  return _mm512_dpbf16_ps(acc, q.v, (__m512bh)_mm512_loadu_si512(k));
}
#endif

// Even and odd values of kPair bf16 as two fp32 vectors: a shift and a mask, no shuffle.
#if defined(WB_ISA_AVX512)
inline void widen_pair(const bf16* p, Vec& even, Vec& odd) {
  const __m512i raw = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  odd = _mm512_castsi512_ps(_mm512_and_si512(raw, high));
}
#elif defined(WB_ISA_AVX2)
inline void widen_pair(const bf16* p, Vec& even, Vec& odd) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  odd = _mm256_castsi256_ps(_mm256_and_si256(raw, high));
}
#else
inline void widen_pair(const bf16* p, Vec& even, Vec& odd) {
  float e[kLanes], o[kLanes];
  for (int i = 0; i < kLanes; ++i) {
    e[i] = static_cast<float>(p[2 * i]);
    o[i] = static_cast<float>(p[2 * i + 1]);
  }
  even = Vec::loadu(e);
  odd = Vec::loadu(o);
}
#endif

#if !defined(WB_ISA_AVX512BF16)
struct QPair { Vec even, odd; };
inline QPair load_qpair(const bf16* q) {
  QPair r;
  widen_pair(q, r.even, r.odd);
  return r;
}
inline Vec dot_pair(Vec acc, const QPair& q, const bf16* k) {
  Vec even, odd;
  widen_pair(k, even, odd);
  return at::vec::fmadd(q.odd, odd, at::vec::fmadd(q.even, even, acc));
}
#endif

}  // namespace wb
