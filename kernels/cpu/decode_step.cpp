// A whole decode step of a Llama-family model (bf16 activations, CPU) in one operator call: every
// layer's norms, projections, rotary, paged attention and SwiGLU, then the final norm. The
// projections' weights are bf16, INT8 weight-only or group-wise INT4 (weight_kind 0, 1, 2), run
// by the same GEMV functions the layers' own operators run (gemv.cpp), so a fused step computes
// exactly what the unfused one does.
//
// Why: at batch 1 the compiled forward (models/compile.py) spends ~9 ms of a ~12 ms SmolLM2 step
// reading the weights in the GEMV loops, which is the part memory bandwidth sets. Most of the rest
// is calling: ~120 GEMV and ~120 fused-kernel calls from Inductor's Python wrapper, 30 attention
// calls through a Python custom op and the backend, and 336 size asserts (measured with
// torch.profiler on the 2-core AMD EPYC VM: the graph's own time 1.5 ms, the attention op's
// Python 0.4 ms). Here the layer loop is C++ and the small operations between the matmuls are
// AVX-512 loops over a few hundred values, so what remains is the matmuls, the attention kernel and
// one Python call. llama.cpp runs its whole graph in C the same way.
//
// The arithmetic is the eager model's (workbench/models/llama.py), rounding to bf16 where eager
// PyTorch rounds: the residual add; RMSNorm in fp32, rounded, times the weight, rounded; rotary as
// x * cos and rotate_half(x) * sin each rounded, then their sum; silu(gate) rounded, times up,
// rounded. Only the order of fp32 sums (the RMSNorm mean) and the exp of silu (a polynomial, < 1e-7
// relative) differ, so tokens match the eager engine's (tests/test_fused_decode.py).
#include <ATen/ATen.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "avx512_math.h"
#include "ops.h"

namespace {

using bf16 = c10::BFloat16;

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// Masked 16-lane loads and stores, so any length works: lanes past the end read as 0, are not stored.
TARGET inline __mmask16 tail(int64_t i, int64_t n) {
  return n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1);
}
TARGET inline __m512 load16(const bf16* p, __mmask16 m) {   // bf16 is the top half of an fp32
  __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
TARGET inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
TARGET inline __m512 round16(__m512 v) {       // to bf16 and back: round to nearest even, as torch
  __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
TARGET inline void store16(bf16* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}

// out = weight * round(s / rms(s)), where s = round(x + residual) is also stored into residual
// (or, with add false, s = x is copied into it): one row of `n` values.
TARGET void add_rms_norm_row(const bf16* x, bf16* residual, bool add, const bf16* weight,
                             float eps, bf16* out, int64_t n) {
  __m512 sq = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail(i, n);
    __m512 s = load16(x + i, m);
    if (add) s = round16(_mm512_add_ps(s, load16(residual + i, m)));
    store16(residual + i, s, m);
    sq = _mm512_fmadd_ps(s, s, sq);
  }
  const float r = 1.0f / std::sqrt(_mm512_reduce_add_ps(sq) / static_cast<float>(n) + eps);
  const __m512 vr = _mm512_set1_ps(r);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail(i, n);
    __m512 normed = round16(_mm512_mul_ps(load16(residual + i, m), vr));
    store16(out + i, _mm512_mul_ps(load16(weight + i, m), normed), m);
  }
}

// Rotate-half rotary of `heads` vectors of (even) dimension D from src to dst,
// with this token's fp32 cos/sin rows rounded to bf16 first, as the model casts its tables.
TARGET void rotary_row(const bf16* src, bf16* dst, int64_t heads, int64_t D, const float* cos,
                       const float* sin) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 m = tail(i, half);
    const __m512 c1 = round16(load16(cos + i, m)), c2 = round16(load16(cos + half + i, m));
    const __m512 s1 = round16(load16(sin + i, m)), s2 = round16(load16(sin + half + i, m));
    for (int64_t h = 0; h < heads; ++h) {
      const bf16* x = src + h * D;
      const __m512 lo = load16(x + i, m), hi = load16(x + half + i, m);
      // first half: x * cos - x[half:] * sin; second half: x * cos + x[:half] * sin
      const __m512 a1 = round16(_mm512_mul_ps(lo, c1)), b1 = round16(_mm512_mul_ps(hi, s1));
      const __m512 a2 = round16(_mm512_mul_ps(hi, c2)), b2 = round16(_mm512_mul_ps(lo, s2));
      store16(dst + h * D + i, _mm512_sub_ps(a1, b1), m);
      store16(dst + h * D + half + i, _mm512_add_ps(a2, b2), m);
    }
  }
}

// h = round(round(silu(gate)) * up) for one row: gate is gu[:I], up is gu[I:].
TARGET void silu_mul_row(const bf16* gu, bf16* h, int64_t I) {
  const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
  for (int64_t i = 0; i < I; i += 16) {
    const __mmask16 m = tail(i, I);
    const __m512 g = load16(gu + i, m);
    // sigmoid(g) = 1 / (1 + e^-g); with e = e^-|g| <= 1 that is 1/(1+e) for g >= 0, e/(1+e) else
    const __m512 e = exp_nonpositive(_mm512_sub_ps(zero, _mm512_abs_ps(g)));
    const __mmask16 neg = _mm512_cmp_ps_mask(g, zero, _CMP_LT_OQ);
    const __m512 num = _mm512_mask_blend_ps(neg, one, e);
    const __m512 silu = round16(_mm512_mul_ps(g, _mm512_div_ps(num, _mm512_add_ps(one, e))));
    store16(h + i, _mm512_mul_ps(silu, load16(gu + I + i, m)), m);
  }
}

void check_bf16(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.is_contiguous() && t.device().is_cpu(),
              "decode_step: ", name, " must be a contiguous bf16 CPU tensor, got ",
              t.scalar_type(), " ", t.sizes());
}

// One projection list of the step (qkv, o, gate_up or down): per layer, the tensors its layer
// class holds, flattened. bf16: weight (N, K). INT8: qweight (N, K) int8, scale (N,). INT4: packed
// (N, Kp / 2), scale, minimum (N, Kp / group_size), and aten's layout of the same codes
// (aten_packed, aten_scale_zero) for steps of more than 2 rows; Kp is K padded to whole groups,
// so x is copied into a zero-padded buffer first (Int4Linear._pad does the same).
struct Projections {
  at::TensorList t;
  int64_t kind, group_size, per_layer;
  const char* name;

  Projections(at::TensorList t, int64_t kind, int64_t group_size, int64_t layers, const char* name)
      : t(t), kind(kind), group_size(group_size), per_layer(kind == 0 ? 1 : kind == 1 ? 2 : 5),
        name(name) {
    TORCH_CHECK(static_cast<int64_t>(t.size()) == layers * per_layer, "decode_step: ", name,
                " must hold ", per_layer, " tensors per layer for weight_kind ", kind, " (",
                layers * per_layer, " in all), got ", t.size());
  }
  const at::Tensor& at(int64_t l, int64_t i) const { return t[l * per_layer + i]; }
  int64_t rows(int64_t l) const { return at(l, 0).size(0); }

  // y = x @ W_l.T; x (S, K) bf16, y (S, N). `padded` holds x widened to Kp for INT4 (reused).
  void run(int64_t l, const at::Tensor& x, at::Tensor& y, at::Tensor& padded) const {
    if (kind == 0) {
      linear_bf16_into(x, at(l, 0), y);
    } else if (kind == 1) {
      linear_int8_into(x, at(l, 0), at(l, 1), y);
    } else {
      const int64_t K = x.size(1), Kp = at(l, 0).size(1) * 2;
      const at::Tensor* in = &x;
      if (Kp != K) {
        TORCH_CHECK(Kp > K, "decode_step: ", name, "[", l, "] takes ", Kp, " inputs, fewer than ", K);
        if (!padded.defined() || padded.size(0) != x.size(0) || padded.size(1) != Kp)
          padded = at::zeros({x.size(0), Kp}, x.options());   // the pad columns stay zero
        const int64_t S = x.size(0);
        for (int64_t s = 0; s < S; ++s)
          std::memcpy(padded.data_ptr<bf16>() + s * Kp, x.data_ptr<bf16>() + s * K,
                      K * sizeof(bf16));
        in = &padded;
      }
      linear_int4_into(*in, at(l, 0), at(l, 1), at(l, 2), group_size, at(l, 3), at(l, 4), y);
    }
  }
};

}  // namespace

// x: (S, hidden) embeddings of the step's tokens, one decoding token per sequence; positions (S,).
// Per layer l: in_norms[l], post_norms[l] (hidden,); the weights of qkv ((H + 2 KVH) D rows), o
// (hidden rows), gate_up (2 I rows), down (hidden rows), as Projections says; caches (slots, KVH,
// D). cos, sin: fp32 (max_positions, D). Returns the final norm of the last residual stream,
// (S, hidden).
at::Tensor decode_step(const at::Tensor& x, const at::Tensor& positions,
                       at::TensorList in_norms, at::TensorList post_norms, at::TensorList qkv_w,
                       at::TensorList o_w, at::TensorList gate_up_w, at::TensorList down_w,
                       const at::Tensor& final_norm, const at::Tensor& cos,
                       const at::Tensor& sin, at::TensorList k_caches, at::TensorList v_caches,
                       const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                       const at::Tensor& seq_lens, int64_t block_size, double eps,
                       double scale, int64_t num_heads, int64_t num_kv_heads,
                       int64_t weight_kind, int64_t group_size) {
  const int64_t L = static_cast<int64_t>(in_norms.size());
  TORCH_CHECK(weight_kind >= 0 && weight_kind <= 2, "decode_step: weight_kind=", weight_kind,
              " is invalid: 0 (bf16), 1 (INT8) or 2 (INT4)");
  TORCH_CHECK(post_norms.size() == L && k_caches.size() == L && v_caches.size() == L,
              "decode_step: every per-layer list must have ", L, " tensors");
  const Projections qkv(qkv_w, weight_kind, group_size, L, "qkv");
  const Projections o(o_w, weight_kind, group_size, L, "o");
  const Projections gate_up(gate_up_w, weight_kind, group_size, L, "gate_up");
  const Projections down(down_w, weight_kind, group_size, L, "down");
  check_bf16(x, "x");
  TORCH_CHECK(x.dim() == 2, "decode_step: x must be (seqs, hidden), got ", x.sizes());
  const int64_t S = x.size(0), hidden = x.size(1);
  const int64_t D = cos.size(1), H = num_heads, KVH = num_kv_heads;
  TORCH_CHECK(D % 2 == 0, "decode_step: head_dim (", D, ") must be even for rotary");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == S &&
              positions.is_contiguous(), "decode_step: positions must be int64 (seqs,)");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
              cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes(),
              "decode_step: cos and sin must be contiguous fp32 (max_positions, head_dim)");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s)
    TORCH_CHECK(pos[s] >= 0 && pos[s] < cos.size(0), "decode_step: positions[", s, "]=",
                pos[s], " is outside the rotary tables of ", cos.size(0), " positions");
  const int64_t q_size = H * D, kv_size = KVH * D;
  const int64_t I = L > 0 ? gate_up.rows(0) / 2 : 0;

  // Every buffer of the step is allocated once here, not per layer: an allocation is a dispatched
  // operator call, and the point of this loop is to make none inside it.
  auto opts = x.options();
  at::Tensor residual = at::empty({S, hidden}, opts);    // the residual stream
  at::Tensor normed = at::empty({S, hidden}, opts);
  at::Tensor qkv_out = at::empty({S, q_size + 2 * kv_size}, opts);
  at::Tensor q = at::empty({S, H, D}, opts), k = at::empty({S, KVH, D}, opts);
  at::Tensor v = at::empty({S, KVH, D}, opts);
  at::Tensor attn = at::empty({S, q_size}, opts);
  at::Tensor attn3 = attn.view({S, H, D});               // the same memory, as the kernel writes it
  at::Tensor gu = at::empty({S, 2 * I}, opts), h = at::empty({S, I}, opts);
  at::Tensor layer_out = at::empty({S, hidden}, opts);   // a layer's output, not yet added
  at::Tensor attn_proj = at::empty({S, hidden}, opts);
  bf16 *res = residual.data_ptr<bf16>(), *nrm = normed.data_ptr<bf16>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::Tensor padded;                                     // INT4 inputs widened to whole groups

  auto norm = [&](const bf16* in, const at::Tensor& w, bool add) {
    check_bf16(w, "a norm weight");
    TORCH_CHECK(w.numel() == hidden, "decode_step: a norm weight has ", w.numel(),
                " values, expected ", hidden);
    for (int64_t s = 0; s < S; ++s)
      add_rms_norm_row(in + s * hidden, res + s * hidden, add, w.data_ptr<bf16>(), e,
                       nrm + s * hidden, hidden);
  };
  for (int64_t l = 0; l < L; ++l) {
    TORCH_CHECK(qkv.rows(l) == q_size + 2 * kv_size, "decode_step: qkv[", l, "] has ",
                qkv.rows(l), " rows, expected ", q_size + 2 * kv_size);
    // layer 0 normalizes the embeddings, which start the residual stream; later layers add first
    norm(l == 0 ? x.data_ptr<bf16>() : layer_out.data_ptr<bf16>(), in_norms[l], l > 0);
    qkv.run(l, normed, qkv_out, padded);
    const bf16* qp = qkv_out.data_ptr<bf16>();
    for (int64_t s = 0; s < S; ++s) {
      const bf16* row = qp + s * (q_size + 2 * kv_size);
      const float *c = cp + pos[s] * D, *sn = sp + pos[s] * D;
      rotary_row(row, q.data_ptr<bf16>() + s * q_size, H, D, c, sn);
      rotary_row(row + q_size, k.data_ptr<bf16>() + s * kv_size, KVH, D, c, sn);
      std::memcpy(v.data_ptr<bf16>() + s * kv_size, row + q_size + kv_size, kv_size * sizeof(bf16));
    }
    at::Tensor kc = k_caches[l], vc = v_caches[l];
    paged_decode_write_into(q, k, v, kc, vc, slot_mapping, block_tables, seq_lens, block_size,
                            scale, attn3);
    o.run(l, attn, attn_proj, padded);
    norm(attn_proj.data_ptr<bf16>(), post_norms[l], true);
    gate_up.run(l, normed, gu, padded);            // (S, 2 I): gate, then up
    for (int64_t s = 0; s < S; ++s)
      silu_mul_row(gu.data_ptr<bf16>() + s * 2 * I, h.data_ptr<bf16>() + s * I, I);
    down.run(l, h, layer_out, padded);
  }
  at::Tensor out = at::empty({S, hidden}, opts);
  check_bf16(final_norm, "final_norm");
  TORCH_CHECK(final_norm.numel() == hidden, "decode_step: final_norm has ",
              final_norm.numel(), " values, expected ", hidden);
  const bf16* last = L > 0 ? layer_out.data_ptr<bf16>() : x.data_ptr<bf16>();
  for (int64_t s = 0; s < S; ++s)
    add_rms_norm_row(last + s * hidden, res + s * hidden, L > 0, final_norm.data_ptr<bf16>(), e,
                     out.data_ptr<bf16>() + s * hidden, hidden);
  return out;
}

TORCH_LIBRARY_FRAGMENT(workbench_cpu, m) {
  m.def("decode_step(Tensor x, Tensor positions, Tensor[] in_norms, Tensor[] post_norms, "
        "Tensor[] qkv, Tensor[] o, Tensor[] gate_up, Tensor[] down, Tensor final_norm, Tensor cos, "
        "Tensor sin, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens, int block_size, float eps, float scale, "
        "int num_heads, int num_kv_heads, int weight_kind, int group_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(workbench_cpu, CPU, m) {
  m.impl("decode_step", &decode_step);
}
