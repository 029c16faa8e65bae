// The operators of kernels/cpu that other files of it call directly (decode_step.cpp), as C++
// functions writing into a given output: the same code the torch operators run.
#pragma once
#include <ATen/ATen.h>

// y = x @ w.T for x (M, K) bf16 or fp32 and w (N, K) bf16 into y (M, N) of x's dtype (an fp32 w
// goes to linear_fp32_into); few rows run the loops of gemv.cpp, more rows torch's GEMM.
void linear_bf16_into(const at::Tensor& x, const at::Tensor& w, at::Tensor& y);

// The same for fp32 x and fp32 w (N, K).
void linear_fp32_into(const at::Tensor& x, const at::Tensor& w, at::Tensor& y);

// The same for INT8 weight-only w (N, K) int8 with a bf16 or fp32 scale per row, and for
// group-wise INT4 (packed (N, K/2) codes, scale and minimum (N, K/group_size), x (M, Kx <= K) read
// as zero-padded to K; for more rows aten's kernel on its own layout aten_packed /
// aten_scale_zero) (gemv.cpp). x bf16 or fp32, y of x's dtype.
void linear_int8_into(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                      at::Tensor& y);
void linear_int4_into(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                      const at::Tensor& minimum, int64_t group_size, const at::Tensor& aten_packed,
                      const at::Tensor& aten_scale_zero, at::Tensor& y);

// Write k, v (seqs, KVH, D) into the caches at slot_mapping, then attend each query (seqs, H, D) to
// its sequence's cached positions, into out (like q) (paged_attention.cpp).
void paged_decode_write_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             at::Tensor& k_cache, at::Tensor& v_cache,
                             const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                             const at::Tensor& seq_lens, int64_t block_size, double scale,
                             at::Tensor& out);
