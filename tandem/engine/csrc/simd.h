// One register of float32 lanes through GCC / Clang vector extensions, for the CPU kernels.
//
// A `Vec` is as wide as the level's registers (TANDEM_VEC_WIDTH floats: 16 on AVX-512, 8 on
// AVX2, 4 on SSE and NEON), so the kernels are written once, without intrinsics, in units of
// kWidth, and compiled once per instruction-set level (isa.h). (A 16-lane Vec on AVX2, two ymm
// each, made GCC 12 move every value through the stack: the AVX2 kernels ran 5-20x slower than
// the AVX-512 ones.) Loads and stores go through memcpy (unaligned moves); arithmetic between a
// Vec and a float broadcasts it.
//
// Included once per level, inside its namespace (isa_kernels.h), after the headers below.

#pragma once

#include <cstdint>
#include <cstring>

namespace simd {

constexpr int kWidth = TANDEM_VEC_WIDTH;
static_assert(kWidth == 4 || kWidth == 8 || kWidth == 16, "a register of 4, 8 or 16 floats");

typedef float Vec __attribute__((vector_size(kWidth * sizeof(float))));
typedef int32_t IVec __attribute__((vector_size(kWidth * sizeof(int32_t))));

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }

// A bfloat16 (its bits) as a float32: a bfloat16 is the top half of a float32.
inline float widen(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
}

// kWidth bfloat16 (their bits) as float32 lanes.
inline Vec load(const uint16_t* p) {
  typedef uint16_t Bits __attribute__((vector_size(kWidth * sizeof(uint16_t))));
  Bits bits;
  std::memcpy(&bits, p, sizeof bits);
  return (Vec)(__builtin_convertvector(bits, IVec) << 16);
}

// kWidth bytes zero-extended to int32 lanes. (GCC 12 takes __builtin_convertvector from a vector
// of 8 or 16 bytes apart byte by byte on x86; the extension instructions take one step.)
inline IVec widen_bytes(const uint8_t* p) {
#if TANDEM_VEC_WIDTH == 16 && defined(__x86_64__)
  return (IVec)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif TANDEM_VEC_WIDTH == 8 && defined(__x86_64__)
  return (IVec)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#elif defined(__x86_64__)  // SSE2
  int32_t four;
  std::memcpy(&four, p, sizeof four);
  const __m128i zero = _mm_setzero_si128();
  return (IVec)_mm_unpacklo_epi16(_mm_unpacklo_epi8(_mm_cvtsi32_si128(four), zero), zero);
#else
  typedef uint8_t Bytes __attribute__((vector_size(kWidth)));
  Bytes bytes;
  std::memcpy(&bytes, p, sizeof bytes);
  return __builtin_convertvector(bytes, IVec);
#endif
}

// kWidth int16 sign-extended to int32 lanes.
inline IVec widen_words(const int16_t* p) {
  typedef int16_t Words __attribute__((vector_size(kWidth * sizeof(int16_t))));
  Words words;
  std::memcpy(&words, p, sizeof words);
  return __builtin_convertvector(words, IVec);
}

// kWidth floats as bfloat16 bits, rounded to nearest even (NaN: the quiet NaN), as c10's
// float -> bfloat16 conversion rounds.
inline void store_bf16(uint16_t* p, const float* src) {
  typedef uint32_t UVec __attribute__((vector_size(kWidth * sizeof(uint32_t))));
  typedef uint16_t Bits __attribute__((vector_size(kWidth * sizeof(uint16_t))));
  UVec u;
  std::memcpy(&u, src, sizeof u);
  const UVec rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16;
  const UVec nan = (UVec)((u & 0x7FFFFFFF) > 0x7F800000);  // all ones in a NaN's lane
  const Bits bits = __builtin_convertvector((nan & 0x7FC0) | (~nan & rounded), Bits);
  std::memcpy(p, &bits, sizeof bits);
}

// The sum of the lanes, folded in halves (a tree, not a chain of dependent adds).
inline float sum(Vec v) {
#if !defined(__clang__) && __GNUC__ < 12  // no __builtin_shufflevector: the same tree, by lanes
  float lanes[kWidth];
  std::memcpy(lanes, &v, sizeof lanes);
  for (int width = kWidth / 2; width > 1; width /= 2)
    for (int j = 0; j < width; ++j) lanes[j] += lanes[j + width];
  return lanes[0] + lanes[1];
#else
  typedef float Quarter __attribute__((vector_size(4 * sizeof(float))));
#if TANDEM_VEC_WIDTH == 16
  typedef float Half __attribute__((vector_size(8 * sizeof(float))));
  const Half h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const Quarter q = __builtin_shufflevector(h, h, 0, 1, 2, 3) +
                    __builtin_shufflevector(h, h, 4, 5, 6, 7);
#elif TANDEM_VEC_WIDTH == 8
  const Quarter q = __builtin_shufflevector(v, v, 0, 1, 2, 3) +
                    __builtin_shufflevector(v, v, 4, 5, 6, 7);
#else
  const Quarter q = v;
#endif
  return (q[0] + q[2]) + (q[1] + q[3]);
#endif
}

// The largest lane (a tree of halves, as `sum`).
inline float max(Vec v) {
  float lanes[kWidth];
  std::memcpy(lanes, &v, sizeof lanes);
  for (int width = kWidth / 2; width > 0; width /= 2)
    for (int j = 0; j < width; ++j) lanes[j] = lanes[j] > lanes[j + width] ? lanes[j] : lanes[j + width];
  return lanes[0];
}

// Lanes i of the register at element `start` whose element start + i is below `end`.
inline IVec visible(int64_t start, int64_t end) {
  IVec lane;
  for (int i = 0; i < kWidth; ++i) lane[i] = i;
  return lane < static_cast<int32_t>(end - start);
}

// e^x lane by lane: e^x = 2^n e^r with n = round(x / ln 2), r in [-ln2/2, ln2/2], e^r by
// Cephes' expf polynomial (about 1 ulp). x is clamped to [-87, 88.37]: below, e^-87 (~1e-38)
// rather than 0; above, ~3.4e38, the largest float (2^n stays a normal float's exponent).
inline Vec exp(Vec x) {
  const Vec lowest = Vec{} - 87.0f, highest = Vec{} + 88.3762626647949f;
  x = x < lowest ? lowest : x;
  x = x > highest ? highest : x;
  const float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer in the low bits
  const Vec shifted = x * 1.44269504088896341f + kRound;
  const Vec n = shifted - kRound;
  const Vec r = x - n * 0.693359375f + n * 2.12194440e-4f;
  Vec p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  // 2^n from n's bits: the integer n sits in the low bits of `shifted`.
  const IVec bits = (((IVec)shifted - 0x4B400000) + 127) << 23;
  return p * (Vec)bits;
}

}  // namespace simd
