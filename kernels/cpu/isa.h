// Per-ISA vector helpers shared by the sources of kernels/cpu.
//
// Each build defines one of WB_ISA_AVX512 (with WB_ISA_AVX512BF16 on CPUs that have it),
// WB_ISA_AVX2 or WB_ISA_DEFAULT, and PyTorch's CPU_CAPABILITY_* to match, so wb::Vec
// (at::vec::Vectorized<float>) is 16 fp32 lanes, 8 lanes, or ATen's portable vector (NEON on
// aarch64, a plain array elsewhere). The arithmetic of the kernels is written on wb::Vec; only
// the loads that widen narrow formats to fp32 and the horizontal sum are written per ISA here.
#pragma once
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <cstdint>

#if defined(WB_ISA_AVX512) || defined(WB_ISA_AVX2)
#include <immintrin.h>
#endif

namespace wb {

using Vec = at::vec::Vectorized<float>;
constexpr int kLanes = Vec::size();

#if defined(WB_ISA_AVX512)

// kLanes bf16 at p as fp32: a bf16 is the high half of the fp32 with the same value.
inline Vec load_bf16(const c10::BFloat16* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return Vec(_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
}

inline Vec load_int8(const int8_t* p) {
  return Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
}

inline float hsum(Vec v) { return _mm512_reduce_add_ps(v); }

#elif defined(WB_ISA_AVX2)

inline Vec load_bf16(const c10::BFloat16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return Vec(_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
}

inline Vec load_int8(const int8_t* p) {
  return Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
}

inline float hsum(Vec v) {
  const __m256 x = v;
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

#else  // WB_ISA_DEFAULT: any CPU; the compiler vectorizes these small loops where it can.

template <class T>
inline Vec load_widened(const T* p) {
  float t[kLanes];
  for (int i = 0; i < kLanes; i++) t[i] = static_cast<float>(p[i]);
  return Vec::loadu(t);
}

inline Vec load_bf16(const c10::BFloat16* p) { return load_widened(p); }
inline Vec load_int8(const int8_t* p) { return load_widened(p); }

inline float hsum(Vec v) {
  float t[kLanes];
  v.store(t);
  float s = 0.f;
  for (int i = 0; i < kLanes; i++) s += t[i];
  return s;
}

#endif

inline Vec load_fp32(const float* p) { return Vec::loadu(p); }

}  // namespace wb
