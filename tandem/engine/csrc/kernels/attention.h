// Short-query attention straight from the paged KV cache, on CPU (the wrapper:
// paged_attention.cpp).
//
// One call covers a step's decodes and speculative verifications: request b has query_lens[b]
// query tokens at the end of its context_lens[b] tokens, whose keys and values sit in the
// blocks block_tables[b]. The kernel reads those blocks where they are, once each (float32
// arithmetic): no block is gathered into a padded copy and no mask is built. The context is cut
// into fixed spans (`kSplitTokens`); a span's scores, its one softmax and its weighted values
// make a partial result, and the spans' partials merge at the end (split-K, as flash-decoding).
// A row sees the keys at positions <= its own (causal within the query), and its arithmetic does
// not depend on the query length, so a verified token scores as a decode would.
//
// bfloat16 queries over a bfloat16 cache, where the CPU has AVX-512 BF16 and heads are 32, 64,
// 96 or 128 wide, take `attend_span_bf16`: the scores are bfloat16 dot products (`vdpbf16ps`,
// float32 sums) straight from the cache, no widened copy of the keys. Measured, 16 decodes over
// ~800 tokens, SmolLM2's heads, 30 layers' caches, 2 threads: 22 ms against 35 for the float32
// path; 16 x 4 verified tokens 48 against 94; one decode 1.5 against 2.4 (4 December, with the
// values in bfloat16 dot products too and the softmax a block).
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

// A block's keys or values, `bytes`, into the outer caches (locality 1: prefetcht2). Into L1
// (prefetcht0) it ran no faster than no prefetch at all, this 15-20% faster (16 contexts of ~800
// tokens, 30 layers' caches, from memory).
inline void prefetch(const void* block, int64_t bytes) {
  for (int64_t byte = 0; byte < bytes; byte += 64)
    __builtin_prefetch(static_cast<const char*>(block) + byte, 0, 1);
}

// The softmax numerators of one row's scores s[0, n) over a task's span, in place: they become
// exp(s - m) (lanes past n up to the register's end unspecified); gives m, their maximum, and
// the exponentials' sum. In whole registers, lanes past n masked.
struct SpanSoftmax {
  float m, sum;
};

inline SpanSoftmax softmax_in_place(float* s, int64_t n) {
  simd::Vec highest = simd::Vec{} - std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < n; t += simd::kWidth) {
    const simd::Vec v = simd::load(s + t);
    highest = simd::visible(t, n) && v > highest ? v : highest;
  }
  const float m = simd::max(highest);
  simd::Vec sums = {};
  for (int64_t t = 0; t < n; t += simd::kWidth) {
    const simd::Vec p = simd::exp(simd::load(s + t) - m);
    sums += simd::visible(t, n) ? p : simd::Vec{};
    simd::store(s + t, p);
  }
  return {m, simd::sum(sums)};
}

// Softmax state of one row over one task's span of its context: the highest score `m`, the sum
// of exp(score - m) `l`, and the values weighted by those exponentials `acc` (the merge in
// `attend` combines a row's spans).
struct Partial {
  float* m;    // [rows]
  float* l;    // [rows]
  float* acc;  // [rows, head_dim], zeros before the task
};

// One task's part of a request: the context's blocks [first_block, end_block), and which of
// their tokens each query token sees. Query token i sits at position ctx - qlen + i and sees the
// keys up to it; row r of the task is query token r / num_heads, query head r % num_heads.
struct Span {
  int64_t first_block, end_block, ctx, qlen, block_size;

  int64_t start() const { return first_block * block_size; }
  // tokens of the span that query token i sees
  int64_t visible(int64_t i) const {
    return std::min(end_block * block_size, ctx - qlen + i + 1) - start();
  }
  // tokens of block `blk` that query token i sees (<= 0: none)
  int64_t visible_in(int64_t blk, int64_t i) const {
    return std::min(block_size, ctx - qlen + i + 1 - blk * block_size);
  }
  // where block `blk`'s scores start in a row of the task's scores
  int64_t offset(int64_t blk) const { return (blk - first_block) * block_size; }
};

// Between a task's two passes: each of its `rows` rows' scores (`stride` floats apart) become
// their softmax numerators over the tokens the row sees, its maximum and sum go to `part`.
inline void softmax_rows(const Span& span, int64_t rows, int64_t num_heads, float* scores,
                         int64_t stride, Partial part) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = span.visible(r / num_heads);
    if (n <= 0) continue;
    const SpanSoftmax soft = softmax_in_place(scores + r * stride, n);
    part.m[r] = soft.m;
    part.l[r] = soft.sum;
  }
}

// Per-thread buffers of the tasks: every row's scores over its span (then its softmax
// numerators), `stride` floats apart, and one block's keys or values as float32 where the cache
// holds another type.
struct Scratch {
  int64_t stride;  // the span's tokens, rounded up to whole registers of 16, plus one register
  std::vector<float> scores;
  std::vector<float> block;

  Scratch(int64_t span_tokens, int64_t block_floats)
      : stride((span_tokens + 15) / 16 * 16 + 16), block(block_floats) {}

  float* scores_for(int64_t rows) {
    scores.resize(rows * stride);
    return scores.data();
  }
};

// The first `n` tokens' keys or values of a block as float32, [token][kv head][head_dim]:
// float32 slots in place, the others (bfloat16, float16, int8 / fp8 codes and their scale)
// through a copy made once for the query heads that share a KV head. (bfloat16 widened in
// registers by every row that reads it was slower on AVX2, 28 ms against 21, 16 decodes over 800
// tokens, 30 layers' caches.)
template <typename T, typename Slot>
const float* block_rows(const T* slots, int64_t n, int64_t num_kv_heads, int64_t head_dim,
                        int64_t slot_dim, std::vector<float>& copy) {
  if constexpr (std::is_same_v<T, float>) {
    return slots;  // a float32 slot is head_dim wide
  } else {
    for (int64_t t = 0; t < n * num_kv_heads; ++t)
      Slot::load(slots + t * slot_dim, head_dim, copy.data() + t * head_dim);
    return copy.data();
  }
}

// One task of a request (`span`), float32 arithmetic: every row's scores over the span's keys
// (pass 1, keys read block by block), their softmax at once, then the values weighted by it
// (pass 2). One softmax a span, not one a block (an online softmax over 16-token blocks): the
// running maximum's rescaling, the reductions and the exponentials of each block's 16 scores
// were a third of a decode's attention time. One decode over 1,000 tokens, SmolLM2's heads, one
// thread, Zen 4 (7 December, loaded machine), a layer: bfloat16 path 72-74 -> 49-57 us with its
// cache in L2/L3, 95-113 -> 77-93 from memory (30 layers' caches); a bfloat16 cache on AVX2
// 150 -> 130; float32 193 -> 148 (AVX-512), 190 -> 162 (AVX2).
template <typename T, typename Slot>
void attend_span(const float* qbuf, const T* key_cache, const T* value_cache,
                 const int64_t* table, const Span& span, int64_t num_heads,
                 int64_t num_kv_heads, int64_t head_dim, int64_t slot_dim, Partial part,
                 Scratch& scratch) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t rows = span.qlen * num_heads;
  const int64_t token_stride = num_kv_heads * slot_dim;
  const int64_t block_stride = span.block_size * token_stride;
  const int64_t stride = scratch.stride;
  float* scores = scratch.scores_for(rows);
  const auto block_tokens = [&](int64_t blk) {
    return std::min(span.block_size, span.ctx - blk * span.block_size);
  };
  for (int64_t blk = span.first_block; blk < span.end_block; ++blk) {
    if (blk + 1 < span.end_block)  // the next block is elsewhere: fetch it while this one computes
      prefetch(key_cache + table[blk + 1] * block_stride, block_stride * sizeof(T));
    const float* keys = block_rows<T, Slot>(key_cache + table[blk] * block_stride,
                                            block_tokens(blk), num_kv_heads, head_dim, slot_dim,
                                            scratch.block);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t visible = span.visible_in(blk, r / num_heads);
      const float* k = keys + ((r % num_heads) / group) * head_dim;
      float* s = scores + r * stride + span.offset(blk);
      for (int64_t t = 0; t < visible; ++t)
        s[t] = dot(qbuf + r * head_dim, k + t * num_kv_heads * head_dim, head_dim);
    }
  }
  softmax_rows(span, rows, num_heads, scores, stride, part);
  for (int64_t blk = span.first_block; blk < span.end_block; ++blk) {
    if (blk + 1 < span.end_block)
      prefetch(value_cache + table[blk + 1] * block_stride, block_stride * sizeof(T));
    const float* values = block_rows<T, Slot>(value_cache + table[blk] * block_stride,
                                              block_tokens(blk), num_kv_heads, head_dim,
                                              slot_dim, scratch.block);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t visible = span.visible_in(blk, r / num_heads);
      if (visible <= 0) continue;
      const float* v = values + ((r % num_heads) / group) * head_dim;
      weighted_sum(part.acc + r * head_dim, 1.0f, scores + r * stride + span.offset(blk), v,
                   visible, num_kv_heads * head_dim, head_dim);
    }
  }
}

#if TANDEM_BF16_DOTS
// attend_span for bfloat16 queries over a bfloat16 cache, head_dim = 32 C: the scores are
// bfloat16 dot products (`bf16_scores`: exact products summed in float32) straight from the
// cache; the values are widened once per block and KV head for all the rows of its query heads
// and weighted by the float32 softmax numerators, as the float32 path does. (Until 7 December the
// values went two tokens a `vdpbf16ps`, each numerator split into two bfloat16, 16 significant
// bits: with the softmax a span, that rounding made a bfloat16 SmolLM2's greedy output leave
// float32's at the fourth token of one prompt, `tests/parity/test_smollm2_greedy.py`; exact
// numerators keep the values' sums as the float32 path computes them.)
template <int C>
void attend_span_bf16(const uint16_t* qbits, const uint16_t* key_cache,
                      const uint16_t* value_cache, const int64_t* table, const Span& span,
                      int64_t num_heads, int64_t num_kv_heads, Partial part, float scale,
                      Scratch& scratch) {
  constexpr int64_t head_dim = 32 * C;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t rows = span.qlen * num_heads;
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t block_stride = span.block_size * token_stride;
  const int64_t stride = scratch.stride;
  float* scores = scratch.scores_for(rows);
  // pass 1: every row's scores, block by block, KV head by KV head
  for (int64_t blk = span.first_block; blk < span.end_block; ++blk) {
    if (blk + 1 < span.end_block)
      prefetch(key_cache + table[blk + 1] * block_stride, block_stride * sizeof(uint16_t));
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const uint16_t* keys = key_cache + table[blk] * block_stride + h * head_dim;
      for (int64_t i = 0; i < span.qlen; ++i) {
        const int64_t visible = span.visible_in(blk, i);
        if (visible <= 0) continue;
        for (int64_t j = 0; j < group; ++j) {
          const int64_t r = i * num_heads + h * group + j;
          bf16_scores<C>(qbits + r * head_dim, keys, token_stride, visible, scale,
                         scores + r * stride + span.offset(blk));
        }
      }
    }
  }
  softmax_rows(span, rows, num_heads, scores, stride, part);
  // pass 2: the weighted values, each KV head's block widened once for its query heads
  float* values = scratch.block.data();  // [block_size][head_dim]
  for (int64_t blk = span.first_block; blk < span.end_block; ++blk) {
    const int64_t n = std::min(span.block_size, span.ctx - blk * span.block_size);
    if (blk + 1 < span.end_block)
      prefetch(value_cache + table[blk + 1] * block_stride, block_stride * sizeof(uint16_t));
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const auto* slots =
          reinterpret_cast<const c10::BFloat16*>(value_cache + table[blk] * block_stride) +
          h * head_dim;
      for (int64_t t = 0; t < n; ++t)
        FloatSlot<c10::BFloat16>::load(slots + t * token_stride, head_dim, values + t * head_dim);
      for (int64_t i = 0; i < span.qlen; ++i) {
        const int64_t visible = span.visible_in(blk, i);
        if (visible <= 0) continue;
        for (int64_t j = 0; j < group; ++j) {
          const int64_t r = i * num_heads + h * group + j;
          weighted_sum(part.acc + r * head_dim, 1.0f, scores + r * stride + span.offset(blk),
                       values, visible, head_dim, head_dim);
        }
      }
    }
  }
}

using Bf16Span = void (*)(const uint16_t*, const uint16_t*, const uint16_t*, const int64_t*,
                          const Span&, int64_t, int64_t, Partial, float, Scratch&);

// attend_span_bf16 for a head size, or null where there is none (not 32, 64, 96 or 128).
Bf16Span bf16_span_for(int64_t head_dim) {
  switch (head_dim) {
    case 32: return attend_span_bf16<1>;
    case 64: return attend_span_bf16<2>;
    case 96: return attend_span_bf16<3>;
    case 128: return attend_span_bf16<4>;
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
  const Bf16Span bf16 = std::is_same_v<T, c10::BFloat16> && q.is_bf16()
                           ? bf16_span_for(head_dim)
                             : nullptr;
#else
  const std::nullptr_t bf16 = nullptr;
#endif
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    const bool copies = !std::is_same_v<T, float>;  // the bfloat16 path widens values too
    Scratch scratch(split_blocks * block_size, copies ? block_size * num_kv_heads * head_dim : 0);
    std::vector<float> qbuf;
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
      const Span span{task.first_block, task.end_block, context_lens[task.b], qlen, block_size};
#if TANDEM_BF16_DOTS
      if (bf16) {
        bf16(qbits.data(), reinterpret_cast<const uint16_t*>(key_cache),
             reinterpret_cast<const uint16_t*>(value_cache), table, span, num_heads,
             num_kv_heads, part, scale, scratch);
        continue;
      }
#endif
      attend_span<T, Slot>(qbuf.data(), key_cache, value_cache, table, span, num_heads,
                           num_kv_heads, head_dim, slot_dim, part, scratch);
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
