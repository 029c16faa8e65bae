// A whole decode step of a Llama-family model (bf16 or fp32 activations, CPU) in one operator call:
// every layer's norms, projections, rotary, paged attention and SwiGLU, then the final norm. The
// projections' weights are bf16, INT8 weight-only, group-wise INT4 or fp32 (weight_kind 0, 1, 2,
// 3; fp32 only with fp32 activations), run by the same GEMV functions the layers' own operators
// run (gemv.cpp), so a fused step computes what the unfused one does. Each layer's number of
// query heads is its own, read from its qkv rows, so a model with heads pruned per layer runs
// fused too.
//
// Why: at batch 1 the compiled forward (models/compile.py) spends most of a SmolLM2 step reading
// the weights in the GEMV loops, which is the part memory bandwidth sets. Most of the rest is
// calling: a GEMV and a fused-kernel call per projection from Inductor's Python wrapper, 30
// attention calls through a Python custom op and the backend, and a few hundred size asserts
// (torch.profiler over a compiled decode step shows each). Here the layer loop is C++ and the
// small operations between the matmuls are vector loops over a few hundred values, so what
// remains is the matmuls, the attention kernel and one Python call. llama.cpp runs its whole
// graph in C the same way. `python -m workbench.bench.cpu_decode_step bf16 int4` measures what it
// gains with fp32 activations (SmolLM2-135M, batch 1: unfused / fused, medians of alternating
// pairs; WORKBENCH_ISA picks the build).
//
// The arithmetic is the eager model's (workbench/models/llama.py), rounding to bf16 where eager
// PyTorch rounds: the residual add; RMSNorm in fp32, rounded, times the weight, rounded; rotary as
// x * cos and rotate_half(x) * sin each rounded, then their sum; silu(gate) rounded, times up,
// rounded. Only the order of fp32 sums (the RMSNorm mean) and the exp of silu (a polynomial, < 1e-7
// relative) differ, so tokens match the eager engine's (tests/test_fused_decode.py). fp32
// activations round nowhere, so there the same steps differ from eager by fp32 rounding only.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "ops.h"
#include "vec_math.h"

namespace {

using bf16 = c10::BFloat16;
using wb::Vec;
using wb::kLanes;

// Rounding where eager PyTorch rounds: to bf16 and back for bf16 activations, nothing for fp32.
inline Vec rounded(Vec v, const bf16*) { return wb::round_bf16(v); }
inline Vec rounded(Vec v, const float*) { return v; }

// The lanes of [i, n) from p: a whole vector, or the tail (lanes past n read as 0, not stored).
inline int lanes(int64_t i, int64_t n) {
  return static_cast<int>(std::min<int64_t>(kLanes, n - i));
}

// out = weight * round(s / rms(s)), where s = round(x + residual) is also stored into residual
// (or, with add false, s = x is copied into it): one row of `n` values.
template <typename T>
void add_rms_norm_row(const T* x, T* residual, bool add, const T* weight, float eps, T* out,
                      int64_t n) {
  Vec sq(0.0f);
  for (int64_t i = 0; i < n; i += kLanes) {
    const int m = lanes(i, n);
    Vec s = wb::load(x + i, m);
    if (add) s = rounded(s + wb::load(residual + i, m), x);
    wb::store(residual + i, s, m);
    sq = at::vec::fmadd(s, s, sq);
  }
  const float r = 1.0f / std::sqrt(wb::reduce_add(sq) / static_cast<float>(n) + eps);
  const Vec vr(r);
  for (int64_t i = 0; i < n; i += kLanes) {
    const int m = lanes(i, n);
    const Vec normed = rounded(wb::load(residual + i, m) * vr, x);
    wb::store(out + i, wb::load(weight + i, m) * normed, m);
  }
}

// Rotate-half rotary of `heads` vectors of (even) dimension D from src to dst, with this token's
// fp32 cos/sin rows rounded to the activation dtype first, as the model casts its tables.
template <typename T>
void rotary_row(const T* src, T* dst, int64_t heads, int64_t D, const float* cos,
                const float* sin) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; i += kLanes) {
    const int m = lanes(i, half);
    const Vec c1 = rounded(wb::load(cos + i, m), src);
    const Vec c2 = rounded(wb::load(cos + half + i, m), src);
    const Vec s1 = rounded(wb::load(sin + i, m), src);
    const Vec s2 = rounded(wb::load(sin + half + i, m), src);
    for (int64_t h = 0; h < heads; ++h) {
      const T* x = src + h * D;
      const Vec lo = wb::load(x + i, m), hi = wb::load(x + half + i, m);
      // first half: x * cos - x[half:] * sin; second half: x * cos + x[:half] * sin (each product
      // rounded, then their sum: no FMA, as eager)
      const Vec a1 = rounded(lo * c1, src), b1 = rounded(hi * s1, src);
      const Vec a2 = rounded(hi * c2, src), b2 = rounded(lo * s2, src);
      wb::store(dst + h * D + i, a1 - b1, m);
      wb::store(dst + h * D + half + i, a2 + b2, m);
    }
  }
}

// h = round(round(silu(gate)) * up) for one row: gate is gu[:I], up is gu[I:].
template <typename T>
void silu_mul_row(const T* gu, T* h, int64_t I) {
  const Vec one(1.0f), zero(0.0f);
  for (int64_t i = 0; i < I; i += kLanes) {
    const int m = lanes(i, I);
    const Vec g = wb::load(gu + i, m);
    // sigmoid(g) = 1 / (1 + e^-g); with e = e^-|g| <= 1 that is 1/(1+e) for g >= 0, e/(1+e) else
    const Vec e = wb::exp_nonpositive(zero - g.abs());
    const Vec num = Vec::blendv(one, e, g < zero);
    const Vec silu = rounded(g * (num / (one + e)), gu);
    wb::store(h + i, silu * wb::load(gu + I + i, m), m);
  }
}

void check_act(const at::Tensor& t, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.scalar_type() == dtype && t.is_contiguous() && t.device().is_cpu(),
              "decode_step: ", name, " must be a contiguous ", dtype, " CPU tensor like x, got ",
              t.scalar_type(), " ", t.sizes());
}

// One projection list of the step (qkv, o, gate_up or down): per layer, the tensors its layer
// class holds, flattened. bf16 (kind 0): weight (N, K). INT8 (1): qweight (N, K) int8, scale (N,).
// INT4 (2): packed (N, Kp / 2), scale, minimum (N, Kp / group), and aten's layout of the same
// codes (aten_packed, aten_scale_zero) for steps of more than 2 rows; Kp is K padded to whole
// groups, so x is copied into a zero-padded buffer first (Int4Linear._pad does the same). fp32
// (3): weight (N, K), for fp32 activations.
struct Projections {
  at::TensorList t;
  int64_t kind, per_layer;
  const char* name;

  Projections(at::TensorList t, int64_t kind, int64_t layers, const char* name)
      : t(t), kind(kind), per_layer(kind == 1 ? 2 : kind == 2 ? 5 : 1),
        name(name) {
    TORCH_CHECK(static_cast<int64_t>(t.size()) == layers * per_layer, "decode_step: ", name,
                " must hold ", per_layer, " tensors per layer for weight_kind ", kind, " (",
                layers * per_layer, " in all), got ", t.size());
  }
  const at::Tensor& at(int64_t l, int64_t i) const { return t[l * per_layer + i]; }
  int64_t rows(int64_t l) const { return at(l, 0).size(0); }

  // y = x @ W_l.T; x (S, K), y (S, N), both of the activation dtype. `padded` holds x widened to
  // Kp for INT4 (reused).
  void run(int64_t l, const at::Tensor& x, at::Tensor& y, at::Tensor& padded) const {
    if (kind == 0) {
      linear_bf16_into(x, at(l, 0), y);
    } else if (kind == 1) {
      linear_int8_into(x, at(l, 0), at(l, 1), y);
    } else if (kind == 3) {
      TORCH_CHECK(at(l, 0).scalar_type() == at::kFloat && x.scalar_type() == at::kFloat,
                  "decode_step: weight_kind 3 takes fp32 weights and fp32 x; ", name, "[", l,
                  "] is ", at(l, 0).scalar_type(), " and x ", x.scalar_type());
      linear_fp32_into(x, at(l, 0), y);
    } else {
      const int64_t K = x.size(1), Kp = at(l, 0).size(1) * 2;
      const at::Tensor* in = &x;
      if (Kp != K) {
        TORCH_CHECK(Kp > K, "decode_step: ", name, "[", l, "] takes ", Kp, " inputs, fewer than ", K);
        if (!padded.defined() || padded.size(0) != x.size(0) || padded.size(1) != Kp ||
            padded.scalar_type() != x.scalar_type())
          padded = at::zeros({x.size(0), Kp}, x.options());   // the pad columns stay zero
        const int64_t S = x.size(0), bytes = x.element_size();
        for (int64_t s = 0; s < S; ++s)
          std::memcpy(static_cast<char*>(padded.data_ptr()) + s * Kp * bytes,
                      static_cast<const char*>(x.data_ptr()) + s * K * bytes, K * bytes);
        in = &padded;
      }
      // each projection's own group size (mixed precision gives them different ones)
      const int64_t group = Kp / at(l, 1).size(1);
      linear_int4_into(*in, at(l, 0), at(l, 1), at(l, 2), group, at(l, 3), at(l, 4), y);
    }
  }
};

// The shapes and tensors of one step, checked once (decode_step below).
struct Step {
  const at::Tensor &x, &positions;
  at::TensorList in_norms, post_norms;
  const Projections &qkv, &o, &gate_up, &down;
  const at::Tensor &final_norm, &cos, &sin;
  at::TensorList k_caches, v_caches;
  const at::Tensor &slot_mapping, &block_tables, &seq_lens;
  int64_t block_size;
  double eps, scale;
  int64_t H, KVH;
};

// The buffers of a step whose size is a layer's number of query heads (run_step below).
struct HeadBuffers {
  int64_t heads;
  at::Tensor qkv_out, q, attn, attn3;    // attn3: attn's memory, (S, heads, D), as the kernel
                                         // writes it
};

// The layer loop for activations of type T (bf16 or fp32).
template <typename T>
at::Tensor run_step(const Step& st) {
  const at::Tensor& x = st.x;
  const int64_t L = static_cast<int64_t>(st.in_norms.size());
  const int64_t S = x.size(0), hidden = x.size(1);
  const int64_t D = st.cos.size(1), H = st.H, KVH = st.KVH;
  const int64_t* pos = st.positions.data_ptr<int64_t>();
  const int64_t kv_size = KVH * D;
  const int64_t I = L > 0 ? st.gate_up.rows(0) / 2 : 0;

  // Each layer's own number of query heads, from its qkv rows ((H_l + 2 KVH) D): structured head
  // pruning (workbench/compress/structured.py) leaves layers with fewer than H, a multiple of KVH
  // each, and the kernel's grouped-query mapping (query head i reads kv head i / (H_l / KVH))
  // holds per layer. The KV heads are every layer's KVH.
  std::vector<int64_t> heads(L);
  for (int64_t l = 0; l < L; ++l) {
    const int64_t rows = st.qkv.rows(l), hl = rows / D - 2 * KVH;
    TORCH_CHECK(rows % D == 0 && hl > 0 && hl % KVH == 0 && hl <= H, "decode_step: qkv[", l,
                "] has ", rows, " rows, expected (H_l + 2 * ", KVH, ") * ", D, " with H_l a "
                "multiple of ", KVH, " up to num_heads=", H, " (", (H + 2 * KVH) * D, " unpruned)");
    heads[l] = hl;
  }

  // Every buffer of the step is allocated once here, not per layer: an allocation is a dispatched
  // operator call, and the point of this loop is to make none inside it. The ones whose size is
  // the layer's query heads are allocated once per distinct count (one set unless heads were
  // pruned).
  auto opts = x.options();
  at::Tensor residual = at::empty({S, hidden}, opts);    // the residual stream
  at::Tensor normed = at::empty({S, hidden}, opts);
  std::vector<HeadBuffers> buffers;
  std::vector<int64_t> buffer_of(L);
  for (int64_t l = 0; l < L; ++l) {
    int64_t b = 0;
    while (b < static_cast<int64_t>(buffers.size()) && buffers[b].heads != heads[l]) ++b;
    if (b == static_cast<int64_t>(buffers.size())) {
      const int64_t hl = heads[l];
      at::Tensor attn = at::empty({S, hl * D}, opts);
      buffers.push_back({hl, at::empty({S, (hl + 2 * KVH) * D}, opts), at::empty({S, hl, D}, opts),
                         attn, attn.view({S, hl, D})});
    }
    buffer_of[l] = b;
  }
  at::Tensor k = at::empty({S, KVH, D}, opts);
  at::Tensor v = at::empty({S, KVH, D}, opts);
  at::Tensor gu = at::empty({S, 2 * I}, opts), h = at::empty({S, I}, opts);
  at::Tensor layer_out = at::empty({S, hidden}, opts);   // a layer's output, not yet added
  at::Tensor attn_proj = at::empty({S, hidden}, opts);
  T *res = residual.data_ptr<T>(), *nrm = normed.data_ptr<T>();
  const float *cp = st.cos.data_ptr<float>(), *sp = st.sin.data_ptr<float>();
  const float e = static_cast<float>(st.eps);
  at::Tensor padded;                                     // INT4 inputs widened to whole groups

  auto norm = [&](const T* in, const at::Tensor& w, bool add) {
    check_act(w, x.scalar_type(), "a norm weight");
    TORCH_CHECK(w.numel() == hidden, "decode_step: a norm weight has ", w.numel(),
                " values, expected ", hidden);
    for (int64_t s = 0; s < S; ++s)
      add_rms_norm_row(in + s * hidden, res + s * hidden, add, w.data_ptr<T>(), e,
                       nrm + s * hidden, hidden);
  };
  for (int64_t l = 0; l < L; ++l) {
    HeadBuffers& hb = buffers[buffer_of[l]];
    const int64_t hl = heads[l], q_size = hl * D;
    // layer 0 normalizes the embeddings, which start the residual stream; later layers add first
    norm(l == 0 ? x.data_ptr<T>() : layer_out.data_ptr<T>(), st.in_norms[l], l > 0);
    st.qkv.run(l, normed, hb.qkv_out, padded);
    const T* qp = hb.qkv_out.data_ptr<T>();
    for (int64_t s = 0; s < S; ++s) {
      const T* row = qp + s * (q_size + 2 * kv_size);
      const float *c = cp + pos[s] * D, *sn = sp + pos[s] * D;
      rotary_row(row, hb.q.data_ptr<T>() + s * q_size, hl, D, c, sn);
      rotary_row(row + q_size, k.data_ptr<T>() + s * kv_size, KVH, D, c, sn);
      std::memcpy(v.data_ptr<T>() + s * kv_size, row + q_size + kv_size, kv_size * sizeof(T));
    }
    at::Tensor kc = st.k_caches[l], vc = st.v_caches[l];
    paged_decode_write_into(hb.q, k, v, kc, vc, st.slot_mapping, st.block_tables, st.seq_lens,
                            st.block_size, st.scale, hb.attn3);
    st.o.run(l, hb.attn, attn_proj, padded);
    norm(attn_proj.data_ptr<T>(), st.post_norms[l], true);
    st.gate_up.run(l, normed, gu, padded);         // (S, 2 I): gate, then up
    for (int64_t s = 0; s < S; ++s)
      silu_mul_row(gu.data_ptr<T>() + s * 2 * I, h.data_ptr<T>() + s * I, I);
    st.down.run(l, h, layer_out, padded);
  }
  at::Tensor out = at::empty({S, hidden}, opts);
  check_act(st.final_norm, x.scalar_type(), "final_norm");
  TORCH_CHECK(st.final_norm.numel() == hidden, "decode_step: final_norm has ",
              st.final_norm.numel(), " values, expected ", hidden);
  const T* last = L > 0 ? layer_out.data_ptr<T>() : x.data_ptr<T>();
  for (int64_t s = 0; s < S; ++s)
    add_rms_norm_row(last + s * hidden, res + s * hidden, L > 0, st.final_norm.data_ptr<T>(), e,
                     out.data_ptr<T>() + s * hidden, hidden);
  return out;
}

}  // namespace

// x: (S, hidden) embeddings of the step's tokens, one decoding token per sequence, bf16 or fp32
// (the activation dtype: the norms and caches have it too); positions (S,). Per layer l:
// in_norms[l], post_norms[l] (hidden,); the weights of qkv ((H_l + 2 KVH) D rows: H_l, the
// layer's query heads, a multiple of KVH up to num_heads), o (hidden rows),
// gate_up (2 I rows), down (hidden rows), as Projections says; caches (slots, KVH, D). cos, sin:
// fp32 (max_positions, D). Returns the final norm of the last residual stream, (S, hidden).
at::Tensor decode_step(const at::Tensor& x, const at::Tensor& positions,
                       at::TensorList in_norms, at::TensorList post_norms, at::TensorList qkv_w,
                       at::TensorList o_w, at::TensorList gate_up_w, at::TensorList down_w,
                       const at::Tensor& final_norm, const at::Tensor& cos,
                       const at::Tensor& sin, at::TensorList k_caches, at::TensorList v_caches,
                       const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                       const at::Tensor& seq_lens, int64_t block_size, double eps,
                       double scale, int64_t num_heads, int64_t num_kv_heads,
                       int64_t weight_kind) {
  const int64_t L = static_cast<int64_t>(in_norms.size());
  TORCH_CHECK(weight_kind >= 0 && weight_kind <= 3, "decode_step: weight_kind=", weight_kind,
              " is invalid: 0 (bf16), 1 (INT8), 2 (INT4) or 3 (fp32)");
  TORCH_CHECK(post_norms.size() == L && k_caches.size() == L && v_caches.size() == L,
              "decode_step: every per-layer list must have ", L, " tensors");
  const Projections qkv(qkv_w, weight_kind, L, "qkv");
  const Projections o(o_w, weight_kind, L, "o");
  const Projections gate_up(gate_up_w, weight_kind, L, "gate_up");
  const Projections down(down_w, weight_kind, L, "down");
  TORCH_CHECK((x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat) &&
              x.is_contiguous() && x.device().is_cpu(),
              "decode_step: x must be a contiguous bf16 or fp32 CPU tensor, got ", x.scalar_type(),
              " ", x.sizes());
  TORCH_CHECK(x.dim() == 2, "decode_step: x must be (seqs, hidden), got ", x.sizes());
  const int64_t S = x.size(0);
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) % 2 == 0,
              "decode_step: head_dim (", cos.size(-1), ") must be even for rotary");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == S &&
              positions.is_contiguous(), "decode_step: positions must be int64 (seqs,)");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
              cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes(),
              "decode_step: cos and sin must be contiguous fp32 (max_positions, head_dim)");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s)
    TORCH_CHECK(pos[s] >= 0 && pos[s] < cos.size(0), "decode_step: positions[", s, "]=",
                pos[s], " is outside the rotary tables of ", cos.size(0), " positions");
  const Step st{x, positions, in_norms, post_norms, qkv, o, gate_up, down, final_norm, cos, sin,
                k_caches, v_caches, slot_mapping, block_tables, seq_lens, block_size, eps, scale,
                num_heads, num_kv_heads};
  return x.scalar_type() == at::kFloat ? run_step<float>(st) : run_step<bf16>(st);
}

TORCH_LIBRARY_FRAGMENT(workbench_cpu, m) {
  m.def("decode_step(Tensor x, Tensor positions, Tensor[] in_norms, Tensor[] post_norms, "
        "Tensor[] qkv, Tensor[] o, Tensor[] gate_up, Tensor[] down, Tensor final_norm, Tensor cos, "
        "Tensor sin, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens, int block_size, float eps, float scale, "
        "int num_heads, int num_kv_heads, int weight_kind) -> Tensor");
}

TORCH_LIBRARY_IMPL(workbench_cpu, CPU, m) {
  m.impl("decode_step", &decode_step);
}
