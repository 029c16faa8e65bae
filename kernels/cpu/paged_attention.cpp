// Paged decode attention for x86 CPUs with AVX-512: each new query reads its sequence's keys and
// values where they lie in the block pool, with no gather into a padded batch.
//
// Why hand-written: the plain-PyTorch backend (workbench/attention/torch_backend.py) copies every
// sequence's K/V out of the paged cache into a padded (n, max_len) batch and then calls SDPA, so in
// a decode step of a large batch the cache is read twice and written once, per layer, and the
// shorter sequences pay for the padding. Measured on the offline-mixed workload (bf16, 48 decoding
// sequences of ~230 tokens, 2-core VM): gather + SDPA took ~50 ms of a 176 ms step. This kernel
// reads each K/V row once, in place, as vLLM's CPU paged attention does.
//
// out[s, h] = softmax(scale * q[s, h] . K[s, kvh(h)]^T) V[s, kvh(h)] over the sequence's
// seq_lens[s] cached positions (a decode query sees its whole context, itself included).
// Position t of sequence s is slot block_tables[s, t / block_size] * block_size + t % block_size.
//
// Two kernels. bf16 with a compiled-in shape (G <= 4, D = 64 or 128) runs attend_rows_bf16: a task
// is a whole sequence (all its kv heads, so whole cache rows are read), with rows prefetched
// ahead and scores computed 16 positions at a time. Otherwise (fp32, other shapes) work is split
// by (sequence, kv head). In both, the G = H / KVH query heads that share a kv head
// (grouped-query attention) load each key and value row once. Scores, softmax and the
// weighted sum of values are in fp32; the result is rounded to the query's dtype once. Each
// sequence is computed on its own, so its result does not depend on which others share its step
// (the padded SDPA path gives the same property only up to the padding's rounding).
#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstring>

#include "avx512_math.h"
#include "ops.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

using bf16 = c10::BFloat16;

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

TARGET inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
TARGET inline __m512 load16(const bf16* p) {   // bf16 is the top half of an fp32: shift it up
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
TARGET inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
TARGET inline void store16(bf16* p, __m512 v) {   // round to nearest even, as torch does
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}

// Softmax of one row in place, left unnormalized (e^(x - max)); returns 1 / their sum, which is
// applied once to the output instead of to every probability.
TARGET inline float softmax_unnormalized(float* row, int64_t L) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + 16 <= L; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(row + t));
  float m = _mm512_reduce_max_ps(mx);
  for (; t < L; ++t) m = std::max(m, row[t]);
  __m512 sum = _mm512_setzero_ps();
  const __m512 mv = _mm512_set1_ps(m);
  for (t = 0; t + 16 <= L; t += 16) {
    __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(row + t), mv));
    _mm512_storeu_ps(row + t, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (t < L) {
    const __mmask16 tail = (__mmask16)((1u << (L - t)) - 1);
    __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, row + t), mv));
    e = _mm512_maskz_mov_ps(tail, e);
    _mm512_mask_storeu_ps(row + t, tail, e);
    sum = _mm512_add_ps(sum, e);
  }
  return 1.0f / _mm512_reduce_add_ps(sum);
}

// One (sequence, kv head): G query heads of D dims against L cached positions.
template <typename T>
TARGET void attend_one(const T* q, const T* k_cache, const T* v_cache, T* out,
                       const int64_t* blocks, int64_t L, int64_t block_size, int64_t kv_stride,
                       int64_t G, int64_t D, float scale, std::vector<float>& buf) {
  const int64_t chunks = D / 16;
  buf.resize(G * D + G * L + G * D + G);
  float* qf = buf.data();            // (G, D) queries, pre-scaled
  float* scores = qf + G * D;        // (G, L)
  float* acc = scores + G * L;       // (G, D) weighted sum of values
  float* inv = acc + G * D;          // (G,) 1 / sum of each head's exponentials
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < chunks; ++c)
      _mm512_storeu_ps(qf + g * D + c * 16,
                       _mm512_mul_ps(load16(q + g * D + c * 16), _mm512_set1_ps(scale)));

  // Positions are walked block by block: the slot of position t is block start + offset, with no
  // division per position.
  for (int64_t t0 = 0; t0 < L; t0 += block_size) {   // scores: each key row loaded once for G heads
    const T* kb = k_cache + blocks[t0 / block_size] * block_size * kv_stride;
    const int64_t n = std::min(block_size, L - t0);
    for (int64_t j = 0; j < n; ++j) {
      const T* k = kb + j * kv_stride;
      for (int64_t g = 0; g < G; ++g) {
        __m512 s = _mm512_setzero_ps();
        for (int64_t c = 0; c < chunks; ++c)
          s = _mm512_fmadd_ps(_mm512_loadu_ps(qf + g * D + c * 16), load16(k + c * 16), s);
        scores[g * L + t0 + j] = _mm512_reduce_add_ps(s);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    inv[g] = softmax_unnormalized(scores + g * L, L);
    for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(acc + g * D + c * 16, _mm512_setzero_ps());
  }
  for (int64_t t0 = 0; t0 < L; t0 += block_size) {   // weighted sum: each value row loaded once
    const T* vb = v_cache + blocks[t0 / block_size] * block_size * kv_stride;
    const int64_t n = std::min(block_size, L - t0);
    for (int64_t j = 0; j < n; ++j) {
      const T* v = vb + j * kv_stride;
      for (int64_t c = 0; c < chunks; ++c) {
        const __m512 vv = load16(v + c * 16);
        for (int64_t g = 0; g < G; ++g) {
          float* a = acc + g * D + c * 16;
          _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(scores[g * L + t0 + j]), vv,
                                              _mm512_loadu_ps(a)));
        }
      }
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < chunks; ++c)
      store16(out + g * D + c * 16,
              _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + c * 16), _mm512_set1_ps(inv[g])));
}

// The same computation with G and D known at compile time (the common shapes: G <= 4 query heads
// per kv head, D = 64 or 128): queries and output accumulators live in registers, and the loops
// over heads and chunks unroll. Measured at 48 sequences x ~230 positions, G=3, D=64, bf16, one
// layer: 0.95 ms with the general loop below, 0.68 ms with this one (2-core VM).
template <typename T, int kG, int kC>
TARGET void attend_fixed(const T* q, const T* k_cache, const T* v_cache, T* out,
                         const int64_t* blocks, int64_t L, int64_t block_size, int64_t kv_stride,
                         float scale, std::vector<float>& buf) {
  buf.resize(kG * L);
  float* scores = buf.data();        // (G, L)
  __m512 qr[kG][kC];
  for (int g = 0; g < kG; ++g)
    for (int c = 0; c < kC; ++c)
      qr[g][c] = _mm512_mul_ps(load16(q + (g * kC + c) * 16), _mm512_set1_ps(scale));
  for (int64_t t0 = 0; t0 < L; t0 += block_size) {
    const T* kb = k_cache + blocks[t0 / block_size] * block_size * kv_stride;
    const int64_t n = std::min(block_size, L - t0);
    for (int64_t j = 0; j < n; ++j) {
      __m512 kr[kC];
      for (int c = 0; c < kC; ++c) kr[c] = load16(kb + j * kv_stride + c * 16);
      for (int g = 0; g < kG; ++g) {
        __m512 s = _mm512_mul_ps(qr[g][0], kr[0]);
        for (int c = 1; c < kC; ++c) s = _mm512_fmadd_ps(qr[g][c], kr[c], s);
        scores[g * L + t0 + j] = _mm512_reduce_add_ps(s);
      }
    }
  }
  float inv[kG];
  for (int g = 0; g < kG; ++g) inv[g] = softmax_unnormalized(scores + g * L, L);
  __m512 acc[kG][kC];
  for (int g = 0; g < kG; ++g)
    for (int c = 0; c < kC; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t t0 = 0; t0 < L; t0 += block_size) {
    const T* vb = v_cache + blocks[t0 / block_size] * block_size * kv_stride;
    const int64_t n = std::min(block_size, L - t0);
    for (int64_t j = 0; j < n; ++j) {
      for (int c = 0; c < kC; ++c) {
        const __m512 vv = load16(vb + j * kv_stride + c * 16);
        for (int g = 0; g < kG; ++g)
          acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * L + t0 + j]), vv, acc[g][c]);
      }
    }
  }
  for (int g = 0; g < kG; ++g)
    for (int c = 0; c < kC; ++c)
      store16(out + (g * kC + c) * 16, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv[g])));
}

// ---- bf16, one sequence's kv heads [h0, h1) in one pass over its blocks ------------------------
//
// Why a second bf16 kernel: attend_fixed above handles one (sequence, kv head) at a time, so it
// reads 128 of every 384 bytes of each cache row (SmolLM2: 3 kv heads x 64 dims x bf16), and the
// hardware prefetcher does not follow that stride across randomly placed blocks. Measured on the
// offline-mixed decode shape (37 sequences of 40-450 positions, 30 layers' caches, 2-core VM):
// 750 us per layer call, 9.5 GB/s of KV read out of 31 GB/s copy bandwidth, but 225 us when one
// layer's cache sits in L3: the kernel waited on memory. Here a task walks whole cache rows of
// its sequence (all kv heads at once), prefetches the next tile of rows, and computes scores 16
// positions at a time:
// - q.k with AVX512-BF16 dot products straight from the bf16 rows (no widening to fp32; the
//   products are exact in fp32 and summed in fp32), then one transpose-and-add of 16 partial
//   vectors gives 16 scores, instead of one horizontal reduction per score;
// - p.V in fp32, widening each 32-value bf16 vector by a shift (even positions) and a mask (odd
//   positions), so the accumulators hold the head's dims in even/odd order until the end.
// Result on that shape: 750 -> ~420 us per layer call (16 GB/s), 225 -> 165 us with the cache in
// L3. A kernel that only reads the same rows in the same order takes ~300-330 us here: what is
// left is mostly the cost of the scattered blocks, not arithmetic.

// Lane j of the result = the sum of the 16 lanes of v[j].
TARGET inline __m512 transpose_sum16(__m512 v[16]) {
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

// Row pointers of positions [t0, t0 + 16) (nullptr past L), walking the block table.
inline void tile_rows(const bf16* cache, const int64_t* blocks, int64_t t0, int64_t L,
                      int64_t block_size, int64_t row_stride, const bf16* rows[16]) {
  int64_t b = t0 / block_size, off = t0 % block_size;
  for (int j = 0; j < 16; ++j) {
    rows[j] = t0 + j < L ? cache + (blocks[b] * block_size + off) * row_stride : nullptr;
    if (++off == block_size) { off = 0; ++b; }
  }
}

// Rows are prefetched this many tiles ahead into L2. Blocks lie anywhere in the pool, so the
// hardware prefetcher loses the stream at every block boundary. Measured on the shape above:
// 750 us per layer call with no software prefetch, ~600 with one tile ahead into L1, ~420 with
// eight tiles ahead into L2 (the first eight issued before the loop); 4, 12 and 24 were slower.
constexpr int64_t kPrefetchTiles = 8;

inline void prefetch_rows(const bf16* const rows[16], int64_t bytes) {
  for (int j = 0; j < 16 && rows[j] != nullptr; ++j)
    for (int64_t o = 0; o < bytes; o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(rows[j]) + o, _MM_HINT_T1);
}

// The rows of the tile at t0, after prefetching the tile kPrefetchTiles ahead (at t0 = 0, also
// every tile before that one: the walk starts with nothing in flight).
inline void walk_tile(const bf16* cache, const int64_t* blocks, int64_t t0, int64_t L,
                      int64_t block_size, int64_t row_stride, const bf16* rows[16]) {
  const bf16* ahead[16];
  const int64_t last = t0 + 16 * kPrefetchTiles;
  for (int64_t t = t0 == 0 ? 0 : last; t <= last && t < L; t += 16) {
    tile_rows(cache, blocks, t, L, block_size, row_stride, ahead);
    prefetch_rows(ahead, row_stride * static_cast<int64_t>(sizeof(bf16)));
  }
  tile_rows(cache, blocks, t0, L, block_size, row_stride, rows);
}

// kG query heads per kv head, kDC = head_dim / 32 bf16 vectors per head.
template <int kG, int kDC>
TARGET void attend_rows_bf16(const bf16* q, const bf16* k_cache, const bf16* v_cache, bf16* out,
                             const int64_t* blocks, int64_t L, int64_t block_size, int64_t KVH,
                             int64_t h0, int64_t h1, float scale, std::vector<float>& buf) {
  constexpr int D = 32 * kDC;
  const int64_t row_stride = KVH * D, nh = h1 - h0;
  const int64_t Lpad = (L + 15) / 16 * 16;
  buf.resize(nh * kG * Lpad + nh * kG * D);
  float* scores = buf.data();                       // (nh * kG, Lpad)
  float* acc = scores + nh * kG * Lpad;             // (nh * kG, D), dims in even/odd order
  const bf16* rows[16];
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t t0 = 0; t0 < L; t0 += 16) {          // scores, 16 positions at a time
    walk_tile(k_cache, blocks, t0, L, block_size, row_stride, rows);
    const int n = static_cast<int>(std::min<int64_t>(16, L - t0));
    for (int64_t h = h0; h < h1; ++h)
      for (int g = 0; g < kG; ++g) {
        const bf16* qh = q + (h * kG + g) * D;
        __m512bh qv[kDC];
        for (int c = 0; c < kDC; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qh + 32 * c);
        __m512 part[16];
        for (int j = 0; j < 16; ++j) {
          part[j] = _mm512_setzero_ps();
          if (j < n)
            for (int c = 0; c < kDC; ++c)
              part[j] = _mm512_dpbf16_ps(part[j], qv[c],
                                         (__m512bh)_mm512_loadu_si512(rows[j] + h * D + 32 * c));
        }
        _mm512_storeu_ps(scores + ((h - h0) * kG + g) * Lpad + t0,
                         _mm512_mul_ps(transpose_sum16(part), vscale));
      }
  }
  float inv[64];                                    // kG * KVH <= 64 heads (checked by caller)
  for (int64_t i = 0; i < nh * kG; ++i) {
    inv[i] = softmax_unnormalized(scores + i * Lpad, L);
    std::fill(acc + i * D, acc + (i + 1) * D, 0.0f);
  }
  const __m512i odd_mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t t0 = 0; t0 < L; t0 += 16) {          // weighted sum of values
    walk_tile(v_cache, blocks, t0, L, block_size, row_stride, rows);
    const int n = static_cast<int>(std::min<int64_t>(16, L - t0));
    for (int64_t h = h0; h < h1; ++h) {
      __m512 a[kG][2 * kDC];
      float* ah = acc + (h - h0) * kG * D;
      for (int g = 0; g < kG; ++g)
        for (int c = 0; c < 2 * kDC; ++c) a[g][c] = _mm512_loadu_ps(ah + g * D + 16 * c);
      const float* p = scores + (h - h0) * kG * Lpad + t0;
      for (int j = 0; j < n; ++j) {
        for (int c = 0; c < kDC; ++c) {
          const __m512i raw = _mm512_loadu_si512(rows[j] + h * D + 32 * c);
          const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
          const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(raw, odd_mask));
          for (int g = 0; g < kG; ++g) {
            const __m512 pg = _mm512_set1_ps(p[g * Lpad + j]);
            a[g][2 * c] = _mm512_fmadd_ps(pg, even, a[g][2 * c]);
            a[g][2 * c + 1] = _mm512_fmadd_ps(pg, odd, a[g][2 * c + 1]);
          }
        }
      }
      for (int g = 0; g < kG; ++g)
        for (int c = 0; c < 2 * kDC; ++c) _mm512_storeu_ps(ah + g * D + 16 * c, a[g][c]);
    }
  }
  for (int64_t i = 0; i < nh * kG; ++i) {           // back to dim order, normalized, rounded once
    const float* ai = acc + i * D;
    float o[D];
    for (int c = 0; c < kDC; ++c)
      for (int e = 0; e < 16; ++e) {
        o[32 * c + 2 * e] = ai[32 * c + e] * inv[i];
        o[32 * c + 2 * e + 1] = ai[32 * c + 16 + e] * inv[i];
      }
    for (int c = 0; c < 2 * kDC; ++c) store16(out + (h0 * kG + i) * D + 16 * c, load16(o + 16 * c));
  }
}

// Runs attend_rows_bf16 when the shape is compiled in; false otherwise. Tasks are whole
// sequences, longest first and handed out dynamically (lengths in a batch differ by 10x), unless
// there are too few sequences to occupy the threads: then each (sequence, kv head) is a task.
bool decode_rows_bf16(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens,
                      int64_t block_size, double scale, at::Tensor& out) {
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(1);
  const int64_t G = H / KVH, max_blocks = block_tables.size(1);
  using Fn = void (*)(const bf16*, const bf16*, const bf16*, bf16*, const int64_t*, int64_t,
                      int64_t, int64_t, int64_t, int64_t, float, std::vector<float>&);
  Fn fn = nullptr;
#define WB_CASE(g, c) if (G == g && D == 32 * c) fn = &attend_rows_bf16<g, c>;
  WB_CASE(1, 2) WB_CASE(2, 2) WB_CASE(3, 2) WB_CASE(4, 2)
  WB_CASE(1, 4) WB_CASE(2, 4) WB_CASE(3, 4) WB_CASE(4, 4)
#undef WB_CASE
  if (fn == nullptr || H > 64) return false;
  const bf16* qp = q.data_ptr<bf16>();
  const bf16* kp = k_cache.data_ptr<bf16>();
  const bf16* vp = v_cache.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t per_task = S >= 2 * at::get_num_threads() ? KVH : 1;   // kv heads per task
  std::vector<int64_t> order(S);
  for (int64_t s = 0; s < S; ++s) order[s] = s;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return lens[a] > lens[b]; });
  const int64_t tasks = S * (KVH / per_task);
  const float sc = static_cast<float>(scale);
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<float> buf;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < tasks; ++i) {
      const int64_t s = order[i / (KVH / per_task)], h0 = (i % (KVH / per_task)) * per_task;
      fn(qp + s * H * D, kp, vp, op + s * H * D, bt + s * max_blocks, lens[s], block_size, KVH,
         h0, h0 + per_task, sc, buf);
    }
  }
  return true;
}

template <typename T>
void decode_all(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t block_size,
                double scale, at::Tensor& out) {
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(1);
  const int64_t G = H / KVH, max_blocks = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  using Fixed = void (*)(const T*, const T*, const T*, T*, const int64_t*, int64_t, int64_t,
                         int64_t, float, std::vector<float>&);
  Fixed fixed = nullptr;
#define WB_CASE(g, c) if (G == g && D == 16 * c) fixed = &attend_fixed<T, g, c>;
  WB_CASE(1, 4) WB_CASE(2, 4) WB_CASE(3, 4) WB_CASE(4, 4)
  WB_CASE(1, 8) WB_CASE(2, 8) WB_CASE(4, 8)
#undef WB_CASE
  at::parallel_for(0, S * KVH, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> buf;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t s = i / KVH, h = i % KVH;
      if (fixed != nullptr)
        fixed(qp + (s * H + h * G) * D, kp + h * D, vp + h * D, op + (s * H + h * G) * D,
              bt + s * max_blocks, lens[s], block_size, KVH * D, static_cast<float>(scale), buf);
      else
        attend_one<T>(qp + (s * H + h * G) * D, kp + h * D, vp + h * D, op + (s * H + h * G) * D,
                      bt + s * max_blocks, lens[s], block_size, KVH * D, G, D,
                      static_cast<float>(scale), buf);
    }
  });
}

}  // namespace

// Outside the anonymous namespace: decode_step.cpp calls the *_into forms directly (ops.h).
void paged_decode_into(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_tables, const at::Tensor& seq_lens,
                       int64_t block_size, double scale, at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3,
              "paged_decode: q must be (seqs, heads, dim) and caches (slots, kv_heads, dim)");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "paged_decode: q and the caches must share a dtype, got ", q.scalar_type(), ", ",
              k_cache.scalar_type(), " and ", v_cache.scalar_type());
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat,
              "paged_decode: dtype must be bfloat16 or float32, got ", q.scalar_type());
  TORCH_CHECK(q.size(2) % 16 == 0 && q.size(2) == k_cache.size(2),
              "paged_decode: head_dim must be a multiple of 16 and match the cache, got ",
              q.size(2), " and ", k_cache.size(2));
  TORCH_CHECK(k_cache.size(1) > 0 && q.size(1) % k_cache.size(1) == 0,
              "paged_decode: heads (", q.size(1), ") must be a multiple of kv heads (",
              k_cache.size(1), ")");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "paged_decode: block_tables and seq_lens must be int64");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) &&
              seq_lens.numel() == q.size(0),
              "paged_decode: block_tables (seqs, max_blocks) and seq_lens (seqs,) must have one "
              "row per query");
  TORCH_CHECK(block_size > 0, "paged_decode: block_size must be positive, got ", block_size);
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              block_tables.is_contiguous() && seq_lens.is_contiguous(),
              "paged_decode: every tensor must be contiguous");
  const int64_t max_len = block_tables.size(1) * block_size;
  const int64_t slots = k_cache.size(0);
  auto lens = seq_lens.accessor<int64_t, 1>();
  auto bt = block_tables.accessor<int64_t, 2>();
  for (int64_t s = 0; s < q.size(0); ++s) {   // bounds first: a bad index must not read memory
    TORCH_CHECK(lens[s] >= 1 && lens[s] <= max_len, "paged_decode: seq_lens[", s, "]=", lens[s],
                " must be in [1, ", max_len, "] (block_tables' width x block_size)");
    for (int64_t b = 0; b < (lens[s] + block_size - 1) / block_size; ++b)
      TORCH_CHECK(bt[s][b] >= 0 && (bt[s][b] + 1) * block_size <= slots,
                  "paged_decode: block_tables[", s, ", ", b, "]=", bt[s][b],
                  " is outside the cache of ", slots / block_size, " blocks");
  }
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() &&
              out.is_contiguous(), "paged_decode: out must be a contiguous tensor like q");
  if (q.scalar_type() == at::kBFloat16) {
    if (!decode_rows_bf16(q, k_cache, v_cache, block_tables, seq_lens, block_size, scale, out))
      decode_all<bf16>(q, k_cache, v_cache, block_tables, seq_lens, block_size, scale, out);
  } else
    decode_all<float>(q, k_cache, v_cache, block_tables, seq_lens, block_size, scale, out);
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        int64_t block_size, double scale) {
  at::Tensor out = at::empty_like(q);
  paged_decode_into(q, k_cache, v_cache, block_tables, seq_lens, block_size, scale, out);
  return out;
}

// The same, after writing this step's keys and values (one token per sequence) into the caches at
// slot_mapping: a decode-only step then costs one operator call per layer instead of three (two
// index_copy_ and the attention), which at batch 1 is a few percent of the step.
void paged_decode_write_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             at::Tensor& k_cache, at::Tensor& v_cache,
                             const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                             const at::Tensor& seq_lens, int64_t block_size, double scale,
                             at::Tensor& out) {
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes() && k.size(0) == q.size(0) &&
              k.size(1) == k_cache.size(1) && k.size(2) == k_cache.size(2),
              "paged_decode_write: k and v must be (seqs, kv_heads, dim) like the cache rows, got ",
              k.sizes(), " and ", v.sizes());
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type(),
              "paged_decode_write: k and v must have the caches' dtype");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && k_cache.is_contiguous() &&
              v_cache.is_contiguous(), "paged_decode_write: every tensor must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
              slot_mapping.numel() == q.size(0) && slot_mapping.is_contiguous(),
              "paged_decode_write: slot_mapping must be int64 (seqs,)");
  const int64_t slots = k_cache.size(0), row = k.size(1) * k.size(2);
  const int64_t* sm = slot_mapping.data_ptr<int64_t>();
  for (int64_t s = 0; s < q.size(0); ++s)
    TORCH_CHECK(sm[s] >= 0 && sm[s] < slots, "paged_decode_write: slot_mapping[", s, "]=", sm[s],
                " is outside the cache of ", slots, " slots");
  const int64_t bytes = row * k.element_size();
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  for (int64_t s = 0; s < q.size(0); ++s) {
    std::memcpy(kc + sm[s] * bytes, static_cast<const char*>(k.data_ptr()) + s * bytes, bytes);
    std::memcpy(vc + sm[s] * bytes, static_cast<const char*>(v.data_ptr()) + s * bytes, bytes);
  }
  paged_decode_into(q, k_cache, v_cache, block_tables, seq_lens, block_size, scale, out);
}

at::Tensor paged_decode_write(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              at::Tensor& k_cache, at::Tensor& v_cache,
                              const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                              const at::Tensor& seq_lens, int64_t block_size, double scale) {
  at::Tensor out = at::empty_like(q);
  paged_decode_write_into(q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
                          block_size, scale, out);
  return out;
}

TORCH_LIBRARY_FRAGMENT(workbench_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, int block_size, float scale) -> Tensor");
  m.def("paged_decode_write(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, int block_size, float scale) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(workbench_cpu, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("paged_decode_write", &paged_decode_write);
}
