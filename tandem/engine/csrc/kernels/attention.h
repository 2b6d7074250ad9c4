// Short-query attention straight from the paged KV cache, on CPU (the wrapper:
// paged_attention.cpp).
//
// One call covers a step's decodes and speculative verifications: request b has query_lens[b]
// query tokens at the end of its context_lens[b] tokens, whose keys and values sit in the
// blocks block_tables[b]. The kernel reads those blocks where they are, once, keys and values
// together (online softmax, float32 arithmetic): no block is gathered into a padded copy and no
// mask is built. A row sees the keys at positions <= its own (causal within the query), and its
// arithmetic does not depend on the query length, so a verified token scores as a decode would.
//
// bfloat16 queries over a bfloat16 cache, where the CPU has AVX-512 BF16 and heads are 32, 64,
// 96 or 128 wide, take `attend_blocks_bf16`: bfloat16 dot products (`vdpbf16ps`, float32 sums)
// straight from the cache, no widened copy of a block. Measured, 16 decodes over ~800 tokens,
// SmolLM2's heads, 30 layers' caches, 2 threads: 22 ms against 35 for the float32 path; 16 x 4
// verified tokens 48 against 94; one decode 1.5 against 2.4.
//
// Cache slots: `head_dim` values in float32 / bfloat16 / float16, or `head_dim` int8 / e4m3
// codes followed by the 4 bytes of their float32 scale (tandem/engine/kv_quant.py).
//
// Included once per instruction-set level, inside its namespace (isa_kernels.h): no includes.

namespace attention {

constexpr int64_t kMaxBlockSize = kMaxAttentionBlockSize;
static_assert(kMaxBlockSize % simd::kWidth == 0, "score rows are whole registers");

// One slot of `head_dim` values as float32.
template <typename T>
struct FloatSlot {
  static void load(const T* slot, int64_t head_dim, float* out) {
#pragma omp simd
    for (int64_t e = 0; e < head_dim; ++e) out[e] = static_cast<float>(slot[e]);
  }
};

// bfloat16 is the top half of a float32: widen the bits (vectorizes, unlike the class's cast).
template <>
struct FloatSlot<c10::BFloat16> {
  static void load(const c10::BFloat16* slot, int64_t head_dim, float* out) {
    const uint16_t* bits = reinterpret_cast<const uint16_t*>(slot);
    uint32_t* wide = reinterpret_cast<uint32_t*>(out);
#pragma omp simd
    for (int64_t e = 0; e < head_dim; ++e) wide[e] = static_cast<uint32_t>(bits[e]) << 16;
  }
};

// `head_dim` codes, then their float32 scale.
template <typename T>
struct QuantizedSlot {
  static void load(const T* slot, int64_t head_dim, float* out) {
    float scale;
    std::memcpy(&scale, slot + head_dim, sizeof(float));
#pragma omp simd
    for (int64_t e = 0; e < head_dim; ++e) out[e] = static_cast<float>(slot[e]) * scale;
  }
};

// a . b over n floats: a register of products per kWidth elements, summed once at the end.
inline float dot(const float* a, const float* b, int64_t n) {
  simd::Vec acc = {};
  int64_t e = 0;
  for (; e + simd::kWidth <= n; e += simd::kWidth) acc += simd::load(a + e) * simd::load(b + e);
  float tail = 0.0f;
  for (; e < n; ++e) tail += a[e] * b[e];
  return simd::sum(acc) + tail;
}

// acc = acc * rescale + sum_t p[t] * values[t * stride ..], over n floats. Four registers of
// acc at a time are held over every t: four independent chains of multiply-adds, not one.
inline void weighted_sum(float* acc, float rescale, const float* p, const float* values,
                         int64_t count, int64_t stride, int64_t n) {
  using simd::kWidth;
  using simd::load;
  int64_t e = 0;
  for (; e + 4 * kWidth <= n; e += 4 * kWidth) {
    simd::Vec a0 = load(acc + e) * rescale, a1 = load(acc + e + kWidth) * rescale,
              a2 = load(acc + e + 2 * kWidth) * rescale, a3 = load(acc + e + 3 * kWidth) * rescale;
    for (int64_t t = 0; t < count; ++t) {
      const float* v = values + t * stride + e;
      a0 += p[t] * load(v);
      a1 += p[t] * load(v + kWidth);
      a2 += p[t] * load(v + 2 * kWidth);
      a3 += p[t] * load(v + 3 * kWidth);
    }
    simd::store(acc + e, a0);
    simd::store(acc + e + kWidth, a1);
    simd::store(acc + e + 2 * kWidth, a2);
    simd::store(acc + e + 3 * kWidth, a3);
  }
  for (; e + kWidth <= n; e += kWidth) {
    simd::Vec a = load(acc + e) * rescale;
    for (int64_t t = 0; t < count; ++t) a += p[t] * load(values + t * stride + e);
    simd::store(acc + e, a);
  }
  for (; e < n; ++e) {
    float a = acc[e] * rescale;
    for (int64_t t = 0; t < count; ++t) a += p[t] * values[t * stride + e];
    acc[e] = a;
  }
}

#if TANDEM_BF16_DOTS
// Lane t of the result: the sum of the lanes of in[4 (t % 4) + t / 4]. Four rounds of pairwise
// shuffles and adds (45 operations for 16 sums, against ~8 for each sum on its own).
inline __m512 sum_lanes_16(const __m512* in) {
  __m512 halves[8], quarters[4], pairs[2];
  for (int i = 0; i < 8; ++i)  // 256 bits of each of in[2i], in[2i + 1]
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(in[2 * i], in[2 * i + 1], 0x44),
                              _mm512_shuffle_f32x4(in[2 * i], in[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128 bits of each of in[4i .. 4i + 3]
    quarters[i] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0x88),
                                _mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(quarters[2 * i], quarters[2 * i + 1]),
                             _mm512_unpackhi_ps(quarters[2 * i], quarters[2 * i + 1]));
  const __m512d a = _mm512_castps_pd(pairs[0]), b = _mm512_castps_pd(pairs[1]);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                       _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
}

// s[t] = scale * q . key t for t < n, bfloat16 query and keys (head_dim = 32 C, the keys
// `stride` elements apart): products exact, summed in float32 by `vdpbf16ps`, no widened copy of
// the keys. Written in whole registers of 16 (s holds them); lanes from n on repeat key n - 1.
template <int C>
void bf16_scores(const uint16_t* q, const uint16_t* keys, int64_t stride, int64_t n, float scale,
                 float* s) {
  __m512bh qv[C];
  for (int c = 0; c < C; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    __m512 dots[16];
    for (int i = 0; i < 16; ++i) {
      // in[i] of sum_lanes_16 becomes lane 4 (i % 4) + i / 4: the key of that lane
      const int64_t t = std::min<int64_t>(t0 + 4 * (i % 4) + i / 4, n - 1);
      const uint16_t* key = keys + t * stride;
      dots[i] = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)_mm512_loadu_si512(key));
      for (int c = 1; c < C; ++c)
        dots[i] = _mm512_dpbf16_ps(dots[i], qv[c], (__m512bh)_mm512_loadu_si512(key + 32 * c));
    }
    _mm512_storeu_ps(s + t0, _mm512_mul_ps(sum_lanes_16(dots), _mm512_set1_ps(scale)));
  }
}

#endif

// A block's keys and values, `bytes` each, into the outer caches (locality 1: prefetcht2). Into
// L1 (prefetcht0) it ran no faster than no prefetch at all, this 15-20% faster (16 contexts of
// ~800 tokens, 30 layers' caches, from memory).
inline void prefetch(const void* keys, const void* values, int64_t bytes) {
  for (int64_t byte = 0; byte < bytes; byte += 64) {
    __builtin_prefetch(static_cast<const char*>(keys) + byte, 0, 1);
    __builtin_prefetch(static_cast<const char*>(values) + byte, 0, 1);
  }
}

// One block's step of a row's online softmax, its running maximum `m` so far: the scores
// s[0, visible) become exp(s - m_new) (lanes past `visible` unspecified); gives m_new, the factor
// that rescales what was summed before (0 for the first block) and the new exponentials' sum.
// In whole registers, lanes past `visible` masked: a chain of 16 scalar steps each for the
// maximum and the sum cost more than the scores' dot products.
struct BlockSoftmax {
  float m, rescale, sum;
};

inline BlockSoftmax block_softmax(float* s, int64_t visible, float m) {
  simd::Vec highest = simd::Vec{} + m;
  for (int64_t t = 0; t < visible; t += simd::kWidth) {
    const simd::Vec v = simd::load(s + t);
    highest = simd::visible(t, visible) && v > highest ? v : highest;
  }
  const float m_new = simd::max(highest);
  simd::Vec sums = {};
  for (int64_t t = 0; t < visible; t += simd::kWidth) {
    const simd::Vec p = simd::exp(simd::load(s + t) - m_new);
    sums += simd::visible(t, visible) ? p : simd::Vec{};
    simd::store(s + t, p);
  }
  return {m_new, std::exp(m - m_new), simd::sum(sums)};
}

// Softmax state of one row over part of its context: running maximum `m`, sum of
// exp(score - m) `l`, and the values weighted by those exponentials `acc` (online softmax).
struct Partial {
  float* m;    // [rows]
  float* l;    // [rows]
  float* acc;  // [rows, head_dim]
};

// Row r of the partial results against a block's first `visible` keys and values, float32
// rows `stride` elements apart; `s` takes the scores.
inline void attend_row(const float* qr, const float* keys, const float* values, int64_t stride,
                       int64_t visible, int64_t head_dim, float* s, Partial part, int64_t r) {
  for (int64_t t = 0; t < visible; ++t) s[t] = dot(qr, keys + t * stride, head_dim);
  const BlockSoftmax soft = block_softmax(s, visible, part.m[r]);
  weighted_sum(part.acc + r * head_dim, soft.rescale, s, values, visible, stride, head_dim);
  part.l[r] = part.l[r] * soft.rescale + soft.sum;
  part.m[r] = soft.m;
}

// The blocks [first_block, end_block) of one request: every row (query token i = r / num_heads,
// query head r % num_heads) against every key it sees, keys and values read block by block:
// float32 slots in place, the others (bfloat16, float16, int8 / fp8 codes and their scale)
// through a float32 copy of the block, made once for the query heads that share its KV head.
// Measured (6 December, Zen 4, 2 threads, SmolLM2's 9 / 3 heads of 64, 30 layers' caches, 16
// decodes over 800 tokens, in place against copied, medians of 7, four rounds A B A B): float32
// on AVX-512 20-26 ms against 28-32, one decode 1.5-1.9 against 2.1-2.5; on AVX2 within the
// noise (23-31 against 24-28). bfloat16 widened in registers by every row that reads it was
// slower on AVX2, 28 ms against 21: the copy widens a key once for its three query heads.
template <typename T, typename Slot>
void attend_blocks(const float* qbuf, const T* key_cache, const T* value_cache,
                   const int64_t* table, int64_t first_block, int64_t end_block, int64_t ctx,
                   int64_t qlen, int64_t block_size, int64_t num_heads, int64_t num_kv_heads,
                   int64_t head_dim, int64_t slot_dim, Partial part, std::vector<float>& keys,
                   std::vector<float>& values) {
  constexpr bool kInPlace = std::is_same_v<T, float>;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t rows = qlen * num_heads;
  const int64_t token_stride = num_kv_heads * slot_dim;
  const int64_t block_stride = block_size * token_stride;
  float s[kMaxBlockSize] = {};  // a multiple of simd::kWidth
  for (int64_t blk = first_block; blk < end_block; ++blk) {
    const int64_t start = blk * block_size;
    const int64_t n = std::min(block_size, ctx - start);
    const T* kb = key_cache + table[blk] * block_stride;
    const T* vb = value_cache + table[blk] * block_stride;
    if (blk + 1 < end_block)  // the next block is elsewhere: fetch it while this one computes
      prefetch(key_cache + table[blk + 1] * block_stride,
               value_cache + table[blk + 1] * block_stride, block_stride * sizeof(T));
    if constexpr (!kInPlace) {
      // keys and values of the block as float32, [block_size][num_kv_heads][head_dim]
      for (int64_t t = 0; t < n; ++t) {
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          const int64_t at = (t * num_kv_heads + h) * head_dim;
          Slot::load(kb + t * token_stride + h * slot_dim, head_dim, keys.data() + at);
          Slot::load(vb + t * token_stride + h * slot_dim, head_dim, values.data() + at);
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      // Query token i sits at position ctx - qlen + i and sees the keys up to it.
      const int64_t visible = std::min(n, ctx - qlen + r / num_heads + 1 - start);
      if (visible <= 0) continue;
      const int64_t h = (r % num_heads) / group;
      const float* qr = qbuf + r * head_dim;
      if constexpr (kInPlace) {
        attend_row(qr, kb + h * slot_dim, vb + h * slot_dim, token_stride, visible, head_dim, s,
                   part, r);
      } else {
        attend_row(qr, keys.data() + h * head_dim, values.data() + h * head_dim,
                   num_kv_heads * head_dim, visible, head_dim, s, part, r);
      }
    }
  }
}

#if TANDEM_BF16_DOTS
// attend_blocks for bfloat16 queries over a bfloat16 cache, head_dim = 32 C, in bfloat16 dot
// products: scores as `bf16_scores`; values two tokens at a time, each dimension's pair of values
// interleaved once per block and KV head for all the rows of its query heads, weighted by the
// pair of probabilities, each split into two bfloat16 (high + low: 16 significant bits, so the
// weights lose ~2^-17 where one bfloat16 lost 2^-9 and flipped greedy near-ties of a bfloat16
// SmolLM2). Rows are taken KV head by KV head.
template <int C>
void attend_blocks_bf16(const uint16_t* qbits, const uint16_t* key_cache,
                        const uint16_t* value_cache, const int64_t* table, int64_t first_block,
                        int64_t end_block, int64_t ctx, int64_t qlen, int64_t block_size,
                        int64_t num_heads, int64_t num_kv_heads, Partial part, float scale) {
  constexpr int64_t head_dim = 32 * C;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t block_stride = block_size * token_stride;
  // word k of a pair: value k / 2 of the first token (k even) or of the second (k odd)
  alignas(64) static const uint16_t kInterleave[2][32] = {
      {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
       8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47},
      {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
       24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63}};
  const __m512i low = _mm512_load_si512(kInterleave[0]), high = _mm512_load_si512(kInterleave[1]);
  alignas(64) float s[kMaxBlockSize];
  alignas(64) uint16_t p_high[kMaxBlockSize], p_low[kMaxBlockSize];
  __m512i pairs[kMaxBlockSize / 2][2 * C];  // [token pair][dims 16 at a time] value pairs
  for (int64_t blk = first_block; blk < end_block; ++blk) {
    const int64_t start = blk * block_size;
    const int64_t n = std::min(block_size, ctx - start);
    if (blk + 1 < end_block)
      prefetch(key_cache + table[blk + 1] * block_stride,
               value_cache + table[blk + 1] * block_stride, block_stride * sizeof(uint16_t));
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const uint16_t* keys = key_cache + table[blk] * block_stride + h * head_dim;
      const uint16_t* values = value_cache + table[blk] * block_stride + h * head_dim;
      for (int64_t u = 0; 2 * u < n; ++u) {  // past the block's last token: zeros
        const uint16_t* first = values + 2 * u * token_stride;
        for (int c = 0; c < C; ++c) {
          const __m512i a = _mm512_loadu_si512(first + 32 * c);
          const __m512i b = 2 * u + 1 < n ? _mm512_loadu_si512(first + token_stride + 32 * c)
                                          : _mm512_setzero_si512();
          pairs[u][2 * c] = _mm512_permutex2var_epi16(a, low, b);
          pairs[u][2 * c + 1] = _mm512_permutex2var_epi16(a, high, b);
        }
      }
      for (int64_t i = 0; i < qlen; ++i) {
        // Query token i sits at position ctx - qlen + i and sees the keys up to it.
        const int64_t visible = std::min(n, ctx - qlen + i + 1 - start);
        if (visible <= 0) continue;
        for (int64_t j = 0; j < group; ++j) {
          const int64_t r = i * num_heads + h * group + j;
          bf16_scores<C>(qbits + r * head_dim, keys, token_stride, visible, scale, s);
          const BlockSoftmax soft = block_softmax(s, visible, part.m[r]);
          for (int64_t t = 0; t < visible; t += 16) {
            const __mmask16 lanes = _cvtu32_mask16((1u << std::min<int64_t>(16, visible - t)) - 1);
            const __m512 p = _mm512_maskz_loadu_ps(lanes, s + t);  // 0 past `visible`
            // p = high + low, two bfloat16 of 8 bits each: 16 bits of p weight the values
            const __m256bh high = _mm512_cvtneps_pbh(p);
            const __m256bh low = _mm512_cvtneps_pbh(_mm512_sub_ps(p, _mm512_cvtpbh_ps(high)));
            std::memcpy(p_high + t, &high, sizeof high);
            std::memcpy(p_low + t, &low, sizeof low);
          }
          float* acc_r = part.acc + r * head_dim;
          __m512 acc[2 * C];
          for (int k = 0; k < 2 * C; ++k)
            acc[k] = _mm512_mul_ps(_mm512_loadu_ps(acc_r + 16 * k),
                                   _mm512_set1_ps(soft.rescale));
          for (int64_t u = 0; 2 * u < visible; ++u) {
            int32_t high, low;  // p of tokens 2u and 2u + 1 (0 past `visible`)
            std::memcpy(&high, p_high + 2 * u, sizeof high);
            std::memcpy(&low, p_low + 2 * u, sizeof low);
            const __m512bh wh = (__m512bh)_mm512_set1_epi32(high);
            const __m512bh wl = (__m512bh)_mm512_set1_epi32(low);
            for (int k = 0; k < 2 * C; ++k)
              acc[k] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[k], (__m512bh)pairs[u][k], wh),
                                        (__m512bh)pairs[u][k], wl);
          }
          for (int k = 0; k < 2 * C; ++k) _mm512_storeu_ps(acc_r + 16 * k, acc[k]);
          part.l[r] = part.l[r] * soft.rescale + soft.sum;
          part.m[r] = soft.m;
        }
      }
    }
  }
}

using Bf16Blocks = void (*)(const uint16_t*, const uint16_t*, const uint16_t*, const int64_t*,
                            int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                            Partial, float);

// attend_blocks_bf16 for a head size, or null where there is none (not 32, 64, 96 or 128).
Bf16Blocks bf16_blocks_for(int64_t head_dim) {
  switch (head_dim) {
    case 32: return attend_blocks_bf16<1>;
    case 64: return attend_blocks_bf16<2>;
    case 96: return attend_blocks_bf16<3>;
    case 128: return attend_blocks_bf16<4>;
    default: return nullptr;
  }
}
#endif

// Query or output rows (q may be a view of the fused qkv projection's output, rows strided):
// float32, bfloat16 or float16, read and written as float32.
class RowAccess {
 public:
  explicit RowAccess(const Rows& t)
      : base_(static_cast<char*>(t.data)),
        stride_(t.stride * static_cast<int64_t>(c10::elementSize(t.dtype))),
        dtype_(t.dtype) {}

  void get(int64_t row, int64_t n, float scale, float* dst) const {
    switch (dtype_) {
      case c10::ScalarType::Float:
        return convert(reinterpret_cast<const float*>(at(row)), n, scale, dst);
      case c10::ScalarType::BFloat16:
        return convert(reinterpret_cast<const c10::BFloat16*>(at(row)), n, scale, dst);
      default: return convert(reinterpret_cast<const c10::Half*>(at(row)), n, scale, dst);
    }
  }

  bool is_bf16() const { return dtype_ == c10::ScalarType::BFloat16; }

  // the row's bits, bfloat16 rows only
  void bits(int64_t row, int64_t n, uint16_t* dst) const {
    std::memcpy(dst, at(row), n * sizeof(uint16_t));
  }

  void put(int64_t row, int64_t n, const float* src) const {
    switch (dtype_) {
      case c10::ScalarType::Float:
        return convert(src, n, 1.0f, reinterpret_cast<float*>(at(row)));
      case c10::ScalarType::BFloat16:
        return convert(src, n, 1.0f, reinterpret_cast<c10::BFloat16*>(at(row)));
      default: return convert(src, n, 1.0f, reinterpret_cast<c10::Half*>(at(row)));
    }
  }

 private:
  template <typename From, typename To>
  static void convert(const From* src, int64_t n, float scale, To* dst) {
    for (int64_t e = 0; e < n; ++e) dst[e] = static_cast<To>(static_cast<float>(src[e]) * scale);
  }
  char* at(int64_t row) const { return base_ + row * stride_; }

  char* base_;
  int64_t stride_;
  c10::ScalarType dtype_;
};

// A task is a run of one request's blocks: every kSplitTokens of context (split-K, as
// flash-decoding) start a new one, so a batch of one long request still uses every core, and the
// partial results merge at the end, in order. The runs are fixed pieces of the context, whatever
// the batch, the query length or the context's end: a row's keys fall into the same tasks, are
// summed in the same order and merged the same way whether the row is decoded alone or verified
// among drafts, so both give it the same output bit for bit. (The split used to follow the
// batch size and the context's blocks, and rounding then differed between a verify step and the
// decode steps of the same tokens: in bfloat16, enough to change greedy tokens.)
constexpr int64_t kSplitTokens = 256;

template <typename T, typename Slot>
void attend(
    const RowAccess& q,          // [num_tokens, num_heads * head_dim]
    const T* key_cache,          // [num_blocks, block_size, num_kv_heads, slot_dim]
    const T* value_cache,        // same
    const int64_t* block_tables, // [batch, max_blocks]
    const int64_t* context_lens, // [batch]
    const int64_t* query_starts, // [batch + 1]
    const RowAccess& out,        // [num_tokens, num_heads * head_dim], q's dtype
    int64_t batch, int64_t max_blocks, int64_t block_size, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t slot_dim, float scale) {
  const int64_t row_stride = num_heads * head_dim;  // of q and out: one query token
  const int64_t split_blocks = std::max<int64_t>(1, kSplitTokens / block_size);
  struct Task {
    int64_t b, first_block, end_block, state;  // state: offset of its rows in m / l
  };
  std::vector<Task> tasks;
  std::vector<int64_t> first_task(batch + 1);
  int64_t num_states = 0;
  for (int64_t b = 0; b < batch; ++b) {
    first_task[b] = static_cast<int64_t>(tasks.size());
    const int64_t qlen = query_starts[b + 1] - query_starts[b];
    const int64_t blocks = (context_lens[b] + block_size - 1) / block_size;
    if (qlen <= 0 || blocks <= 0) continue;
    for (int64_t first = 0; first < blocks; first += split_blocks) {
      tasks.push_back({b, first, std::min(first + split_blocks, blocks), num_states});
      num_states += qlen * num_heads;
    }
  }
  first_task[batch] = static_cast<int64_t>(tasks.size());
  std::vector<float> m(num_states, -std::numeric_limits<float>::infinity()), l(num_states, 0.0f),
      acc(num_states * head_dim, 0.0f);
#if TANDEM_BF16_DOTS
  const Bf16Blocks bf16 = std::is_same_v<T, c10::BFloat16> && q.is_bf16()
                             ? bf16_blocks_for(head_dim)
                             : nullptr;
#else
  const std::nullptr_t bf16 = nullptr;
#endif
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    const bool copies = bf16 == nullptr && !std::is_same_v<T, float>;
    const int64_t buffer = copies ? kMaxBlockSize * num_kv_heads * head_dim : 0;
    std::vector<float> qbuf, keys(buffer), values(buffer);
    std::vector<uint16_t> qbits;
    for (int64_t i = begin; i < end; ++i) {
      const Task& task = tasks[i];
      const int64_t q0 = query_starts[task.b];
      const int64_t qlen = query_starts[task.b + 1] - q0;
      if (bf16) {
        qbits.resize(qlen * row_stride);
        for (int64_t i = 0; i < qlen; ++i) q.bits(q0 + i, row_stride, &qbits[i * row_stride]);
      } else {
        qbuf.resize(qlen * row_stride);
        for (int64_t i = 0; i < qlen; ++i) q.get(q0 + i, row_stride, scale, &qbuf[i * row_stride]);
      }
      Partial part{m.data() + task.state, l.data() + task.state,
                   acc.data() + task.state * head_dim};
      const int64_t* table = block_tables + task.b * max_blocks;
#if TANDEM_BF16_DOTS
      if (bf16) {
        bf16(qbits.data(), reinterpret_cast<const uint16_t*>(key_cache),
             reinterpret_cast<const uint16_t*>(value_cache), table, task.first_block,
             task.end_block, context_lens[task.b], qlen, block_size, num_heads, num_kv_heads,
             part, scale);
        continue;
      }
#endif
      attend_blocks<T, Slot>(qbuf.data(), key_cache, value_cache, table, task.first_block,
                             task.end_block, context_lens[task.b], qlen, block_size, num_heads,
                             num_kv_heads, head_dim, slot_dim, part, keys, values);
    }
  });
  std::vector<float> merged(row_stride);  // one query token's output
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t q0 = query_starts[b];
    const int64_t rows = (query_starts[b + 1] - q0) * num_heads;
    for (int64_t r = 0; r < rows; ++r) {
      float m_max = -std::numeric_limits<float>::infinity();
      for (int64_t k = first_task[b]; k < first_task[b + 1]; ++k)
        m_max = std::max(m_max, m[tasks[k].state + r]);
      float denom = 0.0f;
      float* dst = merged.data() + (r % num_heads) * head_dim;  // head r % num_heads of the token
      std::fill(dst, dst + head_dim, 0.0f);
      for (int64_t k = first_task[b]; k < first_task[b + 1]; ++k) {
        const int64_t st = tasks[k].state + r;
        if (l[st] == 0.0f) continue;  // a split past this row's position
        const float w = std::exp(m[st] - m_max);
        denom += l[st] * w;
        const float* a = acc.data() + st * head_dim;
        for (int64_t e = 0; e < head_dim; ++e) dst[e] += a[e] * w;
      }
      const float inv = 1.0f / denom;
      for (int64_t e = 0; e < head_dim; ++e) dst[e] *= inv;
      if (r % num_heads == num_heads - 1) out.put(q0 + r / num_heads, row_stride, merged.data());
    }
  }
}

template <typename T, typename Slot>
void run(const AttentionArgs& a) {
  attend<T, Slot>(RowAccess(a.q), static_cast<const T*>(a.key_cache),
                  static_cast<const T*>(a.value_cache), a.block_tables, a.context_lens,
                  a.query_starts, RowAccess(a.out), a.batch, a.max_blocks, a.block_size,
                  a.num_heads, a.num_kv_heads, a.head_dim, a.slot_dim, a.scale);
}

void paged_attention(const AttentionArgs& a) {
  switch (a.cache_dtype) {
    case c10::ScalarType::Float: return run<float, FloatSlot<float>>(a);
    case c10::ScalarType::BFloat16: return run<c10::BFloat16, FloatSlot<c10::BFloat16>>(a);
    case c10::ScalarType::Half: return run<c10::Half, FloatSlot<c10::Half>>(a);
    case c10::ScalarType::Char: return run<int8_t, QuantizedSlot<int8_t>>(a);
    default: return run<c10::Float8_e4m3fn, QuantizedSlot<c10::Float8_e4m3fn>>(a);
  }
}

}  // namespace attention
