// Small-batch matrix-vector products for x86 CPUs with AVX-512 BF16: the decode path at batch 1,
// for bf16 weights (linear_bf16), INT8 weight-only ones (linear_int8) and group-wise INT4 ones
// (linear_int4).
//
// Why hand-written: at batch 1 a decode step multiplies one activation row by every weight
// matrix, so its speed is the speed at which the weights stream from memory. PyTorch's bf16
// `F.linear` for one row goes through a GEMM path built for big batches and streams bf16 weights
// at about half the rate its own fp32 GEMV reaches on the same machine (see the README's speed
// ladder). This loop does what llama.cpp's CPU dot products do: one pass over each weight row,
// multiply-added into fp32 accumulators, rows split across threads.
//
// y[m, n] = sum_k x[m, k] * W[n, k] for m < M, x and W bf16. vdpbf16ps multiplies 32 bf16 pairs
// and adds them into 16 fp32 lanes. The sum is rounded to bf16 once, as torch's kernels do; only
// the order of the fp32 additions differs (tests bound the difference). Larger M goes to torch's
// at::linear. The crossover was measured over SmolLM2's 120 projections with the first version of
// the loop (ms per pass, loop vs torch): M=1 12.3 vs 17.7, M=2 15.5 vs 17.5, M=3 17.9 vs 17.7,
// M=8 36.3 vs 24.0. Every extra row repeats the multiply-adds while the bytes stay the same, and
// torch's GEMM blocks the rows better, so this loop only pays at 1 and 2 rows.
//
// Earlier versions (2-core Intel Xeon VM with AVX-512 BF16 and AMX):
// - INT4, first version: a row-major loop with a horizontal sum per group and the codes widened to
//   floats ran 1.9x slower than aten's _weight_int4pack_mm_for_cpu. The kept loop (int4_rows)
//   makes bf16 operands from the codes with two integer ops and sums once per row: 1.4x aten's.
// - INT8 weight-only, first version: widening int8 to fp32 (vpmovsxbd, vcvtdq2ps, vfmadd) ran at
//   ~10.5 GB/s there, the same as aten's _weight_int8pack_mm. Rewritten like the bf16 loop below
//   (one row at a time, four accumulators, x widened to fp32 once per call) on the AMD EPYC VM it
//   reads 26 GB/s, the bandwidth roof, against 17 GB/s for aten's on SmolLM2's LM head, so it is
//   kept (linear_int8).
#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <vector>

#include "ops.h"


namespace {

constexpr int64_t kMaxRows = 2;        // M up to this runs the loop below (measured crossover)
constexpr int kChains = 3;             // independent accumulators along k per x row
constexpr int64_t kGrain = 32;         // weight rows per thread task, at least

using bf16 = c10::BFloat16;

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// ---------------------------------------------------------------------------------------- bf16
TARGET inline __m512 dot_bf16(__m512 acc, const bf16* a, const bf16* b, __mmask32 mask) {
  __m512i va = _mm512_maskz_loadu_epi16(mask, a), vb = _mm512_maskz_loadu_epi16(mask, b);
  return _mm512_dpbf16_ps(acc, (__m512bh)va, (__m512bh)vb);
}

// Rows n0..n1 of W, one row at a time: each thread reads its share of W as one sequential stream,
// the pattern hardware prefetchers follow best. (The first version interleaved 4 rows to reuse
// each load of x: 19-21 GB/s over SmolLM2's 121 projections on a 2-core AMD EPYC VM, against 24-26
// for this loop, which is as fast as a loop that only ORs the same bytes together. x is a few KB
// and stays in L1, so loading it again per row is free.) kChains accumulators per x row hide the
// latency of the multiply-add chain.
template <int M>
TARGET void bf16_rows(const bf16* x, const bf16* w, bf16* y, int64_t N, int64_t K,
                      int64_t n0, int64_t n1) {
  constexpr int64_t kStep = 32 * kChains;
  const int64_t body = K - K % kStep, tail = K % 32, mid = K - tail;
  const __mmask32 full = 0xFFFFFFFFu, last = tail ? (__mmask32)((1u << tail) - 1) : 0;
  for (int64_t n = n0; n < n1; n++) {
    const bf16* wn = w + n * K;
    __m512 acc[M][kChains];
    for (int m = 0; m < M; m++)
      for (int c = 0; c < kChains; c++) acc[m][c] = _mm512_setzero_ps();
    for (int64_t k = 0; k < body; k += kStep)
      for (int c = 0; c < kChains; c++) {
        __m512i vw = _mm512_loadu_si512(wn + k + 32 * c);
        for (int m = 0; m < M; m++)
          acc[m][c] = _mm512_dpbf16_ps(acc[m][c], (__m512bh)_mm512_loadu_si512(x + m * K + k + 32 * c),
                                       (__m512bh)vw);
      }
    for (int64_t k = body; k < mid; k += 32)          // whole 32-element pieces left over
      for (int m = 0; m < M; m++) acc[m][0] = dot_bf16(acc[m][0], x + m * K + k, wn + k, full);
    if (tail)
      for (int m = 0; m < M; m++) acc[m][0] = dot_bf16(acc[m][0], x + m * K + mid, wn + mid, last);
    for (int m = 0; m < M; m++) {
      __m512 sum = acc[m][0];
      for (int c = 1; c < kChains; c++) sum = _mm512_add_ps(sum, acc[m][c]);
      y[m * N + n] = bf16(_mm512_reduce_add_ps(sum));
    }
  }
}

// ---------------------------------------------------------------------------------------- int8
// Weight-only INT8 (one scale per output row), the format of Int8Linear and of the LM head of
// every quantized model. x is widened to fp32 once per call; each weight row is read once, 16
// int8 at a time, sign-extended and converted to fp32 (vpmovsxbd, vcvtdq2ps) and multiply-added.
// The row's sum is scaled and rounded to bf16 once, the formula of aten's _weight_int8pack_mm.
template <int M>
TARGET void int8_rows(const float* xf, const int8_t* w, const bf16* scale, bf16* y, int64_t N,
                      int64_t K, int64_t n0, int64_t n1) {
  constexpr int kLanes = 16, kStep = kLanes * 4;
  const int64_t body = K - K % kStep, mid = K - K % kLanes, tail = K % kLanes;
  const __mmask16 last = (__mmask16)((1u << tail) - 1);
  for (int64_t n = n0; n < n1; n++) {
    const int8_t* wn = w + n * K;
    __m512 acc[M][4];
    for (int m = 0; m < M; m++)
      for (int c = 0; c < 4; c++) acc[m][c] = _mm512_setzero_ps();
    for (int64_t k = 0; k < body; k += kStep)
      for (int c = 0; c < 4; c++) {
        __m512 vw = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128((const __m128i*)(wn + k + kLanes * c))));
        for (int m = 0; m < M; m++)
          acc[m][c] = _mm512_fmadd_ps(vw, _mm512_loadu_ps(xf + m * K + k + kLanes * c), acc[m][c]);
      }
    for (int64_t k = body; k < mid; k += kLanes) {
      __m512 vw = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(wn + k))));
      for (int m = 0; m < M; m++) acc[m][0] = _mm512_fmadd_ps(vw, _mm512_loadu_ps(xf + m * K + k), acc[m][0]);
    }
    if (tail) {
      __m512 vw = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(last, wn + mid)));
      for (int m = 0; m < M; m++)
        acc[m][0] = _mm512_fmadd_ps(vw, _mm512_maskz_loadu_ps(last, xf + m * K + mid), acc[m][0]);
    }
    const float s = float(scale[n]);
    for (int m = 0; m < M; m++) {
      __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), _mm512_add_ps(acc[m][2], acc[m][3]));
      y[m * N + n] = bf16(_mm512_reduce_add_ps(sum) * s);
    }
  }
}

// ---------------------------------------------------------------------------------------- int4
// Group-wise asymmetric INT4 (Int4Linear's format: w = q * scale + minimum per row and group,
// codes 0..15, two per byte, even k in the low nibble). The trick that makes it cheap: a code q
// OR 0x4300 is the bf16 number 128 + q exactly (exponent 2^7, q in the low mantissa bits), so
// one shift and one vpternlog ((w >> s) & 0xF | 0x4300) turn codes into bf16 lanes that
// vdpbf16ps multiplies with x directly:
//   D_g = sum_{k in g} x_k (128 + q_k),  y = sum_g [scale_g (D_g - 128 S_g) + minimum_g S_g]
// with S_g = sum_{k in g} x_k computed once per call. D_g stays a 16-lane vector scaled into the
// row's accumulator, so there is one horizontal sum per row, not per group. A 64-byte load holds
// 128 codes: 16-bit word j has codes k = 4j .. 4j+3 in its four nibbles; nibble t of every word
// makes one 32-lane vector, and x is reordered once per call to match (lane j of vector t is
// x[4j + t]). Requires group_size % 128 == 0. (Widening bytes to words first, vpmovzxbw, ran
// ~8.5 cycles per 64 codes; this ~40% fewer instructions.)
template <int M>
TARGET void int4_rows(const bf16* xr, const float* S, const uint8_t* w, const bf16* scale,
                      const bf16* minimum, bf16* y, int64_t N, int64_t K, int64_t gs,
                      int64_t n0, int64_t n1) {
  const int64_t G = K / gs;
  const __m512i low4 = _mm512_set1_epi16(0x0F), b128 = _mm512_set1_epi16(0x4300);
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* wn = w + n * (K / 2);
    __m512 acc[M];
    float cst[M];
    for (int m = 0; m < M; m++) { acc[m] = _mm512_setzero_ps(); cst[m] = 0.f; }
    for (int64_t g = 0; g < G; g++) {
      __m512 d[M][2];
      for (int m = 0; m < M; m++) d[m][0] = d[m][1] = _mm512_setzero_ps();
      for (int64_t k = g * gs; k < (g + 1) * gs; k += 128) {
        const __m512i b = _mm512_loadu_si512(wn + k / 2);
        // (a & low4) | b128: vpternlog truth table 0xEA
        const __m512i v0 = _mm512_ternarylogic_epi32(b, low4, b128, 0xEA);
        const __m512i v1 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(b, 4), low4, b128, 0xEA);
        const __m512i v2 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(b, 8), low4, b128, 0xEA);
        const __m512i v3 = _mm512_or_si512(_mm512_srli_epi16(b, 12), b128);
        for (int m = 0; m < M; m++) {
          const bf16* xm = xr + m * K + k;
          d[m][0] = _mm512_dpbf16_ps(d[m][0], (__m512bh)_mm512_loadu_si512(xm), (__m512bh)v0);
          d[m][1] = _mm512_dpbf16_ps(d[m][1], (__m512bh)_mm512_loadu_si512(xm + 32), (__m512bh)v1);
          d[m][0] = _mm512_dpbf16_ps(d[m][0], (__m512bh)_mm512_loadu_si512(xm + 64), (__m512bh)v2);
          d[m][1] = _mm512_dpbf16_ps(d[m][1], (__m512bh)_mm512_loadu_si512(xm + 96), (__m512bh)v3);
        }
      }
      const float sc = float(scale[n * G + g]), mn = float(minimum[n * G + g]);
      for (int m = 0; m < M; m++) {
        acc[m] = _mm512_fmadd_ps(_mm512_add_ps(d[m][0], d[m][1]), _mm512_set1_ps(sc), acc[m]);
        cst[m] += S[m * G + g] * (mn - 128.f * sc);
      }
    }
    for (int m = 0; m < M; m++) y[m * N + n] = bf16(_mm512_reduce_add_ps(acc[m]) + cst[m]);
  }
}

void check_x(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "x must be a contiguous (M, ", K, ") bf16 tensor, got ", x.sizes(), " ", x.scalar_type());
}


void check_y(const at::Tensor& y, const at::Tensor& x, int64_t M, int64_t N) {
  TORCH_CHECK(y.dim() == 2 && y.size(0) == M && y.size(1) == N && y.is_contiguous() &&
              y.scalar_type() == x.scalar_type(), "y must be a contiguous (", M, ", ", N, ") tensor "
              "of x's dtype, got ", y.sizes());
}

}  // namespace

void linear_bf16_into(const at::Tensor& x, const at::Tensor& w, at::Tensor& y) {
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  check_y(y, x, M, N);
  if (M > kMaxRows) {            // torch's GEMM: the kernel at::linear runs for a 2-D x, no bias
    at::mm_out(y, x, w.t());
    return;
  }
  check_x(x, K);
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == at::kBFloat16, "w must be contiguous bf16");
  auto xp = x.data_ptr<bf16>(), wp = w.data_ptr<bf16>(), yp = y.data_ptr<bf16>();
  at::parallel_for(0, N, kGrain, [&](int64_t n0, int64_t n1) {
    if (M == 1) bf16_rows<1>(xp, wp, yp, N, K, n0, n1);
    else bf16_rows<2>(xp, wp, yp, N, K, n0, n1);
  });
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w) {
  if (x.size(0) > kMaxRows) return at::linear(x, w);
  auto y = at::empty({x.size(0), w.size(0)}, x.options());
  linear_bf16_into(x, w, y);
  return y;
}

void linear_int8_into(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                      at::Tensor& y) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "x and w must be 2-D, got ", x.sizes(), " and ", w.sizes());
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  check_y(y, x, M, N);
  // aten's kernel crashes (SIGSEGV, torch 2.13) on 2+ rows when K % 16 != 0; such shapes run
  // this loop two rows at a time instead.
  if (M > kMaxRows && K % 16 == 0) {
    y.copy_(at::_weight_int8pack_mm(x, w, scale));
    return;
  }
  if (M > kMaxRows) {
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
      const int64_t m1 = std::min(M, m0 + kMaxRows);
      at::Tensor part = y.slice(0, m0, m1);         // whole rows: contiguous
      linear_int8_into(x.slice(0, m0, m1), w, scale, part);
    }
    return;
  }
  check_x(x, K);
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == at::kChar, "w must be contiguous int8");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == N && scale.is_contiguous() &&
              scale.scalar_type() == at::kBFloat16, "scale must be a contiguous (", N, ",) bf16 tensor");
  // x widened once, in a plain loop (a torch op here costs a few us a call, 121 calls a step)
  std::vector<float> xf(M * K);
  const bf16* xs = x.data_ptr<bf16>();
  for (int64_t i = 0; i < M * K; i++) xf[i] = float(xs[i]);
  auto xp = xf.data(); auto wp = w.data_ptr<int8_t>();
  auto sp = scale.data_ptr<bf16>(); auto yp = y.data_ptr<bf16>();
  at::parallel_for(0, N, kGrain, [&](int64_t n0, int64_t n1) {
    if (M == 1) int8_rows<1>(xp, wp, sp, yp, N, K, n0, n1);
    else int8_rows<2>(xp, wp, sp, yp, N, K, n0, n1);
  });
}

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "x and w must be 2-D, got ", x.sizes(), " and ", w.sizes());
  auto y = at::empty({x.size(0), w.size(0)}, x.options());
  linear_int8_into(x, w, scale, y);
  return y;
}

// x (M, K) bf16 with K padded to whole groups; packed (N, K/2) uint8; scale, minimum (N, K/gs)
// bf16. M > kMaxRows runs aten's kernel on its own layout of the same weights (aten_packed,
// aten_scale_zero: Int4Linear._aten_pack), as the layer does without this kernel.
void linear_int4_into(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                      const at::Tensor& minimum, int64_t group_size, const at::Tensor& aten_packed,
                      const at::Tensor& aten_scale_zero, at::Tensor& y) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 2, "x and packed must be 2-D, got ", x.sizes(),
              " and ", packed.sizes());
  const int64_t M = x.size(0), N = packed.size(0), K = packed.size(1) * 2;
  check_y(y, x, M, N);
  if (M > kMaxRows) {
    y.copy_(at::_weight_int4pack_mm_for_cpu(x, aten_packed, group_size, aten_scale_zero));
    return;
  }
  check_x(x, K);
  TORCH_CHECK(group_size > 0 && group_size % 128 == 0 && K % group_size == 0,
              "group_size must be a multiple of 128 dividing ", K, ", got ", group_size);
  TORCH_CHECK(packed.is_contiguous() && packed.scalar_type() == at::kByte, "packed must be contiguous uint8");
  const int64_t G = K / group_size;
  for (const at::Tensor* t : {&scale, &minimum})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == N && t->size(1) == G && t->is_contiguous() &&
                t->scalar_type() == at::kBFloat16, "scale and minimum must be contiguous (", N, ", ",
                G, ") bf16 tensors, got ", t->sizes(), " ", t->scalar_type());
  // reorder x per 128-code chunk (lane j of vector t is x[4j + t]); S = group sums.
  // (Plain loops: as torch ops these cost ~8 us a call, a sixth of a 3072 x 576 product.)
  std::vector<bf16> xr(M * K);
  std::vector<float> S(M * G, 0.f);
  const bf16* xs = x.data_ptr<bf16>();
  for (int64_t m = 0; m < M; m++)
    for (int64_t c = 0; c < K; c += 128) {
      float sum = 0.f;
      for (int64_t j = 0; j < 32; j++)
        for (int64_t t = 0; t < 4; t++) {
          const bf16 v = xs[m * K + c + 4 * j + t];
          xr[m * K + c + 32 * t + j] = v;
          sum += float(v);
        }
      S[m * G + c / group_size] += sum;
    }
  auto xpp = xr.data(); auto Sp = S.data(); auto wp = packed.data_ptr<uint8_t>();
  auto sp = scale.data_ptr<bf16>(); auto mp = minimum.data_ptr<bf16>(); auto yp = y.data_ptr<bf16>();
  at::parallel_for(0, N, kGrain, [&](int64_t n0, int64_t n1) {
    if (M == 1) int4_rows<1>(xpp, Sp, wp, sp, mp, yp, N, K, group_size, n0, n1);
    else int4_rows<2>(xpp, Sp, wp, sp, mp, yp, N, K, group_size, n0, n1);
  });
}

at::Tensor linear_int4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                       const at::Tensor& minimum, int64_t group_size, const at::Tensor& aten_packed,
                       const at::Tensor& aten_scale_zero) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 2, "x and packed must be 2-D, got ", x.sizes(),
              " and ", packed.sizes());
  auto y = at::empty({x.size(0), packed.size(0)}, x.options());
  linear_int4_into(x, packed, scale, minimum, group_size, aten_packed, aten_scale_zero, y);
  return y;
}

TORCH_LIBRARY(workbench_cpu, m) {
  m.def("linear_int4(Tensor x, Tensor packed, Tensor scale, Tensor minimum, int group_size, "
        "Tensor aten_packed, Tensor aten_scale_zero) -> Tensor");
  m.def("linear_bf16(Tensor x, Tensor w) -> Tensor");
  m.def("linear_int8(Tensor x, Tensor w, Tensor scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(workbench_cpu, CPU, m) {
  m.impl("linear_bf16", &linear_bf16);
  m.impl("linear_int8", &linear_int8);
  m.impl("linear_int4", &linear_int4);
}
