// Sixteen float32 lanes through GCC / Clang vector extensions, for the CPU kernels.
//
// The compiler maps a `Vec` to one AVX-512 register, two AVX2 ones, four SSE or NEON ones, so the
// kernels are written once, without intrinsics, and compiled once per instruction-set level
// (isa.h). Loads and stores go through memcpy (unaligned moves); arithmetic between a Vec and a
// float broadcasts it.
//
// Included once per level, inside its namespace (isa_kernels.h), after the headers below.

#pragma once

#include <cstdint>
#include <cstring>

namespace simd {

constexpr int kWidth = 16;

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

// The sum of the lanes, folded in halves (a tree, not a chain of 15 dependent adds).
inline float sum(Vec v) {
#if defined(__clang__) || __GNUC__ >= 12  // __builtin_shufflevector: clang, GCC 12 on
  typedef float Half __attribute__((vector_size(sizeof(Vec) / 2)));
  typedef float Quarter __attribute__((vector_size(sizeof(Vec) / 4)));
  const Half h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const Quarter q = __builtin_shufflevector(h, h, 0, 1, 2, 3) +
                    __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (q[0] + q[2]) + (q[1] + q[3]);
#else
  float lanes[kWidth];
  std::memcpy(lanes, &v, sizeof lanes);
  for (int width = kWidth / 2; width > 0; width /= 2)
    for (int j = 0; j < width; ++j) lanes[j] += lanes[j + width];
  return lanes[0];
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
  const IVec lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
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
