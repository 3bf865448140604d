// bf16 linear for AVX512-BF16 CPUs: out[M, N] = x[M, K] W[N, K]^T (+ bias), fp32 accumulation,
// rounded to bf16 once at the end. vnni_gemm.py builds it (g++ -march=native) and packs weights.
//
// Why: at decode sizes oneDNN's packed call costs 30-40 us before it reads a byte and streams
// small matrices at a fraction of memory bandwidth (docs/performance.md). Here the weight is
// packed once as [N / 16][K / 2][16][2]: each 64-byte line holds one pair of k for 16 output
// columns, the layout vdpbf16ps multiplies against a broadcast pair of x, so each block of 16
// columns is read in one forward stream. A tile is MB rows by NB blocks: NB weight streams in
// flight, MB * NB accumulators, MB broadcasts and NB loads per MB * NB multiply-adds. Each row
// has its own accumulators and sums k in order, so a row's bits do not depend on the batch.
#include <immintrin.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

namespace {

constexpr int kGroup = 4;  // blocks per task: 4 x 16 columns
constexpr int kRows = 6;   // rows per full tile: 6 x 4 accumulators + 4 weights + 1 broadcast of 32 registers

struct Out {
  uint16_t* data;     // bf16 output, row-major
  int64_t ld;         // elements between rows
  const float* bias;  // fp32, N values, or null
};

template <int MB, int NB>
inline void tile(const uint16_t* x, int64_t K, const uint16_t* wb, const Out& o, int64_t row, int64_t col) {
  __m512 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  const int32_t* xp = reinterpret_cast<const int32_t*>(x);
  const int64_t kpairs = K / 2;
  for (int64_t kp = 0; kp < kpairs; ++kp) {
    __m512bh w[NB];
    for (int j = 0; j < NB; ++j) w[j] = (__m512bh)_mm512_loadu_si512(wb + j * K * 16 + kp * 32);
    for (int m = 0; m < MB; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(xp[m * kpairs + kp]);
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xb, w[j]);
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int j = 0; j < NB; ++j) {
      __m512 v = acc[m][j];
      if (o.bias) v = _mm512_add_ps(v, _mm512_loadu_ps(o.bias + col + j * 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o.data + (row + m) * o.ld + col + j * 16),
                          (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

// All M rows against NB blocks starting at column `col`: full tiles, then one tile of the rest.
template <int NB>
inline void rows(int64_t M, const uint16_t* x, int64_t K, const uint16_t* wb, const Out& o, int64_t col) {
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) tile<kRows, NB>(x + m * K, K, wb, o, m, col);
  const uint16_t* xm = x + m * K;
  switch (M - m) {
    case 0: return;
    case 1: return tile<1, NB>(xm, K, wb, o, m, col);
    case 2: return tile<2, NB>(xm, K, wb, o, m, col);
    case 3: return tile<3, NB>(xm, K, wb, o, m, col);
    case 4: return tile<4, NB>(xm, K, wb, o, m, col);
    default: return tile<5, NB>(xm, K, wb, o, m, col);
  }
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "vnni linear: contiguous 2-D bf16 x");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 2 && packed.is_contiguous()
              && packed.scalar_type() == at::kBFloat16, "vnni linear: a weight from vnni_gemm.pack");
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0), N = blocks * 16;
  TORCH_CHECK(packed.size(1) * 2 == K, "vnni linear: x has ", K, " columns, the weight ", packed.size(1) * 2);
  at::Tensor bias32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "vnni linear: bias of ", N, " values");
    bias32 = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  const Out o{reinterpret_cast<uint16_t*>(out.data_ptr()), N, bias32.defined() ? bias32.data_ptr<float>() : nullptr};
  const uint16_t* xd = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const uint16_t* wd = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const int64_t groups = (blocks + kGroup - 1) / kGroup;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t b = g * kGroup;
      const uint16_t* wb = wd + b * K * 16;
      switch (std::min<int64_t>(kGroup, blocks - b)) {
        case 4: rows<4>(M, xd, K, wb, o, b * 16); break;
        case 3: rows<3>(M, xd, K, wb, o, b * 16); break;
        case 2: rows<2>(M, xd, K, wb, o, b * 16); break;
        default: rows<1>(M, xd, K, wb, o, b * 16); break;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(spmd_vnni_gemm, m) {
  m.def("linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor", linear);
}
