// Attention for a decode-shaped step over the paged KV cache: every token is one request's new
// token, its K/V written to its slot first, then it attends to its request's first seq_len keys
// (a sliding-window layer: only the last `window` of them, the keys its window still sees).
// decode_attention.py builds it (g++ -march=native) and registers its shape function.
//
// Why: traced, the same work became inductor loops that reduce each score with a horizontal sum
// per key and recompute the softmax's max and sum in one thread: about 100 us a layer for 8
// tokens over 100 keys, most of a decode step's non-matmul time (docs/performance.md). Here
// each (token, KV head) pair reads each key and value once for the query heads that share it
// (up to 4 at head dim 64, 2 at 128), holding their queries and outputs in AVX-512 registers;
// other head dims, and CPUs without AVX-512, take plain loops (about 3x slower).
//
// Each token's result depends on its own query and keys only, summed in key order: the bits
// do not depend on the batch. float32 throughout, rounded to the cache's dtype once at the end.
#include <immintrin.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

// A row of the cache (or of q) as float32.
inline void to_float(const float* src, float* dst, int64_t D) { std::memcpy(dst, src, D * sizeof(float)); }
inline void to_float(const c10::BFloat16* src, float* dst, int64_t D) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  for (int64_t d = 0; d < D; ++d) {
    const uint32_t wide = static_cast<uint32_t>(bits[d]) << 16;
    std::memcpy(dst + d, &wide, sizeof wide);
  }
}
template <typename T>
inline void to_float(const T* src, float* dst, int64_t D) {
  for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]);
}

// Where key or value j of KV head g starts in a cache [blocks, BS, KV, D], through the token's
// block table: the one place the paged layout is spelled out.
inline int64_t cache_row(const int64_t* table, int64_t j, int64_t BS, int64_t KV, int64_t g, int64_t D) {
  return ((table[j / BS] * BS + j % BS) * KV + g) * D;
}

#ifdef __AVX512F__
// The AVX-512 path, for head dims of 16 * DV: a (token, KV head) pair's query heads in groups of
// GB, whose queries (for the scores) and then outputs (for the weighted sum) stay in GB * DV
// registers while the keys and values stream past once per group.
namespace fast {

template <typename T>
inline __m512 load16(const T* p);
template <>
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
template <>
inline __m512 load16(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
template <>
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// exp_nonpositive (below), 16 at a time, by the same steps.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(_mm512_add_ps(t, _mm512_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));
  __m512 p = _mm512_set1_ps(1.0f / 720);
  for (const float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// scores[0:L] -> e^(s - max), their sum returned (16 running sums, reduced once).
inline float softmax_numerators(float* s, int64_t L) {
  __m512 top = _mm512_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 16 <= L; j += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + j));
  const __mmask16 tail = static_cast<__mmask16>((1u << (L - j)) - 1);
  if (j < L) top = _mm512_mask_max_ps(top, tail, top, _mm512_maskz_loadu_ps(tail, s + j));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 total = _mm512_setzero_ps();
  for (j = 0; j + 16 <= L; j += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), m));
    _mm512_storeu_ps(s + j, e);
    total = _mm512_add_ps(total, e);
  }
  if (j < L) {
    const __m512 e = _mm512_maskz_mov_ps(tail, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + j), m)));
    _mm512_mask_storeu_ps(s + j, tail, e);
    total = _mm512_add_ps(total, e);
  }
  return _mm512_reduce_add_ps(total);
}

// Key or value j of KV head g, as float32, in DV registers.
template <typename T, int DV>
inline void load_row(const T* cache, const int64_t* table, int64_t j, int64_t KV, int64_t g, int64_t BS,
                     __m512 (&x)[DV]) {
  const T* row = cache + cache_row(table, j, BS, KV, g, DV * 16);
#pragma GCC unroll 8
  for (int v = 0; v < DV; ++v) x[v] = load16(row + v * 16);
}

// The GB heads' 16-lane partial dot products with key j (the full dot is their lane sum).
template <typename T, int DV, int GB>
inline void partial_dots(const __m512 (&r)[GB][DV], const T* k_cache, const int64_t* table, int64_t j, int64_t KV,
                         int64_t g, int64_t BS, __m512 (&acc)[GB]) {
  __m512 kr[DV];
  load_row<T, DV>(k_cache, table, j, KV, g, BS, kr);
#pragma GCC unroll 8
  for (int h = 0; h < GB; ++h) {
    acc[h] = _mm512_mul_ps(r[h][0], kr[0]);
#pragma GCC unroll 8
    for (int v = 1; v < DV; ++v) acc[h] = _mm512_fmadd_ps(r[h][v], kr[v], acc[h]);
  }
}

// Sixteen keys' lane sums in one register, by the tree _mm512_reduce_add_ps uses for one (lane
// l + l+8, then + l+4, + l+2, + l+1), so each score has the same bits as summed alone: four
// rounds, each folding two registers into one (shuffles pair the halves being added), 15
// additions for 16 scores instead of 4 apiece. Round one folds keys slot 2p and 2p+1 (`half`);
// the last round leaves slot 4m + i in lane 4i + m, so slot s holds key slot_key(s).
constexpr int slot_key(int s) { return 4 * (s % 4) + s / 4; }
inline __m512 fold_halves(__m512 a, __m512 b) {  // lanes l + l+8: a's 8 sums, then b's
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
}
inline __m512 sixteen_sums(const __m512* half) {
  __m512 quarter[4];  // + l+4: four keys a register, one a 128-bit quarter
  for (int r = 0; r < 4; ++r)
    quarter[r] = _mm512_add_ps(_mm512_shuffle_f32x4(half[2 * r], half[2 * r + 1], 0x88),
                               _mm512_shuffle_f32x4(half[2 * r], half[2 * r + 1], 0xDD));
  __m512 pairs[2];  // + l+2, within each quarter
  for (int r = 0; r < 2; ++r)
    pairs[r] = _mm512_add_ps(_mm512_shuffle_ps(quarter[2 * r], quarter[2 * r + 1], 0x44),
                             _mm512_shuffle_ps(quarter[2 * r], quarter[2 * r + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(pairs[0], pairs[1], 0x88), _mm512_shuffle_ps(pairs[0], pairs[1], 0xDD));
}

template <typename T, int DV, int GB>
inline void heads(const T* q, const T* k_cache, const T* v_cache, const int64_t* table, int64_t J0, int64_t L,
                  int64_t KV, int64_t g, int64_t BS, float scale, float* scores, int64_t stride, T* out) {
  constexpr int64_t D = DV * 16;
  __m512 r[GB][DV];
#pragma GCC unroll 8
  for (int h = 0; h < GB; ++h)
#pragma GCC unroll 8
    for (int v = 0; v < DV; ++v) r[h][v] = load16(q + h * D + v * 16);
  int64_t j = J0;
  for (; j + 16 <= L; j += 16) {  // sixteen keys at a time, their first round kept in L1
    __m512 half[GB][8];
    for (int p = 0; p < 8; ++p) {
      __m512 a[GB], b[GB];
      partial_dots<T, DV, GB>(r, k_cache, table, j + slot_key(2 * p), KV, g, BS, a);
      partial_dots<T, DV, GB>(r, k_cache, table, j + slot_key(2 * p + 1), KV, g, BS, b);
#pragma GCC unroll 8
      for (int h = 0; h < GB; ++h) half[h][p] = fold_halves(a[h], b[h]);
    }
#pragma GCC unroll 8
    for (int h = 0; h < GB; ++h)
      _mm512_storeu_ps(scores + h * stride + j, _mm512_mul_ps(sixteen_sums(half[h]), _mm512_set1_ps(scale)));
  }
  for (; j < L; ++j) {
    __m512 acc[GB];
    partial_dots<T, DV, GB>(r, k_cache, table, j, KV, g, BS, acc);
#pragma GCC unroll 8
    for (int h = 0; h < GB; ++h) scores[h * stride + j] = _mm512_reduce_add_ps(acc[h]) * scale;
  }
  float inv[GB];
  for (int h = 0; h < GB; ++h) inv[h] = 1.0f / softmax_numerators(scores + h * stride + J0, L - J0);
#pragma GCC unroll 8
  for (int h = 0; h < GB; ++h)
#pragma GCC unroll 8
    for (int v = 0; v < DV; ++v) r[h][v] = _mm512_setzero_ps();
  for (int64_t j = J0; j < L; ++j) {
    __m512 vr[DV];
    load_row<T, DV>(v_cache, table, j, KV, g, BS, vr);
#pragma GCC unroll 8
    for (int h = 0; h < GB; ++h) {
      const __m512 p = _mm512_set1_ps(scores[h * stride + j]);
#pragma GCC unroll 8
      for (int v = 0; v < DV; ++v) r[h][v] = _mm512_fmadd_ps(p, vr[v], r[h][v]);
    }
  }
  alignas(64) float row[D];
  for (int h = 0; h < GB; ++h) {
    for (int v = 0; v < DV; ++v) _mm512_store_ps(row + v * 16, _mm512_mul_ps(r[h][v], _mm512_set1_ps(inv[h])));
    for (int64_t d = 0; d < D; ++d) out[h * D + d] = static_cast<T>(row[d]);
  }
}

// One (token, KV head) pair's G query heads, GB at a time (a tail of fewer by one at a time).
template <typename T, int DV>
inline void pair(const T* q, const T* k_cache, const T* v_cache, const int64_t* table, int64_t J0, int64_t L,
                 int64_t KV, int64_t g, int64_t G, int64_t BS, float scale, float* scores, int64_t stride, T* out) {
  constexpr int GB = DV <= 4 ? 4 : 2;  // GB * DV accumulators: 16 of the 32 registers
  constexpr int64_t D = DV * 16;
  int64_t h = 0;
  for (; h + GB <= G; h += GB)
    heads<T, DV, GB>(q + h * D, k_cache, v_cache, table, J0, L, KV, g, BS, scale, scores, stride, out + h * D);
  for (; h < G; ++h)
    heads<T, DV, 1>(q + h * D, k_cache, v_cache, table, J0, L, KV, g, BS, scale, scores, stride, out + h * D);
}

}  // namespace fast
#endif

// e^x for x <= 0 (a score minus its row's maximum): 2^n * 2^f with |f| <= 1/2, 2^f by its
// Taylor series to r^6 (relative error under 2e-7); below -87 it is taken as e^-87 (1.6e-38),
// which vanishes beside the row's maximum term (e^0 = 1).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.4426950408889634f;
  const float n = std::floor(t + 0.5f);
  const float r = (t - n) * 0.6931471805599453f;
  const float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// q: token n's heads start at q + n * q_stride, one after another (head stride D).
template <typename T>
void attend(const T* q, int64_t q_stride, const T* k_cache, const T* v_cache, const int64_t* tables,
            const int64_t* seq_lens, T* out, int64_t N, int64_t H, int64_t KV, int64_t D, int64_t BS, int64_t nb,
            float scale, int64_t window) {
  const int64_t G = H / KV;
  int64_t longest = 0;
  for (int64_t n = 0; n < N; ++n) longest = std::max(longest, seq_lens[n]);
  // Small steps run on the calling thread: a parallel region costs more than they do.
  const int64_t work = longest * D * (G + 1) * 2;
  const int64_t grain = std::max<int64_t>(1, (1 << 17) / std::max<int64_t>(1, work));
  at::parallel_for(0, N * KV, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), row(D), scores(G * longest), acc(G * D), sums(G);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / KV, g = item % KV, L = std::min(seq_lens[n], nb * BS);
      const int64_t J0 = window > 0 ? std::max<int64_t>(0, L - window) : 0;  // the first key in the window
      const int64_t* table = tables + n * nb;
      const T* qn = q + n * q_stride + g * G * D;  // the G query heads sharing KV head g
      T* on = out + (n * H + g * G) * D;
#ifdef __AVX512F__
      if constexpr (!std::is_same_v<T, double>) {
        if (D == 64) {
          fast::pair<T, 4>(qn, k_cache, v_cache, table, J0, L, KV, g, G, BS, scale, scores.data(), longest, on);
          continue;
        }
        if (D == 128) {
          fast::pair<T, 8>(qn, k_cache, v_cache, table, J0, L, KV, g, G, BS, scale, scores.data(), longest, on);
          continue;
        }
      }
#endif
      to_float(qn, qf.data(), G * D);
      for (int64_t j = J0; j < L; ++j) {
        to_float(k_cache + cache_row(table, j, BS, KV, g, D), row.data(), D);
        for (int64_t h = 0; h < G; ++h) {
          float dot = 0.0f;
          for (int64_t d = 0; d < D; ++d) dot += qf[h * D + d] * row[d];
          scores[h * longest + j] = dot * scale;
        }
      }
      for (int64_t h = 0; h < G; ++h) {
        float* s = scores.data() + h * longest;
        float top = s[J0];
        for (int64_t j = J0 + 1; j < L; ++j) top = std::max(top, s[j]);
        float total = 0.0f;
        for (int64_t j = J0; j < L; ++j) {
          s[j] = exp_nonpositive(s[j] - top);
          total += s[j];
        }
        sums[h] = total;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = J0; j < L; ++j) {
        to_float(v_cache + cache_row(table, j, BS, KV, g, D), row.data(), D);
        for (int64_t h = 0; h < G; ++h) {
          const float p = scores[h * longest + j];
          for (int64_t d = 0; d < D; ++d) acc[h * D + d] += p * row[d];
        }
      }
      for (int64_t h = 0; h < G; ++h) {
        const float inv = 1.0f / sums[h];
        for (int64_t d = 0; d < D; ++d) on[h * D + d] = static_cast<T>(acc[h * D + d] * inv);
      }
    }
  });
}

// x [N, heads, D] in `dtype` with each token's heads one after another (any stride between
// tokens), as it is when it can be; otherwise a contiguous copy in `dtype`.
at::Tensor rows_of_heads(const at::Tensor& x, at::ScalarType dtype) {
  if (x.scalar_type() == dtype && x.dim() == 3 && x.stride(2) == 1 && (x.size(1) == 1 || x.stride(1) == x.size(2)))
    return x;
  return x.to(dtype).contiguous();
}

at::Tensor as_long(const at::Tensor& x) {
  return x.scalar_type() == at::kLong && x.is_contiguous() ? x : x.to(at::kLong).contiguous();
}

// q [N, H, D], k and v [N, KV, D] (this step's new tokens), caches [blocks, BS, KV, D] (written at
// `slots`, [N]), block_tables [N, nb], seq_lens [N] (keys each token sees, its own included),
// window: a sliding-window layer's width (the token sees its last `window` keys only), 0: none.
// Returns [N, H * D]. The caches are written in place: the schema says nothing of it, as for
// spmd_engine::attention (no code of the graph reads a cache but this op).
at::Tensor decode(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& k_cache,
                  const at::Tensor& v_cache, const at::Tensor& slots_in, const at::Tensor& tables_in,
                  const at::Tensor& lens_in, double scale, int64_t window) {
  TORCH_CHECK(q_in.dim() == 3 && k_in.dim() == 3 && v_in.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "decode attention: q, k, v [N, heads, D] and caches [blocks, block_size, kv_heads, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "decode attention: contiguous caches");
  // Inside a compiled layer q, k and v are slices of the step's qkv rows: read them where they
  // are. Each conversion or copy here is a dispatcher call, and in a decode step every one runs
  // cold (the weights have just gone through the caches): a v copy and five no-op conversions
  // cost 5-10 us a layer.
  const at::Tensor q = rows_of_heads(q_in, q_in.scalar_type()), k = rows_of_heads(k_in, k_cache.scalar_type()),
                   v = rows_of_heads(v_in, v_cache.scalar_type());
  const at::Tensor slots = as_long(slots_in), tables = as_long(tables_in), lens = as_long(lens_in);
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2), KV = k_cache.size(2), BS = k_cache.size(1);
  const int64_t blocks = k_cache.size(0), nb = tables.size(1);
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "decode attention: q and the cache differ in dtype");
  TORCH_CHECK(k_cache.size(3) == D && k.size(1) == KV && k.size(2) == D && v.sizes() == k.sizes() && k.size(0) == N
              && v_cache.sizes() == k_cache.sizes() && H % KV == 0, "decode attention: mismatched shapes");
  TORCH_CHECK(slots.numel() == N && tables.dim() == 2 && tables.size(0) == N && lens.numel() == N,
              "decode attention: one slot, table row and length per token");
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t* tb = tables.data_ptr<int64_t>();
  const int64_t* ln = lens.data_ptr<int64_t>();
  TORCH_CHECK(window >= 0, "decode attention: a negative window");
  for (int64_t n = 0; n < N; ++n) {
    TORCH_CHECK(sl[n] >= 0 && sl[n] < blocks * BS, "decode attention: slot ", sl[n], " outside the cache");
    TORCH_CHECK(ln[n] >= 1 && ln[n] <= nb * BS, "decode attention: ", ln[n], " keys for a table of ", nb, " blocks");
    const int64_t first = window > 0 ? std::max<int64_t>(0, ln[n] - window) / BS : 0;  // out of the window: unread
    for (int64_t b = first; b < (ln[n] + BS - 1) / BS; ++b)
      TORCH_CHECK(tb[n * nb + b] >= 0 && tb[n * nb + b] < blocks, "decode attention: block ", tb[n * nb + b],
                  " outside the cache");
  }
  at::Tensor out = at::empty({N, H * D}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    const int64_t row = KV * D;
    auto* kc = k_cache.data_ptr<scalar_t>();
    auto* vc = v_cache.data_ptr<scalar_t>();
    for (int64_t n = 0; n < N; ++n) {
      std::memcpy(kc + sl[n] * row, k.data_ptr<scalar_t>() + n * k.stride(0), row * sizeof(scalar_t));
      std::memcpy(vc + sl[n] * row, v.data_ptr<scalar_t>() + n * v.stride(0), row * sizeof(scalar_t));
    }
    attend<scalar_t>(q.data_ptr<scalar_t>(), q.stride(0), kc, vc, tb, ln, out.data_ptr<scalar_t>(), N, H, KV, D,
                     BS, nb, static_cast<float>(scale), window);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(spmd_decode_attention, m) {
  m.def("decode(Tensor q, Tensor k, Tensor v, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor block_tables, "
        "Tensor seq_lens, float scale, int window=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(spmd_decode_attention, CPU, m) {
  m.impl("decode", decode);
}
