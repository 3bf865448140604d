// A decode GEMM for AVX512-BF16 CPUs, for measurement (scripts/bench_vnni_gemm.py): not used
// by the engine. out[M, N] = x[M, K] W[N, K]^T in bf16 with fp32 accumulation.
//
// The weight is packed once as [N / 16][K / 2][16][2]: each 64-byte line holds one pair of
// k for 16 output columns, the layout vdpbf16ps multiplies against a broadcast pair of x.
// A row's sum over k runs in k order whatever M is (each row is its own accumulator), so a
// row's bits do not depend on the batch it came in. PF_ELEMS > 0 prefetches the weight that
// many bf16 ahead (a trial: it did not help on the AMD EPYC measured, docs/performance.md).
#include <immintrin.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#ifndef PF_ELEMS
#define PF_ELEMS 0
#endif

namespace {

at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "pack: a 2-D bf16 weight");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % 16 == 0 && K % 2 == 0, "pack: out_features must be a multiple of 16, in_features even");
  return w.contiguous().view({N / 16, 16, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

template <int MB>
inline void tile(const uint16_t* x, int64_t K, const uint16_t* wb, float* out, int64_t ldo) {
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  const int32_t* xp = reinterpret_cast<const int32_t*>(x);
  for (int64_t kp = 0; kp < K / 2; ++kp) {
    if (PF_ELEMS > 0) _mm_prefetch(reinterpret_cast<const char*>(wb + kp * 32 + PF_ELEMS), _MM_HINT_T0);
    const __m512bh w = (__m512bh)_mm512_loadu_si512(wb + kp * 32);
    for (int m = 0; m < MB; ++m) {
      acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_set1_epi32(xp[m * (K / 2) + kp]), w);
    }
  }
  for (int m = 0; m < MB; ++m) _mm512_storeu_ps(out + m * ldo, acc[m]);
}

// Two column blocks at once for 8 rows: two weight streams in flight, 16 accumulators.
inline void tile8x2(const uint16_t* x, int64_t K, const uint16_t* wb, float* out, int64_t ldo) {
  __m512 a0[8], a1[8];
  for (int m = 0; m < 8; ++m) { a0[m] = _mm512_setzero_ps(); a1[m] = _mm512_setzero_ps(); }
  const int32_t* xp = reinterpret_cast<const int32_t*>(x);
  const uint16_t* wb1 = wb + K * 16;
  for (int64_t kp = 0; kp < K / 2; ++kp) {
    if (PF_ELEMS > 0) {
      _mm_prefetch(reinterpret_cast<const char*>(wb + kp * 32 + PF_ELEMS), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wb1 + kp * 32 + PF_ELEMS), _MM_HINT_T0);
    }
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wb + kp * 32);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wb1 + kp * 32);
    for (int m = 0; m < 8; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(xp[m * (K / 2) + kp]);
      a0[m] = _mm512_dpbf16_ps(a0[m], xb, w0);
      a1[m] = _mm512_dpbf16_ps(a1[m], xb, w1);
    }
  }
  for (int m = 0; m < 8; ++m) { _mm512_storeu_ps(out + m * ldo, a0[m]); _mm512_storeu_ps(out + m * ldo + 16, a1[m]); }
}

// The last 1-7 rows in one pass over the block.
inline void rest(int64_t rows, const uint16_t* x, int64_t K, const uint16_t* wb, float* out, int64_t ldo) {
  switch (rows) {
    case 1: return tile<1>(x, K, wb, out, ldo);
    case 2: return tile<2>(x, K, wb, out, ldo);
    case 3: return tile<3>(x, K, wb, out, ldo);
    case 4: return tile<4>(x, K, wb, out, ldo);
    case 5: return tile<5>(x, K, wb, out, ldo);
    case 6: return tile<6>(x, K, wb, out, ldo);
    default: return tile<7>(x, K, wb, out, ldo);
  }
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "linear: contiguous 2-D bf16 x");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 2, "linear: a weight from pack()");
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0), N = blocks * 16;
  TORCH_CHECK(packed.size(1) * 2 == K, "linear: x has ", K, " columns, the weight ", packed.size(1) * 2);
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  const uint16_t* xd = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const uint16_t* wd = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  float* od = out.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    int64_t b = begin;
    for (; M >= 8 && b + 2 <= end; b += 2) {  // pairs of blocks: every 8 rows, then the rest
      const uint16_t* wb = wd + b * K * 16;
      int64_t m = 0;
      for (; m + 8 <= M; m += 8) tile8x2(xd + m * K, K, wb, od + m * N + b * 16, N);
      for (int j = 0; m < M && j < 2; ++j) rest(M - m, xd + m * K, K, wb + j * K * 16, od + m * N + (b + j) * 16, N);
    }
    for (; b < end; ++b) {
      const uint16_t* wb = wd + b * K * 16;
      int64_t m = 0;
      for (; m + 8 <= M; m += 8) tile<8>(xd + m * K, K, wb, od + m * N + b * 16, N);
      if (m < M) rest(M - m, xd + m * K, K, wb, od + m * N + b * 16, N);
    }
  });
  return out.to(at::kBFloat16);
}

}  // namespace

TORCH_LIBRARY(vnni_gemm, m) {
  m.def("pack(Tensor w) -> Tensor", pack);
  m.def("linear(Tensor x, Tensor packed) -> Tensor", linear);
}
