// Small-batch matrix-vector products for the decode path: y = x @ W.T for a few rows of x, for
// bf16 or fp32 weights (linear_bf16, linear_fp32), INT8 weight-only ones (linear_int8) and
// group-wise INT4 ones (linear_int4). x is bf16 or fp32 and y has x's dtype.
//
// Why hand-written: at batch 1 a decode step multiplies one activation row by every weight
// matrix, so its speed is the speed at which the weights stream from memory. PyTorch's bf16
// `F.linear` for one row goes through a GEMM path built for big batches and streams bf16 weights
// well below the memory's rate, on some CPUs slower than its own fp32 path (`python -m
// workbench.bench speed`: the eager rows' achieved GB/s against the copy bandwidth measured
// beside them; results/cpu/ keeps committed runs). These loops do what llama.cpp's CPU dot
// products do: one pass over each weight row, multiply-added into fp32 accumulators, rows split
// across threads.
//
// Portable: the arithmetic is written on wb::Vec (at::vec::Vectorized<float>, isa.h), so one
// source builds for AVX-512, AVX2 and any other CPU (ARM through ATen's NEON vector). Only a few
// inner products are written per ISA, each in one function behind the WB_ISA_* macros: the bf16
// dot product (vdpbf16ps), the INT4 chunk product (vpmaddwd) and, in isa.h, the widening loads.
//
// Sums are fp32 and a bf16 y is rounded once, as torch's kernels do; only the order of the fp32
// additions differs (tests bound the difference). INT4 is the one exception, see int4_chunk.
//
// Rows: bf16 x runs the loops for M <= kMaxRows and torch's GEMM above, where the GEMM overtakes
// them on SmolLM2's projections (`python -m workbench.bench.cpu_gemv --x bf16 --formats bf16 --rows
// 1,2,3,8` shows the crossover). fp32 x runs them in tiles of rows (each weight row read once per
// tile) up to the per-format limits below, measured separately.
//
// Why the INT4 and INT8 loops take their shape (python -m workbench.bench.cpu_gemv --formats int4,int8):
// - INT4 makes operands from the codes with a few integer ops and sums once per row: a row-major
//   loop with a horizontal sum per group and the codes widened to floats is slower than aten's
//   _weight_int4pack_mm_for_cpu.
// - INT8 weight-only runs like the bf16 loop (one row at a time, four accumulators, x widened to
//   fp32 once per call): it reads SmolLM2's LM head at about the memory's rate, faster than aten's
//   _weight_int8pack_mm. Widening each int8 to fp32 (vpmovsxbd, vcvtdq2ps, vfmadd) is no faster
//   than aten's.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "isa.h"
#include "ops.h"

namespace {

using bf16 = c10::BFloat16;
using wb::kLanes;
using wb::Vec;

constexpr int64_t kMaxRows = 2;        // bf16 x: M up to this runs the loops (measured crossover)
constexpr int64_t kGrain = 32;         // weight rows per thread task, at least
constexpr int64_t kBlock = 64;         // weight rows per block, read by every tile of x while in L2
// fp32 x: the loops run up to these many rows; above, the weight widened to fp32 once and torch's
// GEMM. (aten's _weight_int8pack_mm / _weight_int4pack_mm_for_cpu take fp32 x in torch 2.13 but
// run many times slower than these loops at every M from 1 to 64, so fp32 x never goes to them:
// `python -m workbench.bench.cpu_gemv --x fp32 --formats int8,int4 --rows 1,16,64`.) Each limit is about
// where widen-and-GEMM overtakes the loops on SmolLM2's layers, per weight format and ISA
// (`python -m workbench.bench.cpu_gemv --x fp32 --vs widened --rows 32,64,256,512`, with these limits
// raised, on the AVX2 and AVX-512 builds).
constexpr int64_t kMaxRowsFp32Bf16 = 384;
#if defined(WB_ISA_AVX512)
constexpr int64_t kMaxRowsFp32Fp32 = 64;
#else
constexpr int64_t kMaxRowsFp32Fp32 = 32;
#endif
constexpr int64_t kMaxRowsFp32Quant = 64;
// Rows of x per pass over a block (bf16/fp32/int8 loops): 6 rows x 2 chains = 12 accumulators, of
// AVX2's 16 registers, while the tile's fp32 rows fit in kTileBytes of L1 (else 4 rows). Tiles of
// 6 beat tiles of 4 on SmolLM2's K=576 shapes and lose on its K=1536 one (36 KB of x per tile),
// hence the limit (python -m workbench.bench.cpu_gemv --x fp32 --formats bf16 --rows 6,16,64 --vs ref
// --against DIR, DIR holding tiles of 4).
constexpr int64_t kTileDense = 6;
constexpr int64_t kTileBytes = 24 * 1024;
constexpr int64_t kTileInt4 = 2;       // rows of x per pass over a block (INT4 loop)

// Row-invariant mode (LLM(batch_invariant=True), set per thread by set_row_invariant): every row
// count runs the loops, with the same accumulator chains per row, so a row's sums are added in one
// order whatever else shares the call (no switch to torch's GEMM, whose order depends on M).
thread_local bool row_invariant = false;

template <int R>
using Rows = std::integral_constant<int, R>;

// Calls fn(Rows<r>{}, m0) for r == R, else tries R - 1, ... down to 1.
template <int R, class Fn>
void with_rows(int64_t r, int64_t m0, const Fn& fn) {
  if constexpr (R > 1) {
    if (r != R) return with_rows<R - 1>(r, m0, fn);
  }
  fn(Rows<R>{}, m0);
}

// Calls fn(Rows<r>{}, m0) for each tile [m0, m0 + r) of M rows: as few tiles as r <= Tile allows,
// their sizes differing by at most one (8 rows in tiles of 6: 4 + 4, not 6 + 2).
template <int Tile, class Fn>
void for_tiles(int64_t M, const Fn& fn) {
  const int64_t tiles = (M + Tile - 1) / Tile;
  for (int64_t i = 0, m0 = 0; i < tiles; ++i) {
    const int64_t r = M / tiles + (i < M % tiles);
    with_rows<Tile>(r, m0, fn);
    m0 += r;
  }
}

// Calls fn(b0, b1) for blocks of kBlock weight rows in [n0, n1): every tile of x reads a block
// while it is in L2, so the weights stream from memory once per call whatever M is.
template <class Fn>
void for_blocks(int64_t n0, int64_t n1, const Fn& fn) {
  for (int64_t b0 = n0; b0 < n1; b0 += kBlock) fn(b0, std::min(n1, b0 + kBlock));
}

inline Vec load_w(const float* p) { return wb::load_fp32(p); }
inline Vec load_w(const bf16* p) { return wb::load_bf16(p); }
inline Vec load_w(const int8_t* p) { return wb::load_int8(p); }

// ------------------------------------------------------------------------------ dense (fp32 x)
// Rows n0..n1 of W (bf16, fp32 or int8), one row at a time: each thread reads its share of W as
// one sequential stream, the pattern hardware prefetchers follow best. (Interleaving 4 rows to
// reuse each load of x streams slower than one row at a time: x is a few KB and stays in L1
// anyway.) C accumulators per x row hide the FMA latency. finish(m, n, sum) stores the row's fp32
// sum. At M=1 it beats torch's equivalent for every weight format and activation dtype, the LM
// head most (python -m workbench.bench.cpu_gemv --threads 1 --formats bf16,fp32,int8 --x fp32,bf16
// prints torch/ours per shape).
template <int M, int C, class T, class Finish>
void dense_rows(const float* x, const T* w, int64_t K, int64_t n0, int64_t n1,
                const Finish& finish) {
  constexpr int64_t kStep = kLanes * C;
  const int64_t body = K - K % kStep, mid = K - K % kLanes;
  for (int64_t n = n0; n < n1; n++) {
    const T* wn = w + n * K;
    Vec acc[M][C];
    for (int m = 0; m < M; m++)
      for (int c = 0; c < C; c++) acc[m][c] = Vec(0.f);
    for (int64_t k = 0; k < body; k += kStep)
      for (int c = 0; c < C; c++) {
        const Vec vw = load_w(wn + k + kLanes * c);
        for (int m = 0; m < M; m++)
          acc[m][c] = at::vec::fmadd(Vec::loadu(x + m * K + k + kLanes * c), vw, acc[m][c]);
      }
    for (int64_t k = body; k < mid; k += kLanes) {
      const Vec vw = load_w(wn + k);
      for (int m = 0; m < M; m++) acc[m][0] = at::vec::fmadd(Vec::loadu(x + m * K + k), vw, acc[m][0]);
    }
    for (int m = 0; m < M; m++) {
      Vec s = acc[m][0];
      for (int c = 1; c < C; c++) s = s + acc[m][c];
      float sum = wb::hsum(s);
      for (int64_t k = mid; k < K; k++) sum += x[m * K + k] * static_cast<float>(wn[k]);
      finish(m, n, sum);
    }
  }
}

// x as fp32: the tensor's own data, or widened from bf16 into `buf` once per call.
const float* x_as_fp32(const at::Tensor& x, std::vector<float>& buf) {
  if (x.scalar_type() == at::kFloat) return x.data_ptr<float>();
  buf.resize(x.numel());
  const bf16* xs = x.data_ptr<bf16>();
  for (int64_t i = 0; i < x.numel(); i++) buf[i] = static_cast<float>(xs[i]);
  return buf.data();
}

// Calls fn(pointer to y's data) as float* or bf16*.
template <class Fn>
void with_y(at::Tensor& y, const Fn& fn) {
  if (y.scalar_type() == at::kFloat) fn(y.data_ptr<float>());
  else fn(y.data_ptr<bf16>());
}

constexpr const float* kNoScale = nullptr;

// y = x @ w.T (times scale[n] when scale is given) for every row of x, in tiles of kTileDense.
// A lone row takes 4 accumulator chains (more FMAs in flight), tiles 2; row-invariant mode, 2 always.
template <class T, class S>
void dense_linear(const at::Tensor& x, const T* w, const S* scale, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1);
  const bool invariant = row_invariant;      // read on the calling thread
  std::vector<float> buf;
  const float* xf = x_as_fp32(x, buf);
  with_y(y, [&](auto* yp) {
    using Y = std::remove_pointer_t<decltype(yp)>;
    at::parallel_for(0, N, kGrain, [&](int64_t n0, int64_t n1) {
      for_blocks(n0, n1, [&](int64_t b0, int64_t b1) {
        auto tile = [&](auto rows, int64_t m0) {
          Y* yt = yp + m0 * N;
          auto finish = [&](int m, int64_t n, float sum) {
            yt[m * N + n] = static_cast<Y>(scale ? sum * static_cast<float>(scale[n]) : sum);
          };
          constexpr int R = decltype(rows)::value;
          if (R == 1 && !invariant) dense_rows<R, 4>(xf + m0 * K, w, K, b0, b1, finish);
          else dense_rows<R, 2>(xf + m0 * K, w, K, b0, b1, finish);
        };
        if (kTileDense * K * 4 <= kTileBytes) for_tiles<kTileDense>(M, tile);
        else for_tiles<4>(M, tile);
      });
    });
  });
}

// ------------------------------------------------------------------------------ bf16 x bf16
#if defined(WB_ISA_AVX512BF16)
constexpr int kChains = 3;             // independent accumulators along k per x row

inline __m512 dot_bf16(__m512 acc, const bf16* a, const bf16* b, __mmask32 mask) {
  __m512i va = _mm512_maskz_loadu_epi16(mask, a), vb = _mm512_maskz_loadu_epi16(mask, b);
  return _mm512_dpbf16_ps(acc, (__m512bh)va, (__m512bh)vb);
}

// vdpbf16ps multiplies 32 bf16 pairs and adds them into 16 fp32 lanes: x stays bf16, no widening,
// which beats both the dense loop of the avx512 build and torch's bf16 F.linear (python -m
// workbench.bench.cpu_gemv --x bf16 --formats bf16 --threads 1, on each build via WORKBENCH_ISA).
template <int M>
void bf16_rows(const bf16* x, const bf16* w, bf16* y, int64_t N, int64_t K, int64_t n0, int64_t n1) {
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

// bf16 x and bf16 w: M <= kMaxRows, or any M in row-invariant mode (tiles of 2 rows per pass over
// a block of weight rows; a row's chains are the same in a tile of 1 or 2).
void bf16_bf16_linear(const at::Tensor& x, const at::Tensor& w, at::Tensor& y) {
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  auto xp = x.data_ptr<bf16>(), wp = w.data_ptr<bf16>(), yp = y.data_ptr<bf16>();
  at::parallel_for(0, N, kGrain, [&](int64_t n0, int64_t n1) {
    for_blocks(n0, n1, [&](int64_t b0, int64_t b1) {
      for_tiles<2>(M, [&](auto rows, int64_t m0) {
        bf16_rows<decltype(rows)::value>(xp + m0 * K, wp, yp + m0 * N, N, K, b0, b1);
      });
    });
  });
}
#else
// Without vdpbf16ps: x widened to fp32 once, w by a 16-bit shift per load (the dense loop).
void bf16_bf16_linear(const at::Tensor& x, const at::Tensor& w, at::Tensor& y) {
  dense_linear<bf16>(x, w.data_ptr<bf16>(), kNoScale, y);
}
#endif

// ---------------------------------------------------------------------------------------- int4
// Group-wise asymmetric INT4 (Int4Linear's format: w = q * scale + minimum per row and group,
// codes 0..15, two per byte, even k in the low nibble), so
//   y = sum_g [scale_g D_g + minimum_g S_g],  D_g = sum_{k in g} x_k q_k,  S_g = sum_{k in g} x_k.
// Codes are read 128 at a time (64 bytes): 16-bit word j of a chunk holds codes 4j .. 4j+3 in its
// four nibbles, and nibble t of every word makes one vector; x is reordered once per call to match
// (x' [32 t + j] = x[4 j + t] within each chunk). Groups of 128k take one scale per chunk
// (int4_rows); groups of 8 to 64 codes (GGUF's Q4 blocks are 32) one scale per lane of the
// chunk's product (int4_rows_small), whose 16 32-bit lanes each sum 8 consecutive codes.
constexpr int64_t kChunk = 128;
constexpr int kChunkLanes = 16;        // 32-bit lanes of one chunk's integer product
constexpr int kCodesPerLane = kChunk / kChunkLanes;
static_assert(kChunkLanes % kLanes == 0, "a chunk's lanes fill whole vectors");
constexpr int kLaneVecs = kChunkLanes / kLanes;

inline int64_t round_up(int64_t k, int64_t to) { return (k + to - 1) / to * to; }
inline bool small_int4_group(int64_t gs) { return gs >= kCodesPerLane && kChunk % gs == 0 && gs < kChunk; }

// x of one call prepared for the INT4 loops: reordered per chunk; `q` holds it as int16 with one
// scale per row and chunk (`xs`), `S` the exact fp32 group sums.
struct Int4X {
  std::vector<int16_t> q;
  std::vector<float> xs, S;
#if defined(WB_ISA_AVX512BF16)
  std::vector<bf16> r;                 // bf16 x reordered, for the vdpbf16ps loop
#endif
};

// x (M, Kx) with Kx <= K: the columns from Kx to K (the weight's padding to whole groups) read 0.
// Rows of q are Kp = K rounded up to whole chunks apart (small groups leave a partial last chunk).
template <class X>
void prepare_int4_x(const X* x, int64_t M, int64_t Kx, int64_t K, int64_t gs, bool as_int16,
                    Int4X& out) {
  const int64_t Kp = round_up(K, kChunk), C = Kp / kChunk, G = K / gs;
  if (as_int16) { out.q.resize(M * Kp); out.xs.resize(M * C); }
#if defined(WB_ISA_AVX512BF16)
  if (!as_int16) out.r.resize(M * K);
#endif
  out.S.assign(M * G, 0.f);
  for (int64_t m = 0; m < M; m++)
    for (int64_t c = 0; c < C; c++) {
      const X* xc = x + m * Kx + c * kChunk;
      const int64_t valid = std::min<int64_t>(kChunk, Kx - c * kChunk);
      float v[kChunk], amax = 0.f, sum = 0.f;
      for (int j = 0; j < 32; j++)
        for (int t = 0; t < 4; t++) {
          const float f = 4 * j + t < valid ? static_cast<float>(xc[4 * j + t]) : 0.f;
          v[32 * t + j] = f;
          amax = std::max(amax, std::fabs(f));
          sum += f;
        }
      if (gs >= kChunk) {
        out.S[m * G + c * kChunk / gs] += sum;
      } else {                        // one sum per group inside the chunk (valid columns only)
        for (int64_t k = 0; k < valid; k++) out.S[m * G + (c * kChunk + k) / gs] += static_cast<float>(xc[k]);
      }
      if (as_int16) {
        const float inv = amax > 0.f ? 32767.f / amax : 0.f;
        out.xs[m * C + c] = amax / 32767.f;
        int16_t* q = out.q.data() + m * Kp + c * kChunk;
        for (int i = 0; i < kChunk; i++) {   // to nearest, in a loop the compiler vectorizes
          const float r = v[i] * inv;        // (std::nearbyint is a libm call per element)
          q[i] = static_cast<int16_t>(r + (r >= 0.f ? 0.5f : -0.5f));
        }
      }
#if defined(WB_ISA_AVX512BF16)
      else {
        for (int i = 0; i < kChunk; i++) out.r[m * K + c * kChunk + i] = bf16(v[i]);
      }
#endif
    }
}

// The integer product of one chunk of codes with x as int16, for M rows of xq (K apart): d[m]
// gets lanes whose sum is sum_k xq[m][k] q_k, as fp32. vpmaddwd multiplies 16-bit codes by 16-bit
// x and adds pairs into 32-bit lanes, exactly. The price: x is rounded to 16 bits per chunk
// (|error| <= max|x| / 65534 per element), far below bf16's 8 bits. It is faster than codes
// widened to fp32 with fp32 x, and slower than llama.cpp's int8 x (vpmaddubsw), whose x
// rounding errs ~258x more (a step of max|x| / 127 against max|x| / 32767):
// kernels/cpu/bench_int4_avx2.cpp times all three. AVX-512 gains nothing on CPUs that run
// 512-bit ops as two 256-bit halves (Zen 4).
#if defined(WB_ISA_AVX512)
template <int M>
inline void int4_chunk(const uint8_t* w, const int16_t* xq, int64_t K, Vec* d) {
  const __m512i low4 = _mm512_set1_epi16(0x0F);
  const __m512i b = _mm512_loadu_si512(w);
  const __m512i v[4] = {_mm512_and_si512(b, low4), _mm512_and_si512(_mm512_srli_epi16(b, 4), low4),
                        _mm512_and_si512(_mm512_srli_epi16(b, 8), low4), _mm512_srli_epi16(b, 12)};
  for (int m = 0; m < M; m++) {
    const int16_t* xm = xq + m * K;
    __m512i s0 = _mm512_madd_epi16(v[0], _mm512_loadu_si512(xm));
    __m512i s1 = _mm512_madd_epi16(v[1], _mm512_loadu_si512(xm + 32));
    s0 = _mm512_add_epi32(s0, _mm512_madd_epi16(v[2], _mm512_loadu_si512(xm + 64)));
    s1 = _mm512_add_epi32(s1, _mm512_madd_epi16(v[3], _mm512_loadu_si512(xm + 96)));
    d[m] = Vec(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)));
  }
}
#elif defined(WB_ISA_AVX2)
template <int M>
inline void int4_chunk(const uint8_t* w, const int16_t* xq, int64_t K, Vec* d) {
  const __m256i low4 = _mm256_set1_epi16(0x0F);
  __m256i s[M][2];
  for (int h = 0; h < 2; h++) {        // words 16h .. 16h + 15 of the chunk
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * h));
    const __m256i v[4] = {_mm256_and_si256(b, low4), _mm256_and_si256(_mm256_srli_epi16(b, 4), low4),
                          _mm256_and_si256(_mm256_srli_epi16(b, 8), low4), _mm256_srli_epi16(b, 12)};
    for (int m = 0; m < M; m++) {
      const int16_t* xm = xq + m * K + 16 * h;
      __m256i p[4];
      for (int t = 0; t < 4; t++)
        p[t] = _mm256_madd_epi16(v[t], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xm + 32 * t)));
      const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(p[0], p[1]), _mm256_add_epi32(p[2], p[3]));
      s[m][h] = h == 0 ? sum : _mm256_add_epi32(s[m][0], sum);
    }
  }
  for (int m = 0; m < M; m++) d[m] = Vec(_mm256_cvtepi32_ps(s[m][1]));
}
#else
// Portable: the same integer sums in plain loops (lane j / 2 gets word j's codes, as vpmaddwd).
template <int M>
inline void int4_chunk_lanes(const uint8_t* w, const int16_t* xq, int64_t K, Vec (*d)[kLaneVecs]) {
  int32_t s[M][kChunkLanes] = {};
  for (int j = 0; j < 32; j++) {
    const uint32_t word = w[2 * j] | (static_cast<uint32_t>(w[2 * j + 1]) << 8);
    for (int t = 0; t < 4; t++) {
      const int32_t q = (word >> (4 * t)) & 0xF;
      for (int m = 0; m < M; m++) s[m][j / 2] += q * xq[m * K + 32 * t + j];
    }
  }
  for (int m = 0; m < M; m++) {
    float f[kChunkLanes];
    for (int i = 0; i < kChunkLanes; i++) f[i] = static_cast<float>(s[m][i]);
    for (int v = 0; v < kLaneVecs; v++) d[m][v] = Vec::loadu(f + v * kLanes);
  }
}

template <int M>
inline void int4_chunk(const uint8_t* w, const int16_t* xq, int64_t K, Vec* d) {
  Vec lanes[M][kLaneVecs];
  int4_chunk_lanes<M>(w, xq, K, lanes);
  for (int m = 0; m < M; m++) {
    d[m] = lanes[m][0];
    for (int v = 1; v < kLaneVecs; v++) d[m] = d[m] + lanes[m][v];
  }
}
#endif

#if defined(WB_ISA_AVX512)
// One vector of 16 lanes, lane i the sum over codes 8i .. 8i + 7: int4_chunk's result as it is.
template <int M>
inline void int4_chunk_lanes(const uint8_t* w, const int16_t* xq, int64_t K, Vec (*d)[kLaneVecs]) {
  Vec s[M];
  int4_chunk<M>(w, xq, K, s);
  for (int m = 0; m < M; m++) d[m][0] = s[m];
}
#elif defined(WB_ISA_AVX2)
// Two vectors of 8 lanes (codes 0-63, then 64-127), lane i the sum over 8 consecutive codes.
template <int M>
inline void int4_chunk_lanes(const uint8_t* w, const int16_t* xq, int64_t K, Vec (*d)[kLaneVecs]) {
  const __m256i low4 = _mm256_set1_epi16(0x0F);
  for (int h = 0; h < 2; h++) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * h));
    const __m256i v[4] = {_mm256_and_si256(b, low4), _mm256_and_si256(_mm256_srli_epi16(b, 4), low4),
                          _mm256_and_si256(_mm256_srli_epi16(b, 8), low4), _mm256_srli_epi16(b, 12)};
    for (int m = 0; m < M; m++) {
      const int16_t* xm = xq + m * K + 16 * h;
      __m256i p[4];
      for (int t = 0; t < 4; t++)
        p[t] = _mm256_madd_epi16(v[t], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xm + 32 * t)));
      d[m][h] = Vec(_mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_add_epi32(p[0], p[1]),
                                                        _mm256_add_epi32(p[2], p[3]))));
    }
  }
}
#endif

// Rows n0..n1 of the codes for M rows of prepared x: per chunk, the integer product scaled by
// scale_g * xs (one FMA per chunk), one horizontal sum per row; minimum_g S_g added at the end.
// With fp32 x at M=1 it beats the fp32 F.linear and, by far, aten's _weight_int4pack_mm_for_cpu
// with fp32 x, on every SmolLM2 shape and on AVX-512 too (WORKBENCH_ISA=avx2
// ATEN_CPU_CAPABILITY=avx2 python -m workbench.bench.cpu_gemv --x fp32,bf16 --formats int4 --threads 1).
template <int M, class Sc, class Finish>
void int4_rows(const Int4X& xp, int64_t m0, const uint8_t* w, const Sc* scale, const Sc* minimum,
               int64_t K, int64_t gs, int64_t n0, int64_t n1, const Finish& finish) {
  const int64_t C = K / kChunk, G = K / gs, per_group = gs / kChunk;
  const int16_t* xq = xp.q.data() + m0 * K;
  const float* xs = xp.xs.data() + m0 * C;
  const float* S = xp.S.data() + m0 * G;
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* wn = w + n * (K / 2);
    Vec acc[M];
    float cst[M];
    for (int m = 0; m < M; m++) { acc[m] = Vec(0.f); cst[m] = 0.f; }
    for (int64_t g = 0; g < G; g++) {
      const float sc = static_cast<float>(scale[n * G + g]), mn = static_cast<float>(minimum[n * G + g]);
      for (int64_t c = g * per_group; c < (g + 1) * per_group; c++) {
        Vec d[M];
        int4_chunk<M>(wn + c * kChunk / 2, xq + c * kChunk, K, d);
        for (int m = 0; m < M; m++) acc[m] = at::vec::fmadd(d[m], Vec(sc * xs[m * C + c]), acc[m]);
      }
      for (int m = 0; m < M; m++) cst[m] += mn * S[m * G + g];
    }
    for (int m = 0; m < M; m++) finish(m, n, wb::hsum(acc[m]) + cst[m]);
  }
}

// The scale of every lane of one chunk's product (lane i sums codes 8i .. 8i + 7) for groups of
// gs codes: `groups` scales from s, lanes of missing groups (a partial last chunk) scaled by 0.
class LaneScales {
 public:
  explicit LaneScales(int64_t gs)
      : per_chunk_(static_cast<int>(kChunk / gs)), lanes_(static_cast<int>(gs / kCodesPerLane)) {
#if defined(WB_ISA_AVX2)
    for (int h = 0; h < 2; h++) {     // half h, lane l: group (8h + l) / lanes
      alignas(32) int32_t i[8];
      for (int l = 0; l < 8; l++) i[l] = std::min((8 * h + l) / lanes_, 7);
      idx_[h] = _mm256_load_si256(reinterpret_cast<const __m256i*>(i));
    }
#endif
  }
  int per_chunk() const { return per_chunk_; }

  // A full chunk's lane scales (all per_chunk() groups present).
  template <class Sc>
  void full(const Sc* s, Vec* out) const {
#if defined(WB_ISA_AVX2)
    if (per_chunk_ <= 8) {            // the chunk's scales in one register, spread by a permute
      const __m256 v = load_scales(s);  // (from registers: stores then a wide load would stall)
      out[0] = Vec(_mm256_permutevar8x32_ps(v, idx_[0]));
      out[1] = Vec(_mm256_permutevar8x32_ps(v, idx_[1]));
      return;
    }
#endif
    partial(s, per_chunk_, out);
  }

  // The first `groups` groups of a chunk present, the lanes of the others scaled by 0.
  template <class Sc>
  void partial(const Sc* s, int groups, Vec* out) const {
    float ls[kChunkLanes];
    for (int g = 0; g < per_chunk_; g++) {
      const float sc = g < groups ? static_cast<float>(s[g]) : 0.f;
      for (int i = 0; i < lanes_; i++) ls[g * lanes_ + i] = sc;
    }
    for (int v = 0; v < kLaneVecs; v++) out[v] = Vec::loadu(ls + v * kLanes);
  }

 private:
#if defined(WB_ISA_AVX2)
  // per_chunk_ (2, 4 or 8) scales in the low lanes, read without going past them.
  __m256 load_scales(const float* s) const {
    if (per_chunk_ == 8) return _mm256_loadu_ps(s);
    const __m128 v = per_chunk_ == 4 ? _mm_loadu_ps(s)
                                     : _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(s)));
    return _mm256_castps128_ps256(v);
  }
  __m256 load_scales(const bf16* s) const {
    const __m128i h = per_chunk_ == 8 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(s))
                      : per_chunk_ == 4 ? _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s))
                                        : _mm_cvtsi32_si128(*reinterpret_cast<const int32_t*>(s));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
#endif
  int per_chunk_, lanes_;
#if defined(WB_ISA_AVX2)
  __m256i idx_[2];
#endif
};

// int4_rows for groups smaller than a chunk (small_int4_group): each lane of a chunk's product
// is scaled by its own group's scale. A partial last chunk (K % 128 codes) reads on into the next
// row, and in the tensor's last row (`last`) from a zero-padded copy. Same integer sums as
// int4_rows, so the same rounding of x.
template <int M, class Sc, class Finish>
void int4_rows_small(const Int4X& xp, int64_t m0, const uint8_t* w, const Sc* scale,
                     const Sc* minimum, int64_t K, int64_t gs, int64_t n0, int64_t n1, int64_t last,
                     const Finish& finish) {
  const int64_t Kp = round_up(K, kChunk), C = Kp / kChunk, G = K / gs;
  const int64_t full = K / kChunk;    // chunks with all 128 codes
  const LaneScales lane_scales(gs);
  const int per_chunk = lane_scales.per_chunk();
  const int tail_groups = static_cast<int>((K - full * kChunk) / gs);
  const int16_t* xq = xp.q.data() + m0 * Kp;
  const float* xs = xp.xs.data() + m0 * C;
  const float* S = xp.S.data() + m0 * G;
  alignas(64) uint8_t tail[kChunk / 2] = {};
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* wn = w + n * (K / 2);
    const Sc* sn = scale + n * G;
    Vec acc[M];
    for (int m = 0; m < M; m++) acc[m] = Vec(0.f);
    for (int64_t c = 0; c < C; c++) {
      const uint8_t* wc = wn + c * kChunk / 2;
      Vec sv[kLaneVecs];
      if (c < full || n < last) {      // past the row lie the next row's codes and scales: x is 0
        lane_scales.full(sn + c * per_chunk, sv);   // there, so its lanes sum to exactly 0
      } else {                         // never read past the tensor: the codes beyond K read 0
        std::memcpy(tail, wc, (K - full * kChunk) / 2);
        std::memset(tail + (K - full * kChunk) / 2, 0, (kChunk - (K - full * kChunk)) / 2);
        wc = tail;
        lane_scales.partial(sn + c * per_chunk, tail_groups, sv);
      }
      Vec d[M][kLaneVecs];
      int4_chunk_lanes<M>(wc, xq + c * kChunk, Kp, d);
      for (int m = 0; m < M; m++) {
        const Vec x_scale(xs[m * C + c]);
        for (int v = 0; v < kLaneVecs; v++) acc[m] = at::vec::fmadd(d[m][v], sv[v] * x_scale, acc[m]);
      }
    }
    // + sum_g minimum_g S_g, a vector at a time into the same accumulator (G is up to K / 8)
    const Sc* mn = minimum + n * G;
    const int64_t body = G - G % kLanes;
    for (int64_t g = 0; g < body; g += kLanes) {
      const Vec vm = load_w(mn + g);
      for (int m = 0; m < M; m++) acc[m] = at::vec::fmadd(vm, Vec::loadu(S + m * G + g), acc[m]);
    }
    for (int m = 0; m < M; m++) {
      float cst = 0.f;
      for (int64_t g = body; g < G; g++) cst += static_cast<float>(mn[g]) * S[m * G + g];
      finish(m, n, wb::hsum(acc[m]) + cst);
    }
  }
}

#if defined(WB_ISA_AVX512BF16)
// bf16 x on AVX-512 BF16: a code q OR 0x4300 is the bf16 number 128 + q exactly (exponent 2^7, q
// in the low mantissa bits), so one shift and one vpternlog ((w >> s) & 0xF | 0x4300) turn codes
// into bf16 lanes that vdpbf16ps multiplies with x directly, products exact:
//   D_g = sum_{k in g} x_k (128 + q_k) - 128 S_g.
// D_g stays a 16-lane vector scaled into the row's accumulator: one horizontal sum per row.
// (Widening bytes to words first, vpmovzxbw, takes more instructions per 64 codes.) Output bf16
// only. About as fast as the int16 loop and exact for bf16 x, so bf16 x keeps it; faster than
// aten's bf16 kernel on gate_up, down and the LM head (python -m workbench.bench.cpu_gemv --x bf16
// --formats int4 --threads 1, on the avx512bf16 and avx512 builds).
template <int M, class Sc>
void int4_rows_bf16(const Int4X& xp, int64_t m0, const uint8_t* w, const Sc* scale,
                    const Sc* minimum, bf16* y, int64_t N, int64_t K, int64_t gs, int64_t n0,
                    int64_t n1) {
  const int64_t G = K / gs;
  const bf16* xr = xp.r.data() + m0 * K;
  const float* S = xp.S.data() + m0 * G;
  y += m0 * N;
  const __m512i low4 = _mm512_set1_epi16(0x0F), b128 = _mm512_set1_epi16(0x4300);
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* wn = w + n * (K / 2);
    __m512 acc[M];
    float cst[M];
    for (int m = 0; m < M; m++) { acc[m] = _mm512_setzero_ps(); cst[m] = 0.f; }
    for (int64_t g = 0; g < G; g++) {
      __m512 d[M][2];
      for (int m = 0; m < M; m++) d[m][0] = d[m][1] = _mm512_setzero_ps();
      for (int64_t k = g * gs; k < (g + 1) * gs; k += kChunk) {
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
      const float sc = static_cast<float>(scale[n * G + g]), mn = static_cast<float>(minimum[n * G + g]);
      for (int m = 0; m < M; m++) {
        acc[m] = _mm512_fmadd_ps(_mm512_add_ps(d[m][0], d[m][1]), _mm512_set1_ps(sc), acc[m]);
        cst[m] += S[m * G + g] * (mn - 128.f * sc);
      }
    }
    for (int m = 0; m < M; m++) y[m * N + n] = bf16(_mm512_reduce_add_ps(acc[m]) + cst[m]);
  }
}
#endif

// ---------------------------------------------------------------------------------------- checks
void check_x(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.is_contiguous() &&
              (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "x must be a contiguous (M, ", K, ") bf16 or fp32 tensor, got ", x.sizes(), " ",
              x.scalar_type());
}

void check_y(const at::Tensor& y, const at::Tensor& x, int64_t M, int64_t N) {
  TORCH_CHECK(y.dim() == 2 && y.size(0) == M && y.size(1) == N && y.is_contiguous() &&
              y.scalar_type() == x.scalar_type(), "y must be a contiguous (", M, ", ", N, ") tensor "
              "of x's dtype, got ", y.sizes(), " ", y.scalar_type());
}

void check_2d(const at::Tensor& x, const at::Tensor& w, const char* name) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "x and ", name, " must be 2-D, got ", x.sizes(),
              " and ", w.sizes());
}

// A bf16 or fp32 parameter (scale) in x's dtype for aten's kernels, which want that.
at::Tensor as_x_dtype(const at::Tensor& t, const at::Tensor& x) {
  return t.scalar_type() == x.scalar_type() ? t : t.to(x.scalar_type());
}

// aten's INT4 scale/zero pairs in x's dtype: the given ones, or rebuilt in fp32 from scale and
// minimum as Int4Linear._aten_pack does (aten computes (q - 8) scale + zero), so fp32 x never sees
// a zero point rounded to bf16.
at::Tensor aten_scale_zero_for(const at::Tensor& x, const at::Tensor& scale,
                               const at::Tensor& minimum, const at::Tensor& scale_zero) {
  if (scale_zero.scalar_type() == x.scalar_type()) return scale_zero;
  const at::Tensor s = scale.to(at::kFloat), zero = minimum.to(at::kFloat) + 8 * s;
  return at::stack({s, zero}, -1).transpose(0, 1).contiguous().to(x.scalar_type());
}

}  // namespace

// --------------------------------------------------------------------------------- bf16 / fp32 w
void linear_fp32_into(const at::Tensor& x, const at::Tensor& w, at::Tensor& y) {
  check_2d(x, w, "w");
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  check_y(y, x, M, N);
  if (M == 0) return;   // no rows (e.g. a step that samples none): nothing to compute
  TORCH_CHECK(x.scalar_type() == at::kFloat, "fp32 w needs fp32 x, got ", x.scalar_type());
  if (M > kMaxRowsFp32Fp32 && !row_invariant) {
    at::mm_out(y, x, w.t());
    return;
  }
  check_x(x, K);
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == at::kFloat, "w must be contiguous fp32");
  dense_linear<float>(x, w.data_ptr<float>(), kNoScale, y);
}

void linear_bf16_into(const at::Tensor& x, const at::Tensor& w, at::Tensor& y) {
  check_2d(x, w, "w");
  if (w.scalar_type() == at::kFloat) return linear_fp32_into(x, w, y);
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  check_y(y, x, M, N);
  if (M == 0) return;   // no rows (e.g. a step that samples none): nothing to compute
  const bool fp32 = x.scalar_type() == at::kFloat;
  if (!fp32 && M > kMaxRows && !row_invariant) {   // torch's GEMM: at::linear's kernel for 2-D x
    at::mm_out(y, x, w.t());
    return;
  }
  if (fp32 && M > kMaxRowsFp32Bf16 && !row_invariant) {   // prefill: w widened once, fp32 GEMM
    at::mm_out(y, x, w.to(at::kFloat).t());
    return;
  }
  check_x(x, K);
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == at::kBFloat16, "w must be contiguous bf16");
  if (fp32) dense_linear<bf16>(x, w.data_ptr<bf16>(), kNoScale, y);
  else bf16_bf16_linear(x, w, y);
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w) {
  check_2d(x, w, "w");
  if (x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 && x.size(0) > kMaxRows
      && !row_invariant)
    return at::linear(x, w);
  auto y = at::empty({x.size(0), w.size(0)}, x.options());
  linear_bf16_into(x, w, y);
  return y;
}

at::Tensor linear_fp32(const at::Tensor& x, const at::Tensor& w) {
  check_2d(x, w, "w");
  auto y = at::empty({x.size(0), w.size(0)}, x.options());
  linear_fp32_into(x, w, y);
  return y;
}

// ---------------------------------------------------------------------------------------- int8
// Weight-only INT8 (one scale per output row), the format of Int8Linear and of the LM head of
// every quantized model: the dense loop with int8 widened to fp32 (vpmovsxbd, vcvtdq2ps), the
// row's sum times its scale, rounded once (the formula of aten's _weight_int8pack_mm).
void linear_int8_into(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                      at::Tensor& y) {
  check_2d(x, w, "w");
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  check_y(y, x, M, N);
  if (M == 0) return;   // no rows (e.g. a step that samples none): nothing to compute
  const bool fp32 = x.scalar_type() == at::kFloat;
  if (fp32 && M > kMaxRowsFp32Quant && !row_invariant) {   // prefill: w widened and scaled, GEMM
    at::mm_out(y, x, (w.to(at::kFloat) * scale.to(at::kFloat).unsqueeze(1)).t());
    return;
  }
  // aten's kernel crashes (SIGSEGV, torch 2.13) on 2+ rows when K % 16 != 0; such shapes run
  // the loop, tiled.
  if (!fp32 && M > kMaxRows && K % 16 == 0 && !row_invariant) {
    y.copy_(at::_weight_int8pack_mm(x, w, as_x_dtype(scale, x)));
    return;
  }
  check_x(x, K);
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == at::kChar, "w must be contiguous int8");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == N && scale.is_contiguous() &&
              (scale.scalar_type() == at::kBFloat16 || scale.scalar_type() == at::kFloat),
              "scale must be a contiguous (", N, ",) bf16 or fp32 tensor, got ", scale.sizes(),
              " ", scale.scalar_type());
  if (scale.scalar_type() == at::kFloat)
    dense_linear<int8_t>(x, w.data_ptr<int8_t>(), scale.data_ptr<float>(), y);
  else
    dense_linear<int8_t>(x, w.data_ptr<int8_t>(), scale.data_ptr<bf16>(), y);
}

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  check_2d(x, w, "w");
  auto y = at::empty({x.size(0), w.size(0)}, x.options());
  linear_int8_into(x, w, scale, y);
  return y;
}

// ---------------------------------------------------------------------------------------- int4
namespace {

template <class Sc>
void int4_loop(const at::Tensor& x, const uint8_t* w, const Sc* scale, const Sc* minimum,
               int64_t K, int64_t gs, at::Tensor& y) {
  const int64_t M = x.size(0), Kx = x.size(1), N = y.size(1);
  Int4X xp;
  const bool small = gs < kChunk;
#if defined(WB_ISA_AVX512BF16)
  if (x.scalar_type() == at::kBFloat16 && !small) {   // products of bf16 x with 128 + q are exact
    prepare_int4_x(x.data_ptr<bf16>(), M, Kx, K, gs, false, xp);
    bf16* yp = y.data_ptr<bf16>();
    at::parallel_for(0, N, kGrain, [&](int64_t n0, int64_t n1) {
      for_blocks(n0, n1, [&](int64_t b0, int64_t b1) {
        for_tiles<2>(M, [&](auto rows, int64_t m0) {
          int4_rows_bf16<decltype(rows)::value>(xp, m0, w, scale, minimum, yp, N, K, gs, b0, b1);
        });
      });
    });
    return;
  }
#endif
  if (x.scalar_type() == at::kFloat) prepare_int4_x(x.data_ptr<float>(), M, Kx, K, gs, true, xp);
  else prepare_int4_x(x.data_ptr<bf16>(), M, Kx, K, gs, true, xp);
  with_y(y, [&](auto* yp) {
    using Y = std::remove_pointer_t<decltype(yp)>;
    at::parallel_for(0, N, kGrain, [&](int64_t n0, int64_t n1) {
      for_blocks(n0, n1, [&](int64_t b0, int64_t b1) {
        for_tiles<kTileInt4>(M, [&](auto rows, int64_t m0) {
          Y* yt = yp + m0 * N;
          auto finish = [&](int m, int64_t n, float sum) { yt[m * N + n] = static_cast<Y>(sum); };
          if (small) int4_rows_small<decltype(rows)::value>(xp, m0, w, scale, minimum, K, gs, b0, b1, N - 1, finish);
          else int4_rows<decltype(rows)::value>(xp, m0, w, scale, minimum, K, gs, b0, b1, finish);
        });
      });
    });
  });
}

// The (N, K) fp32 weight q * scale + minimum, for fp32 x above the loop's rows.
template <class Sc>
at::Tensor int4_weight_fp32(const uint8_t* w, const Sc* scale, const Sc* minimum, int64_t N,
                            int64_t K, int64_t gs) {
  at::Tensor out = at::empty({N, K}, at::kFloat);
  float* o = out.data_ptr<float>();
  const int64_t G = K / gs;
  at::parallel_for(0, N, kGrain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++)
      for (int64_t g = 0; g < G; g++) {
        const float sc = static_cast<float>(scale[n * G + g]), mn = static_cast<float>(minimum[n * G + g]);
        for (int64_t k = g * gs; k < (g + 1) * gs; k += 2) {
          const uint8_t b = w[(n * K + k) / 2];
          o[n * K + k] = static_cast<float>(b & 0xF) * sc + mn;
          o[n * K + k + 1] = static_cast<float>(b >> 4) * sc + mn;
        }
      }
  });
  return out;
}

}  // namespace

// x (M, Kx) bf16 or fp32 with Kx <= K, read as zero-padded to K (whole groups; no copy for the
// loops); packed (N, K/2) uint8; scale, minimum
// (N, K/gs) bf16 or fp32. bf16 x above the loop's rows runs aten's kernel on its own layout of the
// same weights (aten_packed, aten_scale_zero: Int4Linear._aten_pack), as the layer does without
// this kernel; fp32 x there, torch's fp32 GEMM on the widened weight.
void linear_int4_into(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                      const at::Tensor& minimum, int64_t group_size, const at::Tensor& aten_packed,
                      const at::Tensor& aten_scale_zero, at::Tensor& y) {
  check_2d(x, packed, "packed");
  const int64_t M = x.size(0), N = packed.size(0), K = packed.size(1) * 2, Kx = x.size(1);
  check_y(y, x, M, N);
  if (M == 0) return;   // no rows (e.g. a step that samples none): nothing to compute
  TORCH_CHECK(Kx > 0 && Kx <= K && x.is_contiguous() &&
              (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "x must be a contiguous (M, K) bf16 or fp32 tensor with K <= ", K,
              " (zero-padded to it), got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(group_size > 0 && group_size % 2 == 0 && K % group_size == 0,
              "group_size must be even and divide ", K, ", got ", group_size);
  const bool fp32 = x.scalar_type() == at::kFloat;
  // The loops take groups of 128k and groups of 8 to 64, up to their row limits; above them bf16
  // x takes aten's kernel where aten takes the group size. The rest widens the weight to fp32.
  const bool fits_loops = group_size % kChunk == 0 || small_int4_group(group_size);
  const bool aten_group = group_size == 32 || group_size == 64 || group_size == 128 || group_size == 256;
#if defined(WB_ISA_AVX512BF16)
  const bool small_to_aten = group_size % kChunk != 0;   // aten's kernel is native bf16 here
#else
  const bool small_to_aten = false;
#endif
  if (!fp32 && (M > kMaxRows || !fits_loops || small_to_aten) && aten_group && !row_invariant) {
    const at::Tensor xp = Kx == K ? x : at::constant_pad_nd(x, {0, K - Kx});
    y.copy_(at::_weight_int4pack_mm_for_cpu(
        xp, aten_packed, group_size, aten_scale_zero_for(x, scale, minimum, aten_scale_zero)));
    return;
  }
  TORCH_CHECK(packed.is_contiguous() && packed.scalar_type() == at::kByte, "packed must be contiguous uint8");
  const int64_t G = K / group_size;
  for (const at::Tensor* t : {&scale, &minimum})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == N && t->size(1) == G && t->is_contiguous() &&
                t->scalar_type() == scale.scalar_type() &&
                (t->scalar_type() == at::kBFloat16 || t->scalar_type() == at::kFloat),
                "scale and minimum must be contiguous (", N, ", ", G, ") tensors, both bf16 or "
                "both fp32, got ", t->sizes(), " ", t->scalar_type());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  // prefill (fp32 x above the loop's rows) or groups the loops do not take: widened, then a GEMM
  const bool wide = !fits_loops || (M > (fp32 ? kMaxRowsFp32Quant : kMaxRows) && !row_invariant);
  auto widened = [&](const at::Tensor& w32) {
    if (row_invariant) {
      const at::Tensor w = Kx == K ? w32 : w32.narrow(1, 0, Kx).contiguous();
      dense_linear<float>(x, w.data_ptr<float>(), kNoScale, y);
    } else if (fp32) {
      at::mm_out(y, x, w32.narrow(1, 0, Kx).t());
    } else {
      y.copy_(at::mm(x.to(at::kFloat), w32.narrow(1, 0, Kx).t()));
    }
  };
  if (scale.scalar_type() == at::kFloat) {
    const float *sp = scale.data_ptr<float>(), *mp = minimum.data_ptr<float>();
    if (wide) widened(int4_weight_fp32(wp, sp, mp, N, K, group_size));
    else int4_loop(x, wp, sp, mp, K, group_size, y);
  } else {
    const bf16 *sp = scale.data_ptr<bf16>(), *mp = minimum.data_ptr<bf16>();
    if (wide) widened(int4_weight_fp32(wp, sp, mp, N, K, group_size));
    else int4_loop(x, wp, sp, mp, K, group_size, y);
  }
}

at::Tensor linear_int4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                       const at::Tensor& minimum, int64_t group_size, const at::Tensor& aten_packed,
                       const at::Tensor& aten_scale_zero) {
  check_2d(x, packed, "packed");
  auto y = at::empty({x.size(0), packed.size(0)}, x.options());
  linear_int4_into(x, packed, scale, minimum, group_size, aten_packed, aten_scale_zero, y);
  return y;
}

// Sets this thread's row-invariant mode and returns the previous setting.
bool set_row_invariant(bool on) {
  const bool previous = row_invariant;
  row_invariant = on;
  return previous;
}

TORCH_LIBRARY(workbench_cpu, m) {
  m.def("set_row_invariant(bool on) -> bool", &set_row_invariant);
  m.def("linear_int4(Tensor x, Tensor packed, Tensor scale, Tensor minimum, int group_size, "
        "Tensor aten_packed, Tensor aten_scale_zero) -> Tensor");
  m.def("linear_bf16(Tensor x, Tensor w) -> Tensor");
  m.def("linear_fp32(Tensor x, Tensor w) -> Tensor");
  m.def("linear_int8(Tensor x, Tensor w, Tensor scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(workbench_cpu, CPU, m) {
  m.impl("linear_bf16", &linear_bf16);
  m.impl("linear_fp32", &linear_fp32);
  m.impl("linear_int8", &linear_int8);
  m.impl("linear_int4", &linear_int4);
}
