// Paged decode attention for CPUs (every build of kernels/cpu: AVX-512 BF16, AVX-512, AVX2, and a
// portable one for ARM and others): each new query reads its sequence's keys and values where they
// lie in the block pool, with no gather into a padded batch. fp32 arithmetic is ATen's
// Vectorized<float>; bf16 conversions, the bf16 dot product and the transpose-sums are per ISA
// (vec_math.h).
//
// Why hand-written: the plain-PyTorch backend (workbench/attention/torch_backend.py) copies every
// sequence's K/V out of the paged cache into a padded (n, max_len) batch and then calls SDPA, so in
// a decode step of a large batch the cache is read twice and written once, per layer, and the
// shorter sequences pay for the padding, a large share of a batched decode step (`python -m
// workbench.bench.cpu_attention bf16` times gather + SDPA against this kernel on the offline-mixed
// decode shape). This kernel reads each K/V row once, in place, as vLLM's CPU paged attention does.
//
// out[s, h] = softmax(scale * q[s, h] . K[s, kvh(h)]^T) V[s, kvh(h)] over the sequence's
// seq_lens[s] cached positions (a decode query sees its whole context, itself included).
// Position t of sequence s is slot block_tables[s, t / block_size] * block_size + t % block_size.
//
// Three kernels. bf16 with a compiled-in shape (G <= 4, D = 64 or 128) runs attend_rows: a task
// is a whole sequence (all its kv heads, so whole cache rows are read), with rows prefetched
// ahead and scores computed 16 positions at a time. Otherwise work is split by (sequence, kv
// head): attend_fixed for fp32 with a compiled-in shape, attend_one for any other. In all, the
// G = H / KVH query heads that share a kv head (grouped-query attention) load each key and value
// row once. Scores, softmax and the weighted sum of values are in fp32; the result is rounded to
// the query's dtype once. Each
// sequence is computed on its own, so its result does not depend on which others share its step
// (the padded SDPA path gives the same property only up to the padding's rounding).
#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <cstring>

#include "vec_math.h"
#include "ops.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

using bf16 = c10::BFloat16;
using wb::Vec;
using wb::kLanes;

// Softmax of one row in place, left unnormalized (e^(x - max)); returns 1 / their sum, which is
// applied once to the output instead of to every probability.
inline float softmax_unnormalized(float* row, int64_t L) {
  Vec mx(-INFINITY);
  int64_t t = 0;
  for (; t + kLanes <= L; t += kLanes) mx = wb::vmax(mx, Vec::loadu(row + t));
  float m = wb::reduce_max(mx);
  for (; t < L; ++t) m = std::max(m, row[t]);
  Vec sum(0.0f);
  const Vec mv(m);
  for (t = 0; t + kLanes <= L; t += kLanes) {
    const Vec e = wb::exp_nonpositive(Vec::loadu(row + t) - mv);
    e.store(row + t);
    sum = sum + e;
  }
  if (t < L) {                                      // lanes past L are not stored, not summed
    const int n = static_cast<int>(L - t);
    wb::exp_nonpositive(Vec::loadu(row + t, n) - mv).store(row + t, n);
    sum = sum + Vec::loadu(row + t, n);
  }
  return 1.0f / wb::reduce_add(sum);
}

// One (sequence, kv head): G query heads of D dims against L cached positions (the shapes
// attend_rows below does not compile in).
template <typename T>
void attend_one(const T* q, const T* k_cache, const T* v_cache, T* out, const int64_t* blocks,
                int64_t L, int64_t block_size, int64_t kv_stride, int64_t G, int64_t D,
                float scale, std::vector<float>& buf) {
  const int64_t chunks = D / kLanes;
  buf.resize(G * D + G * L + G * D + G);
  float* qf = buf.data();            // (G, D) queries, pre-scaled
  float* scores = qf + G * D;        // (G, L)
  float* acc = scores + G * L;       // (G, D) weighted sum of values
  float* inv = acc + G * D;          // (G,) 1 / sum of each head's exponentials
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < chunks; ++c)
      (wb::load(q + g * D + c * kLanes) * Vec(scale)).store(qf + g * D + c * kLanes);

  // Positions are walked block by block: the slot of position t is block start + offset, with no
  // division per position.
  for (int64_t t0 = 0; t0 < L; t0 += block_size) {   // scores: each key row loaded once for G heads
    const T* kb = k_cache + blocks[t0 / block_size] * block_size * kv_stride;
    const int64_t n = std::min(block_size, L - t0);
    for (int64_t j = 0; j < n; ++j) {
      const T* k = kb + j * kv_stride;
      for (int64_t g = 0; g < G; ++g) {
        Vec s(0.0f);
        for (int64_t c = 0; c < chunks; ++c)
          s = at::vec::fmadd(Vec::loadu(qf + g * D + c * kLanes), wb::load(k + c * kLanes), s);
        scores[g * L + t0 + j] = wb::reduce_add(s);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    inv[g] = softmax_unnormalized(scores + g * L, L);
    std::fill(acc + g * D, acc + (g + 1) * D, 0.0f);
  }
  for (int64_t t0 = 0; t0 < L; t0 += block_size) {   // weighted sum: each value row loaded once
    const T* vb = v_cache + blocks[t0 / block_size] * block_size * kv_stride;
    const int64_t n = std::min(block_size, L - t0);
    for (int64_t j = 0; j < n; ++j) {
      const T* v = vb + j * kv_stride;
      for (int64_t c = 0; c < chunks; ++c) {
        const Vec vv = wb::load(v + c * kLanes);
        for (int64_t g = 0; g < G; ++g) {
          float* a = acc + g * D + c * kLanes;
          at::vec::fmadd(Vec(scores[g * L + t0 + j]), vv, Vec::loadu(a)).store(a);
        }
      }
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < chunks; ++c)
      wb::store(out + g * D + c * kLanes, Vec::loadu(acc + g * D + c * kLanes) * Vec(inv[g]));
}

// Row j of the block at `ahead` (nullptr: none), this head's kD values, prefetched into L1. With
// each row read, attend_fixed fetches the same row of the next block (of K; in K's last block, of
// V's first), so the next block is in flight while this one is computed: blocks lie anywhere in
// the pool, and the hardware prefetcher loses the stream at every block boundary. It speeds a
// layer call up on the offline-mixed decode shape, while whole blocks two ahead into L2 gain
// nothing (python -m workbench.bench.cpu_attention fp32 --against DIR, DIR without it).
template <typename T, int kD>
inline void prefetch_head_row(const T* ahead, int64_t j, int64_t kv_stride) {
  if (ahead == nullptr) return;
  const char* row = reinterpret_cast<const char*>(ahead + j * kv_stride);
  for (int64_t o = 0; o < kD * static_cast<int64_t>(sizeof(T)); o += 64) __builtin_prefetch(row + o, 0, 3);
}

// The same computation with G and D known at compile time (fp32 caches; G <= 4 query heads per kv
// head, D = 64 or 128): queries and output accumulators live in registers, and the loops over
// heads and chunks unroll, which makes it faster than the general loop above. fp32 stays here
// rather than in attend_rows: an attend_rows<float> was no faster, under AVX512-BF16 or AVX2
// flags. `python -m workbench.bench.cpu_attention fp32 --threads 1` (and with 2 threads) times it
// against gather + SDPA on the offline-mixed decode shape.
template <typename T, int kG, int kD>
void attend_fixed(const T* q, const T* k_cache, const T* v_cache, T* out, const int64_t* blocks,
                  int64_t L, int64_t block_size, int64_t kv_stride, float scale,
                  std::vector<float>& buf) {
  constexpr int kC = kD / kLanes;
  buf.resize(kG * L);
  float* scores = buf.data();        // (G, L)
  Vec qr[kG][kC];
  for (int g = 0; g < kG; ++g)
    for (int c = 0; c < kC; ++c) qr[g][c] = wb::load(q + (g * kC + c) * kLanes) * Vec(scale);
  for (int64_t t0 = 0; t0 < L; t0 += block_size) {
    const T* kb = k_cache + blocks[t0 / block_size] * block_size * kv_stride;
    const int64_t n = std::min(block_size, L - t0);
    const T* ahead = t0 + block_size < L ? k_cache + blocks[t0 / block_size + 1] * block_size * kv_stride
                                         : v_cache + blocks[0] * block_size * kv_stride;
    for (int64_t j = 0; j < n; ++j) {
      prefetch_head_row<T, kD>(ahead, j, kv_stride);
      Vec kr[kC];
      for (int c = 0; c < kC; ++c) kr[c] = wb::load(kb + j * kv_stride + c * kLanes);
      for (int g = 0; g < kG; ++g) {
        Vec s = qr[g][0] * kr[0];
        for (int c = 1; c < kC; ++c) s = at::vec::fmadd(qr[g][c], kr[c], s);
        scores[g * L + t0 + j] = wb::reduce_add(s);
      }
    }
  }
  float inv[kG];
  for (int g = 0; g < kG; ++g) inv[g] = softmax_unnormalized(scores + g * L, L);
  Vec acc[kG][kC];
  for (int g = 0; g < kG; ++g)
    for (int c = 0; c < kC; ++c) acc[g][c] = Vec(0.0f);
  for (int64_t t0 = 0; t0 < L; t0 += block_size) {
    const T* vb = v_cache + blocks[t0 / block_size] * block_size * kv_stride;
    const int64_t n = std::min(block_size, L - t0);
    const T* ahead = t0 + block_size < L ? v_cache + blocks[t0 / block_size + 1] * block_size * kv_stride
                                         : nullptr;
    for (int64_t j = 0; j < n; ++j) {
      prefetch_head_row<T, kD>(ahead, j, kv_stride);
      for (int c = 0; c < kC; ++c) {
        const Vec vv = wb::load(vb + j * kv_stride + c * kLanes);
        for (int g = 0; g < kG; ++g)
          acc[g][c] = at::vec::fmadd(Vec(scores[g * L + t0 + j]), vv, acc[g][c]);
      }
    }
  }
  for (int g = 0; g < kG; ++g)
    for (int c = 0; c < kC; ++c)
      wb::store(out + (g * kC + c) * kLanes, acc[g][c] * Vec(inv[g]));
}

// ---- compiled-in shapes: one sequence's kv heads [h0, h1) in one pass over its blocks -----------
//
// Why: a loop over one (sequence, kv head) at a time reads 128 of every 384 bytes of each bf16
// cache row (SmolLM2: 3 kv heads x 64 dims), and the hardware prefetcher does not follow that
// stride across randomly placed blocks: such a loop reads KV at a fraction of the copy bandwidth,
// and several times faster when one layer's cache sits in L3, so it waits on memory. Here a task
// walks whole cache rows of its sequence (all kv heads at once), prefetches the rows of tiles
// ahead, and computes scores 16 positions at a time (workbench.bench.cpu_attention times it):
// - q.k as dot products straight from the rows (bf16: AVX512-BF16's dpbf16, else a shift-widen
//   and two FMAs; the products are exact in fp32 and summed in fp32), then one transpose-and-add
//   per kLanes positions gives kLanes scores, instead of one horizontal reduction per score;
// - p.V in fp32; bf16 rows widen each 2 * kLanes values by a shift (even dims) and a mask (odd
//   dims), so the accumulators hold the head's dims in even/odd order until the end.
// This runs close to a kernel that only reads the same rows in the same order: what is left is
// mostly the cost of the scattered blocks, not arithmetic. `python -m workbench.bench.cpu_attention
// bf16` measures it on the offline-mixed decode shape (us per layer call, and gather + SDPA / this;
// WORKBENCH_ISA=avx2 for the AVX2 build). The portable source compiles under AVX512-BF16 to the
// same inner loops as hand-written intrinsics (32 dpbf16, 12 FMAs, same prefetches), and runs as
// fast as they do (`--against DIR` with DIR holding the intrinsics, in one process; an A/A run
// shows the noise).

// How a row type is read: kStep values per chunk; a query chunk prepared once (Q) and dotted with
// key chunks; a value chunk widened into kVPer fp32 vectors; the accumulators put back in dim
// order.
// Only bf16 rows are compiled in (fp32 runs attend_fixed, see there).
template <typename T> struct Rows;

template <> struct Rows<bf16> {
  static constexpr int kStep = wb::kPair, kVPer = 2;
  using Q = wb::QPair;
  static Q load_q(const bf16* q) { return wb::load_qpair(q); }
  static Vec dot(Vec acc, const Q& q, const bf16* k) { return wb::dot_pair(acc, q, k); }
  static void values(const bf16* v, Vec* out) { wb::widen_pair(v, out[0], out[1]); }
  static void finish(const float* a, float inv, float* o, int D) {   // even/odd -> dim order
    for (int c = 0; c < D; c += kStep)
      for (int e = 0; e < kLanes; ++e) {
        o[c + 2 * e] = a[c + e] * inv;
        o[c + 2 * e + 1] = a[c + kLanes + e] * inv;
      }
  }
};


// Row pointers of positions [t0, t0 + 16) (nullptr past L), walking the block table.
template <typename T>
inline void tile_rows(const T* cache, const int64_t* blocks, int64_t t0, int64_t L,
                      int64_t block_size, int64_t row_stride, const T* rows[16]) {
  int64_t b = t0 / block_size, off = t0 % block_size;
  for (int j = 0; j < 16; ++j) {
    rows[j] = t0 + j < L ? cache + (blocks[b] * block_size + off) * row_stride : nullptr;
    if (++off == block_size) { off = 0; ++b; }
  }
}

// Rows are prefetched this many tiles ahead into L2. Blocks lie anywhere in the pool, so the
// hardware prefetcher loses the stream at every block boundary. Eight tiles ahead into L2 (the
// first eight issued before the loop) beats no software prefetch, one tile ahead into L1, and 4,
// 12 or 24 tiles ahead (python -m workbench.bench.cpu_attention bf16 --against DIR, DIR with
// another distance).
constexpr int64_t kPrefetchTiles = 8;

template <typename T>
inline void prefetch_rows(const T* const rows[16], int64_t bytes) {
  for (int j = 0; j < 16 && rows[j] != nullptr; ++j)
    for (int64_t o = 0; o < bytes; o += 64)
      wb::prefetch_l2(reinterpret_cast<const char*>(rows[j]) + o);
}

// The rows of the tile at t0, after prefetching the tile kPrefetchTiles ahead (at t0 = 0, also
// every tile before that one: the walk starts with nothing in flight).
template <typename T>
inline void walk_tile(const T* cache, const int64_t* blocks, int64_t t0, int64_t L,
                      int64_t block_size, int64_t row_stride, const T* rows[16]) {
  const T* ahead[16];
  const int64_t last = t0 + 16 * kPrefetchTiles;
  for (int64_t t = t0 == 0 ? 0 : last; t <= last && t < L; t += 16) {
    tile_rows(cache, blocks, t, L, block_size, row_stride, ahead);
    prefetch_rows(ahead, row_stride * static_cast<int64_t>(sizeof(T)));
  }
  tile_rows(cache, blocks, t0, L, block_size, row_stride, rows);
}

// Value chunks accumulated per pass over a tile's rows: all of a head's under AVX-512 (32
// registers), as many as keep kG * kVPer * chunks accumulators within 8 registers elsewhere
// (AVX2 has 16). A budget of 12 (G=3: two chunks a pass) runs slower than 8 on the offline-mixed
// decode shape (`WORKBENCH_ISA=avx2 python -m workbench.bench.cpu_attention bf16 --against DIR`,
// DIR a copy of these sources with 12).
constexpr int chunks_per_pass(int chunks, int accs_per_chunk) {
  const int budget = kLanes >= 16 ? 32 : 8;
  int best = 1;
  for (int c = 1; c <= chunks; ++c)
    if (chunks % c == 0 && c * accs_per_chunk <= budget) best = c;
  return best;
}

// kG query heads per kv head, head_dim kD.
template <typename T, int kG, int kD>
void attend_rows(const T* q, const T* k_cache, const T* v_cache, T* out, const int64_t* blocks,
                 int64_t L, int64_t block_size, int64_t KVH, int64_t h0, int64_t h1, float scale,
                 std::vector<float>& buf) {
  using R = Rows<T>;
  constexpr int kC = kD / R::kStep;                 // chunks per head
  constexpr int kCB = chunks_per_pass(kC, kG * R::kVPer);
  const int64_t row_stride = KVH * kD, nh = h1 - h0;
  const int64_t Lpad = (L + 15) / 16 * 16;
  buf.resize(nh * kG * Lpad + nh * kG * kD);
  float* scores = buf.data();                       // (nh * kG, Lpad)
  float* acc = scores + nh * kG * Lpad;             // (nh * kG, kD), in R's chunk order
  const T* rows[16];
  const Vec vscale(scale);
  for (int64_t t0 = 0; t0 < L; t0 += 16) {          // scores, 16 positions at a time
    walk_tile(k_cache, blocks, t0, L, block_size, row_stride, rows);
    const int n = static_cast<int>(std::min<int64_t>(16, L - t0));
    for (int64_t h = h0; h < h1; ++h)
      for (int g = 0; g < kG; ++g) {
        const T* qh = q + (h * kG + g) * kD;
        typename R::Q qv[kC];
        for (int c = 0; c < kC; ++c) qv[c] = R::load_q(qh + R::kStep * c);
        float* sc = scores + ((h - h0) * kG + g) * Lpad + t0;
        for (int j0 = 0; j0 < n; j0 += kLanes) {
          Vec part[kLanes];
          for (int j = 0; j < kLanes; ++j) {
            part[j] = Vec(0.0f);
            if (j0 + j < n)
              for (int c = 0; c < kC; ++c)
                part[j] = R::dot(part[j], qv[c], rows[j0 + j] + h * kD + R::kStep * c);
          }
          (wb::transpose_sum(part) * vscale).store(sc + j0);
        }
      }
  }
  float inv[64];                                    // kG * KVH <= 64 heads (checked by caller)
  for (int64_t i = 0; i < nh * kG; ++i) {
    inv[i] = softmax_unnormalized(scores + i * Lpad, L);
    std::fill(acc + i * kD, acc + (i + 1) * kD, 0.0f);
  }
  for (int64_t t0 = 0; t0 < L; t0 += 16) {          // weighted sum of values
    walk_tile(v_cache, blocks, t0, L, block_size, row_stride, rows);
    const int n = static_cast<int>(std::min<int64_t>(16, L - t0));
    for (int64_t h = h0; h < h1; ++h) {
      float* ah = acc + (h - h0) * kG * kD;
      const float* p = scores + (h - h0) * kG * Lpad + t0;
      for (int c0 = 0; c0 < kC; c0 += kCB) {
        Vec a[kG][kCB * R::kVPer];
        for (int g = 0; g < kG; ++g)
          for (int i = 0; i < kCB * R::kVPer; ++i)
            a[g][i] = Vec::loadu(ah + g * kD + c0 * R::kStep + kLanes * i);
        for (int j = 0; j < n; ++j) {
          for (int c = 0; c < kCB; ++c) {
            Vec vv[R::kVPer];
            R::values(rows[j] + h * kD + (c0 + c) * R::kStep, vv);
            for (int g = 0; g < kG; ++g) {
              const Vec pg(p[g * Lpad + j]);
              for (int i = 0; i < R::kVPer; ++i)
                a[g][c * R::kVPer + i] = at::vec::fmadd(pg, vv[i], a[g][c * R::kVPer + i]);
            }
          }
        }
        for (int g = 0; g < kG; ++g)
          for (int i = 0; i < kCB * R::kVPer; ++i)
            a[g][i].store(ah + g * kD + c0 * R::kStep + kLanes * i);
      }
    }
  }
  for (int64_t i = 0; i < nh * kG; ++i) {           // back to dim order, normalized, rounded once
    float o[kD];
    R::finish(acc + i * kD, inv[i], o, kD);
    for (int c = 0; c < kD / kLanes; ++c)
      wb::store(out + (h0 * kG + i) * kD + kLanes * c, Vec::loadu(o + kLanes * c));
  }
}

// Runs attend_rows when the shape is compiled in; false otherwise. Tasks are whole sequences,
// longest first and handed out dynamically (lengths in a batch differ by 10x), unless there are
// too few sequences to occupy the threads: then each (sequence, kv head) is a task.
template <typename T>
bool decode_rows(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t block_size,
                 double scale, at::Tensor& out) {
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(1);
  const int64_t G = H / KVH, max_blocks = block_tables.size(1);
  using Fn = void (*)(const T*, const T*, const T*, T*, const int64_t*, int64_t, int64_t, int64_t,
                      int64_t, int64_t, float, std::vector<float>&);
  Fn fn = nullptr;
#define WB_CASE(g, d) if (G == g && D == d) fn = &attend_rows<T, g, d>;
  WB_CASE(1, 64) WB_CASE(2, 64) WB_CASE(3, 64) WB_CASE(4, 64)
  WB_CASE(1, 128) WB_CASE(2, 128) WB_CASE(3, 128) WB_CASE(4, 128)
#undef WB_CASE
  if (fn == nullptr || H > 64) return false;
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
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
#define WB_CASE(g, d) if (G == g && D == d) fixed = &attend_fixed<T, g, d>;
  WB_CASE(1, 64) WB_CASE(2, 64) WB_CASE(3, 64) WB_CASE(4, 64)
  WB_CASE(1, 128) WB_CASE(2, 128) WB_CASE(3, 128) WB_CASE(4, 128)
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
    if (!decode_rows<bf16>(q, k_cache, v_cache, block_tables, seq_lens, block_size, scale, out))
      decode_all<bf16>(q, k_cache, v_cache, block_tables, seq_lens, block_size, scale, out);
  } else {
    decode_all<float>(q, k_cache, v_cache, block_tables, seq_lens, block_size, scale, out);
  }
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
