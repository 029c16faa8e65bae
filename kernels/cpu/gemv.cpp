// A small-batch matrix-vector product for x86 CPUs with AVX-512 BF16: the decode path at batch 1.
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
// Measured and left out (2-core Intel Xeon VM with AVX-512 BF16 and AMX):
// - INT4: a row-major loop (one output row at a time, a horizontal sum per row, per-group scales)
//   ran 1.9x slower than aten's _weight_int4pack_mm_for_cpu, whose repacked layout puts 16+
//   output rows side by side in a vector so x is broadcast and no horizontal sums are needed.
// - INT8 weight-only: widening int8 to fp32 (vpmovsxbd, vcvtdq2ps, vfmadd) is compute-bound at
//   ~10.5 GB/s, the same as aten's _weight_int8pack_mm; llama.cpp's Q8 dot products go faster by
//   quantizing the activations too, which is another numeric contract (SmoothQuant's W8A8).
#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <immintrin.h>


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

void check_x(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "x must be a contiguous (M, ", K, ") bf16 tensor, got ", x.sizes(), " ", x.scalar_type());
}


}  // namespace

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w) {
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  if (M > kMaxRows) return at::linear(x, w);
  check_x(x, K);
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == at::kBFloat16, "w must be contiguous bf16");
  auto y = at::empty({M, N}, x.options());
  auto xp = x.data_ptr<bf16>(), wp = w.data_ptr<bf16>(), yp = y.data_ptr<bf16>();
  at::parallel_for(0, N, kGrain, [&](int64_t n0, int64_t n1) {
    if (M == 1) bf16_rows<1>(xp, wp, yp, N, K, n0, n1);
    else bf16_rows<2>(xp, wp, yp, N, K, n0, n1);
  });
  return y;
}

TORCH_LIBRARY(workbench_cpu, m) {
  m.def("linear_bf16(Tensor x, Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(workbench_cpu, CPU, m) {
  m.impl("linear_bf16", &linear_bf16);
}
