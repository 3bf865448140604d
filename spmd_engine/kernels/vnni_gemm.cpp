// bf16 linear for AVX512-BF16 CPUs: out[M, N] = x[M, K] W[N, K]^T (+ bias), fp32 accumulation,
// rounded to bf16 once at the end; and the same for fp32 weights (namespace f32 below). vnni_gemm.py
// builds it (g++ -march=native) and packs weights.
//
// Why: at decode sizes oneDNN's packed call costs 30-40 us before it reads a byte and streams
// small matrices at a fraction of memory bandwidth (docs/performance.md). Here the weight is
// packed once as [N / 16][K / 2][16][2]: each 64-byte line holds one pair of k for 16 output
// columns, the layout vdpbf16ps multiplies against a broadcast pair of x, so each block of 16
// columns is read in one forward stream. A tile is MB rows by NB blocks: NB weight streams in
// flight, MB * NB accumulators, MB broadcasts and NB loads per MB * NB multiply-adds. Each row
// has its own accumulators and sums k in order, so a row's bits do not depend on the batch.
//
// On CPUs with AMX (and a build that targets it: -march=native defines __AMX_BF16__), weights
// whose K is a multiple of 32 go through the tile unit instead (namespace amx below), on the same
// packed layout: a B tile is 16 of those 64-byte lines, 1 KiB read in one piece. vdpbf16ps does
// 32 multiply-adds per instruction, so at eight rows the AVX-512 path is bound by arithmetic, not
// by memory; a tile multiply does 16 rows x 16 columns x 32 k at once. Which path a weight takes
// depends only on its K and the process (use_amx), never on the batch, and a tile's rows are
// computed independently, k chunk after k chunk: a row's bits still do not depend on its batch.
//
// fp32 weights are packed the same way with one k per line ([N / 16][K][16][1]: 16 columns of one
// k). At decode sizes oneDNN's fp32 call streams small matrices well below one core's read
// bandwidth; here each 6-row by 4-block tile does 24 FMAs per 4 lines, and the first tile of a
// block group (the one that brings the weight in from memory) prefetches its streams ahead, so
// the later tiles find the group (K x 256 bytes) in L2. Each row still sums k in order, alone.
//
// The fp32 path needs AVX-512 F only, so a build for a CPU without AVX512-BF16 (-march=native
// leaves __AVX512BF16__ undefined; native.py also passes -mno-avx512bf16 when the engine finds no
// such flag) keeps it and drops the bf16 paths: has_bf16() says which, and a bf16 call is an error.
#include <immintrin.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <algorithm>
#include <mutex>
#include <type_traits>
#include <vector>

namespace {

constexpr int kGroup = 4;  // blocks per task: 4 x 16 columns
constexpr int kRows = 6;   // rows per full tile: 6 x 4 accumulators + 4 weights + 1 broadcast of 32 registers

template <class T>
struct Output {
  T* data;            // bf16 (uint16_t) or fp32 output, row-major
  int64_t ld;         // elements between rows
  const float* bias;  // fp32, N values, or null
};
using Out = Output<uint16_t>;

#if defined(__AVX512BF16__)
// out[row, col:col+16] = bf16(v + bias[col:col+16]): one rounding, after the whole sum.
inline void store16(const Out& o, int64_t row, int64_t col, __m512 v) {
  if (o.bias) v = _mm512_add_ps(v, _mm512_loadu_ps(o.bias + col));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o.data + row * o.ld + col), (__m256i)_mm512_cvtneps_pbh(v));
}
#endif

inline void store16(const Output<float>& o, int64_t row, int64_t col, __m512 v) {
  if (o.bias) v = _mm512_add_ps(v, _mm512_loadu_ps(o.bias + col));
  _mm512_storeu_ps(o.data + row * o.ld + col, v);
}

#if defined(__AVX512BF16__)
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
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) store16(o, row + m, col + j * 16, acc[m][j]);
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
#endif  // __AVX512BF16__

namespace f32 {

constexpr int kAhead = 64;  // k steps a tile's weight streams are prefetched ahead (4 KiB each)

// MB rows by NB blocks, k in order; `ahead`: this tile is the first over these blocks, so it
// prefetches their streams (the later tiles read them from L2).
template <int MB, int NB, bool ahead>
inline void tile(const float* x, int64_t K, const float* wb, const Output<float>& o, int64_t row, int64_t col) {
  __m512 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 w[NB];
    for (int j = 0; j < NB; ++j) w[j] = _mm512_loadu_ps(wb + j * K * 16 + k * 16);
    if constexpr (ahead)
      for (int j = 0; j < NB; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(wb + j * K * 16 + (k + kAhead) * 16), _MM_HINT_T0);
    for (int m = 0; m < MB; ++m) {
      const __m512 xb = _mm512_set1_ps(x[m * K + k]);
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_fmadd_ps(xb, w[j], acc[m][j]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) store16(o, row + m, col + j * 16, acc[m][j]);
}

template <int MB, int NB>
inline void tile_at(bool first, const float* x, int64_t K, const float* wb, const Output<float>& o, int64_t row,
                    int64_t col) {
  if (first) tile<MB, NB, true>(x, K, wb, o, row, col);
  else tile<MB, NB, false>(x, K, wb, o, row, col);
}

// All M rows against NB blocks starting at column `col`: full tiles, then one tile of the rest.
template <int NB>
inline void rows(int64_t M, const float* x, int64_t K, const float* wb, const Output<float>& o, int64_t col) {
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) tile_at<kRows, NB>(m == 0, x + m * K, K, wb, o, m, col);
  const float* xm = x + m * K;
  switch (M - m) {
    case 0: return;
    case 1: return tile_at<1, NB>(m == 0, xm, K, wb, o, m, col);
    case 2: return tile_at<2, NB>(m == 0, xm, K, wb, o, m, col);
    case 3: return tile_at<3, NB>(m == 0, xm, K, wb, o, m, col);
    case 4: return tile_at<4, NB>(m == 0, xm, K, wb, o, m, col);
    default: return tile_at<5, NB>(m == 0, xm, K, wb, o, m, col);
  }
}

}  // namespace f32

bool g_use_amx = false;  // set once by use_amx(); only K % 32 == 0 weights take the tile path

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
namespace amx {

constexpr int kMaxRows = 16;  // rows of an A and a C tile
constexpr int kPairs = 16;    // k pairs of a B tile: 32 values of k per multiply

// Tiles: C = 0 to 3 (fp32 accumulators: two row chunks by two 16-column blocks), A = 4 and 5
// (a row chunk's 32 values of k each), B = 6 and 7 (the two blocks' weights for those 32 k).
// Up to 32 rows one row chunk at a time (C = 0 and 1, A = 4); from 32 rows two at a time, so
// each tile load feeds two multiplies. A row's arithmetic is the same either way.
struct alignas(64) Config {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline Config config(int rows) {
  Config c;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = t >= 6 ? kPairs : rows;
  }
  return c;
}

bool request_permission() {
  constexpr long kReqPerm = 0x1023, kXtileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  return syscall(SYS_arch_prctl, kReqPerm, kXtileData) == 0;
}

// Rows [row, row + R) of x against NB (1 or 2) blocks of 16 columns at `col`; R is the loaded
// configuration's row count.
template <int NB>
inline void tile(const uint16_t* x, int64_t K, const uint16_t* wb, const Out& o, int64_t row, int R,
                 int64_t col, float* scratch) {
  _tile_zero(0);
  if constexpr (NB == 2) _tile_zero(1);
  const uint16_t* xr = x + row * K;
  for (int64_t k = 0; k < K; k += 2 * kPairs) {
    _tile_loadd(4, xr + k, K * 2);
    _tile_loadd(6, wb + k * 16, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NB == 2) {
      _tile_loadd(7, wb + K * 16 + k * 16, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
  }
  _tile_stored(0, scratch, 64);
  if constexpr (NB == 2) _tile_stored(1, scratch + kMaxRows * 16, 64);
  for (int m = 0; m < R; ++m)
    for (int j = 0; j < NB; ++j) store16(o, row + m, col + j * 16, _mm512_loadu_ps(scratch + (j * kMaxRows + m) * 16));
}

// Two chunks of 16 rows (at row0 and row1) against NB blocks at `col`.
template <int NB>
inline void tile2(const uint16_t* x, int64_t K, const uint16_t* wb, const Out& o, int64_t row0, int64_t row1,
                  int64_t col, float* scratch) {
  _tile_zero(0);
  _tile_zero(2);
  if constexpr (NB == 2) {
    _tile_zero(1);
    _tile_zero(3);
  }
  for (int64_t k = 0; k < K; k += 2 * kPairs) {
    _tile_loadd(4, x + row0 * K + k, K * 2);
    _tile_loadd(5, x + row1 * K + k, K * 2);
    _tile_loadd(6, wb + k * 16, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if constexpr (NB == 2) {
      _tile_loadd(7, wb + K * 16 + k * 16, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, scratch, 64);
  _tile_stored(2, scratch + 2 * kMaxRows * 16, 64);
  if constexpr (NB == 2) {
    _tile_stored(1, scratch + kMaxRows * 16, 64);
    _tile_stored(3, scratch + 3 * kMaxRows * 16, 64);
  }
  for (int half = 0; half < 2; ++half)
    for (int m = 0; m < kMaxRows; ++m)
      for (int j = 0; j < NB; ++j)
        store16(o, (half ? row1 : row0) + m, col + j * 16,
                _mm512_loadu_ps(scratch + ((half * 2 + j) * kMaxRows + m) * 16));
}

// Blocks [begin, end) for all M rows, in chunks of up to 16 rows; past 16 the last chunk is the
// last 16 rows (it recomputes some rows of the chunk before it, to the same bits: a row's sum
// does not depend on the rows beside it), so one configuration serves the whole call. From 32
// rows the chunks go in pairs, 16 chunks (256 rows of x, kept in cache) against every block
// before the next 16. The thread's previous configuration is put back afterwards: other AMX
// users (oneDNN) may keep track of what they loaded.
void blocks(int64_t M, const uint16_t* x, int64_t K, const uint16_t* w, const Out& o, int64_t begin,
            int64_t end) {
  alignas(64) uint8_t saved[64];
  _tile_storeconfig(saved);
  const int R = static_cast<int>(std::min<int64_t>(M, kMaxRows));
  const Config cfg = config(R);
  _tile_loadconfig(&cfg);
  alignas(64) float scratch[4 * kMaxRows * 16];
  if (M < 2 * kMaxRows) {
    for (int64_t b = begin; b < end; b += 2) {
      const uint16_t* wb = w + b * K * 16;
      for (int64_t m = 0; m < M; m += R) {
        const int64_t row = std::min<int64_t>(m, M - R);
        if (end - b >= 2) tile<2>(x, K, wb, o, row, R, b * 16, scratch);
        else tile<1>(x, K, wb, o, row, R, b * 16, scratch);
      }
    }
  } else {
    const int64_t chunks = (M + kMaxRows - 1) / kMaxRows;
    for (int64_t first = 0; first < chunks; first += 16) {
      for (int64_t b = begin; b < end; b += 2) {
        const uint16_t* wb = w + b * K * 16;
        for (int64_t c = first; c < std::min(first + 16, chunks); c += 2) {
          const int64_t row0 = std::min(c * kMaxRows, M - kMaxRows), row1 = std::min((c + 1) * kMaxRows, M - kMaxRows);
          if (end - b >= 2) tile2<2>(x, K, wb, o, row0, row1, b * 16, scratch);
          else tile2<1>(x, K, wb, o, row0, row1, b * 16, scratch);
        }
      }
    }
  }
  if (saved[0] == 0) _tile_release();  // palette 0: the thread had no tiles configured
  else _tile_loadconfig(saved);
}

}  // namespace amx

bool use_amx(bool enable) {
  static const bool permitted = amx::request_permission();
  g_use_amx = enable && permitted;
  return g_use_amx;
}
#else
bool use_amx(bool) { return false; }  // built for a CPU without AMX: the AVX-512 path only
#endif

// Blocks in groups of kGroup, spread over the threads: group(first block, blocks in it) for each,
// then after(first column, end column) per parallel range, while its outputs are in cache.
template <class Group, class After>
void by_groups(int64_t blocks, Group group, After after) {
  const int64_t groups = (blocks + kGroup - 1) / kGroup;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) group(g * kGroup, std::min<int64_t>(kGroup, blocks - g * kGroup));
    after(begin * kGroup * 16, std::min(end * kGroup, blocks) * 16);
  });
}

// out = x W^T (+ bias) into `out` ([M, N], x's dtype: bf16 or fp32); then, per parallel range of
// whole blocks, after(first column, end column) while that range's outputs are still in this
// core's cache.
template <class After>
void compute(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
             at::Tensor& out, After after) {
  const bool fp32 = x.scalar_type() == at::kFloat;
  const int64_t per_line = fp32 ? 1 : 2;  // values of k in one 64-byte line of a block
  TORCH_CHECK(x.dim() == 2 && (fp32 || x.scalar_type() == at::kBFloat16) && x.is_contiguous(),
              "vnni linear: contiguous 2-D bf16 or fp32 x");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == per_line && packed.is_contiguous()
              && packed.scalar_type() == x.scalar_type(), "vnni linear: a weight from vnni_gemm.pack, x's dtype");
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0), N = blocks * 16;
  TORCH_CHECK(packed.size(1) * per_line == K, "vnni linear: x has ", K, " columns, the weight ", packed.size(1) * per_line);
  at::Tensor bias32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "vnni linear: bias of ", N, " values");
    bias32 = bias->to(at::kFloat).contiguous();
  }
  out = at::empty({M, N}, x.options());
  if (M == 0) return;
  const float* b32 = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  if (fp32) {
    const Output<float> o{out.data_ptr<float>(), N, b32};
    const float* xd = x.data_ptr<float>();
    const float* wd = packed.data_ptr<float>();
    by_groups(blocks, [&](int64_t b, int64_t n) {
      const float* wb = wd + b * K * 16;
      switch (n) {
        case 4: return f32::rows<4>(M, xd, K, wb, o, b * 16);
        case 3: return f32::rows<3>(M, xd, K, wb, o, b * 16);
        case 2: return f32::rows<2>(M, xd, K, wb, o, b * 16);
        default: return f32::rows<1>(M, xd, K, wb, o, b * 16);
      }
    }, after);
    return;
  }
#if defined(__AVX512BF16__)
  const Out o{reinterpret_cast<uint16_t*>(out.data_ptr()), N, b32};
  const uint16_t* xd = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const uint16_t* wd = reinterpret_cast<const uint16_t*>(packed.data_ptr());
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (g_use_amx && K % 32 == 0) {
    // Pairs of blocks, so a thread never splits a pair: each thread streams its share of the
    // weight front to back.
    at::parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t begin, int64_t end) {
      const int64_t b0 = begin * 2, b1 = std::min(end * 2, blocks);
      amx::blocks(M, xd, K, wd, o, b0, b1);
      after(b0 * 16, b1 * 16);
    });
    return;
  }
#endif
  by_groups(blocks, [&](int64_t b, int64_t n) {
    const uint16_t* wb = wd + b * K * 16;
    switch (n) {
      case 4: return rows<4>(M, xd, K, wb, o, b * 16);
      case 3: return rows<3>(M, xd, K, wb, o, b * 16);
      case 2: return rows<2>(M, xd, K, wb, o, b * 16);
      default: return rows<1>(M, xd, K, wb, o, b * 16);
    }
  }, after);
#else
  TORCH_CHECK(false, "vnni linear: bf16 weights need a build for a CPU with AVX512-BF16 (this one has fp32 only)");
#endif
}

bool has_bf16() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  at::Tensor out;
  compute(x, packed, bias, out, [](int64_t, int64_t) {});
  return out;
}

// ---- greedy decoding: each row's argmax, fused so the logits are scanned while in cache ----
// torch.argmax's order: the first NaN, else the first maximum (so -0.0 and 0.0 tie).

struct Best {
  float value;
  int64_t index;
};

inline float widen(uint16_t bf16) {
  uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float widen(float f) { return f; }

// 16 values from column c as fp32.
inline __m512 load16(const uint16_t* p, int64_t c) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + c))), 16));
}

inline __m512 load16(const float* p, int64_t c) { return _mm512_loadu_ps(p + c); }

// Whether `b` (from columns after `a`'s) takes the lead: a NaN is never overtaken.
inline bool overtakes(const Best& b, const Best& a) {
  return !std::isnan(a.value) && (std::isnan(b.value) || b.value > a.value);
}

template <class T>
Best scan_scalar(const T* p, int64_t c0, int64_t c1) {
  Best best{widen(p[c0]), c0};
  for (int64_t c = c0 + 1; c < c1; ++c) {
    const Best here{widen(p[c]), c};
    if (overtakes(here, best)) best = here;
  }
  return best;
}

// Columns [c0, c1) of one row: 16 lanes, each keeping its first maximum, then the largest lane
// value at its smallest index. A NaN anywhere sends the row to the scalar scan (exact order).
template <class T>
Best scan(const T* p, int64_t c0, int64_t c1) {
  if (c1 - c0 < 32) return scan_scalar(p, c0, c1);
  auto load = [&](int64_t c) { return load16(p, c); };
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 top = load(c0);
  __m512i at = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(c0)));
  __mmask16 nan = _mm512_cmp_ps_mask(top, top, _CMP_UNORD_Q);
  int64_t c = c0 + 16;
  for (; c + 16 <= c1; c += 16) {
    const __m512 v = load(c);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __mmask16 gt = _mm512_cmp_ps_mask(v, top, _CMP_GT_OQ);
    top = _mm512_mask_mov_ps(top, gt, v);
    at = _mm512_mask_mov_epi32(at, gt, _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(c))));
  }
  if (nan) return scan_scalar(p, c0, c1);
  const float value = _mm512_reduce_max_ps(top);
  const __mmask16 ties = _mm512_cmp_ps_mask(top, _mm512_set1_ps(value), _CMP_EQ_OQ);
  Best best{value, _mm512_mask_reduce_min_epi32(ties, at)};
  for (; c < c1; ++c) {
    const Best here{widen(p[c]), c};
    if (std::isnan(here.value)) return scan_scalar(p, c0, c1);
    if (overtakes(here, best)) best = here;
  }
  return best;
}

// [M] int64: argmax over the first `valid` columns of each row of x W^T in x's dtype (what
// argmax(linear(x, W)[:, :valid].float()) gives); the columns past them (a padded vocabulary's
// zero rows) are computed but never compete.
at::Tensor linear_argmax(const at::Tensor& x, const at::Tensor& packed, int64_t valid) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(0) > 0, "vnni linear_argmax: a weight from vnni_gemm.pack");
  const int64_t M = x.dim() == 2 ? x.size(0) : 0, N = packed.size(0) * 16;
  TORCH_CHECK(valid > 0 && valid <= N, "vnni linear_argmax: valid columns ", valid, " of ", N);
  // Each parallel range's best per row, with the range's first column: a few ranges (one a
  // thread), joined in column order below. (One slot per block, as before, was a 256 KB vector
  // zeroed and walked every call at B=8 over a 32k vocabulary: 30-60 us of an 0.8 ms head.)
  std::mutex lock;
  std::vector<std::pair<int64_t, std::vector<Best>>> ranges;
  at::Tensor out;
  compute(x, packed, std::nullopt, out, [&](int64_t c0, int64_t c1) {
    c1 = std::min(c1, valid);
    if (c0 >= c1) return;
    std::vector<Best> rows(static_cast<size_t>(M));
    auto scan_rows = [&](const auto* d) {
      for (int64_t m = 0; m < M; ++m) rows[m] = scan(d + m * N, c0, c1);
    };
    if (out.scalar_type() == at::kFloat) scan_rows(out.data_ptr<float>());
    else scan_rows(reinterpret_cast<const uint16_t*>(out.data_ptr()));
    std::lock_guard<std::mutex> hold(lock);
    ranges.emplace_back(c0, std::move(rows));
  });
  std::sort(ranges.begin(), ranges.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  at::Tensor index = at::empty({M}, x.options().dtype(at::kLong));
  int64_t* ix = index.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) {
    Best best = ranges.front().second[m];  // valid > 0: some range holds column 0
    for (size_t r = 1; r < ranges.size(); ++r)
      if (overtakes(ranges[r].second[m], best)) best = ranges[r].second[m];
    ix[m] = best.index;
  }
  return index;
}

// A float as bf16, rounded to nearest even as torch's conversion rounds (a NaN stays a NaN).
inline uint16_t to_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

template <class S, class D>
inline D convert(S v) {
  if constexpr (std::is_same_v<S, D>) return v;
  else if constexpr (std::is_same_v<D, uint16_t>) return to_bf16(v);
  else return widen(v);
}

// The 16 x 16 matrix of 4-byte words in r[0..15] (row i in r[i]) transposed in registers.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit lanes: rows i, i+4, i+8, i+12 hold lane-columns 0..3
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xDD);
  }
}

// 16 fp32 as bf16 (to_bf16's rounding) in the low halves of 16 dwords.
inline __m512i to_bf16x16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), _mm512_set1_epi32(0x7FC0), rounded);
}

// 16 words of the packed layout (a bf16 pair or one fp32 each) from the S values at `at`.
template <class S, class D>
inline __m512i words16(const S* at) {
  if constexpr (std::is_same_v<S, D>) {
    return _mm512_loadu_si512(at);
  } else if constexpr (std::is_same_v<D, float>) {  // bf16 widened exactly
    return _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at))), 16);
  } else {  // 32 fp32 rounded, paired
    const __m256i lo = _mm512_cvtepi32_epi16(to_bf16x16(_mm512_loadu_ps(at)));
    const __m256i hi = _mm512_cvtepi32_epi16(to_bf16x16(_mm512_loadu_ps(at + 16)));
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
}

// Blocks [first, first + n / 16) of a packed weight from src's n rows, converted and transposed
// in registers 16 lines of a block at a time: an update's whole-block write, without the
// converted copy of src and the strided copy that `pack` of it would make. Streaming stores
// where the lines are 64-byte aligned: the weight is not read again soon, and a plain store
// first reads every line it writes (a third more memory traffic, beside a transfer's receive).
template <class S, class D>
void fill_blocks(D* out, const S* src, int64_t ld, int64_t n, int64_t K) {
  constexpr int64_t p = sizeof(float) / sizeof(D);  // values per word
  const int64_t lines = K / p, whole = lines / 16 * 16;
  const bool aligned = reinterpret_cast<uintptr_t>(out) % 64 == 0;
  for (int64_t b = 0; b < n / 16; ++b) {
    D* block = out + b * K * 16;
    const S* rows = src + b * 16 * ld;
    for (int64_t l0 = 0; l0 < whole; l0 += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = words16<S, D>(rows + i * ld + p * l0);
      transpose16(r);
      for (int j = 0; j < 16; ++j) {
        void* line = block + (l0 + j) * 16 * p;
        if (aligned) _mm512_stream_si512(static_cast<__m512i*>(line), r[j]);
        else _mm512_storeu_si512(line, r[j]);
      }
    }
    for (int64_t line = whole; line < lines; ++line)
      for (int64_t i = 0; i < 16; ++i)
        for (int64_t j = 0; j < p; ++j) block[(line * 16 + i) * p + j] = convert<S, D>(rows[i * ld + line * p + j]);
  }
  _mm_sfence();  // the streamed lines are visible before the update is reported done
}

void write_blocks(at::Tensor packed, int64_t first, const at::Tensor& src) {
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && src.dim() == 2 && src.stride(1) == 1,
              "write_blocks: a contiguous packed weight and rows whose columns are contiguous");
  const int64_t n = src.size(0), p = packed.size(3), K = packed.size(1) * p;
  TORCH_CHECK(n % 16 == 0 && src.size(1) == K && first >= 0 && first + n / 16 <= packed.size(0),
              "write_blocks: rows do not fit the packed weight's blocks");
  const bool bf16_in = src.scalar_type() == at::kBFloat16, bf16_out = packed.scalar_type() == at::kBFloat16;
  TORCH_CHECK((bf16_in || src.scalar_type() == at::kFloat) && (bf16_out || packed.scalar_type() == at::kFloat),
              "write_blocks: bf16 or fp32 only");
  TORCH_CHECK(p == (bf16_out ? 2 : 1), "write_blocks: not a packed layout of its dtype");
  const int64_t ld = src.stride(0), offset = first * K * 16;
  uint16_t* half_out = static_cast<uint16_t*>(packed.data_ptr()) + offset;
  const uint16_t* half_in = static_cast<const uint16_t*>(src.data_ptr());
  if (bf16_out && bf16_in) fill_blocks(half_out, half_in, ld, n, K);
  else if (bf16_out) fill_blocks(half_out, src.data_ptr<float>(), ld, n, K);
  else if (bf16_in) fill_blocks(packed.data_ptr<float>() + offset, half_in, ld, n, K);
  else fill_blocks(packed.data_ptr<float>() + offset, src.data_ptr<float>(), ld, n, K);
}

}  // namespace

TORCH_LIBRARY(spmd_vnni_gemm, m) {
  m.def("linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");  // a CPU kernel (below), so it can have a shape function
  m.def("linear_argmax(Tensor x, Tensor packed, int valid) -> Tensor");  // greedy decoding's LM head
  // Whether weights with K % 32 == 0 take the AMX path from now on: asks the OS for the tile
  // state once; false where the build has no AMX or the OS refuses.
  m.def("use_amx(bool enable) -> bool", use_amx);
  m.def("has_bf16() -> bool", has_bf16);
  m.def("write_blocks(Tensor(a!) packed, int first, Tensor src) -> ()");  // an update's whole blocks  // whether this build has the bf16 paths (else fp32 only)
}

TORCH_LIBRARY_IMPL(spmd_vnni_gemm, CPU, m) {
  m.impl("linear", linear);
  m.impl("linear_argmax", linear_argmax);
  m.impl("write_blocks", write_blocks);
}
