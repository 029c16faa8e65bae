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
// and adds them into 16 fp32 lanes; four weight rows share each load of x. The sum is rounded to
// bf16 once, as torch's kernels do; only the order of the fp32 additions differs (tests bound the
// difference). Larger M goes to torch's at::linear. The crossover was measured over SmolLM2's 120
// projections (ms per pass, loop vs torch): M=1 12.3 vs 17.7, M=2 15.5 vs 17.5, M=3 17.9 vs 17.7,
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
constexpr int64_t kRowBlock = 4;       // weight rows per inner loop: x is loaded once for 4 rows
constexpr int64_t kGrain = 8;          // row blocks per thread task, at least

using bf16 = c10::BFloat16;

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// ---------------------------------------------------------------------------------------- bf16
TARGET inline __m512 dot_bf16(__m512 acc, const bf16* a, const bf16* b, __mmask32 mask) {
  __m512i va = _mm512_maskz_loadu_epi16(mask, a), vb = _mm512_maskz_loadu_epi16(mask, b);
  return _mm512_dpbf16_ps(acc, (__m512bh)va, (__m512bh)vb);
}

TARGET void bf16_rows(const bf16* x, const bf16* w, bf16* y, int64_t M, int64_t N, int64_t K,
                      int64_t n0, int64_t n1) {
  const int64_t tail = K % 32, body = K - tail;
  const __mmask32 full = 0xFFFFFFFFu, last = tail ? (__mmask32)((1u << tail) - 1) : 0;
  for (int64_t n = n0; n < n1; n += kRowBlock) {
    const int64_t rows = std::min(kRowBlock, n1 - n);
    for (int64_t m = 0; m < M; m++) {          // the row block stays in L1 across the M rows
      const bf16* xm = x + m * K;
      __m512 acc[kRowBlock] = {_mm512_setzero_ps(), _mm512_setzero_ps(),
                               _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int64_t k = 0; k < body; k += 32)
        for (int64_t r = 0; r < rows; r++) acc[r] = dot_bf16(acc[r], xm + k, w + (n + r) * K + k, full);
      if (tail)
        for (int64_t r = 0; r < rows; r++) acc[r] = dot_bf16(acc[r], xm + body, w + (n + r) * K + body, last);
      for (int64_t r = 0; r < rows; r++) y[m * N + n + r] = bf16(_mm512_reduce_add_ps(acc[r]));
    }
  }
}

void check_x(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "x must be a contiguous (M, ", K, ") bf16 tensor, got ", x.sizes(), " ", x.scalar_type());
}

template <typename F>
void over_rows(int64_t N, int64_t align, const F& f) {
  const int64_t blocks = (N + align - 1) / align;
  at::parallel_for(0, blocks, kGrain, [&](int64_t b0, int64_t b1) {
    f(b0 * align, std::min(b1 * align, N));
  });
}

}  // namespace

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w) {
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  if (M > kMaxRows) return at::linear(x, w);
  check_x(x, K);
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == at::kBFloat16, "w must be contiguous bf16");
  auto y = at::empty({M, N}, x.options());
  auto xp = x.data_ptr<bf16>(), wp = w.data_ptr<bf16>(), yp = y.data_ptr<bf16>();
  over_rows(N, kRowBlock, [&](int64_t n0, int64_t n1) { bf16_rows(xp, wp, yp, M, N, K, n0, n1); });
  return y;
}

TORCH_LIBRARY(workbench_cpu, m) {
  m.def("linear_bf16(Tensor x, Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(workbench_cpu, CPU, m) {
  m.impl("linear_bf16", &linear_bf16);
}
