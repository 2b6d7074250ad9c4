// Instruction-set levels: the kernels of `csrc/kernels/` are compiled once per level, each in its
// own translation unit (isa_<level>.cpp) and namespace, and a process picks one table of them at
// run time (native.py: the CPU's level, capped by TANDEM_NATIVE_ISA). The build itself never
// looks at the build machine's CPU, so one build runs on any x86-64.
//
// The kernels take raw pointers and plain views, no torch::Tensor: the checks and the output
// tensors stay in the wrappers (paged_attention.cpp, layer_ops.cpp, ...), built once.

#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <vector>

namespace isa {

// The levels, lowest first: each runs only on a CPU that has every extension of its own.
//   generic: the compiler's baseline (x86-64: SSE2; elsewhere the build's own target)
//   avx2: AVX2, FMA, F16C (x86-64-v3: Haswell, Zen 1-3)
//   avx512: + AVX-512 F, BW, DQ, VL (x86-64-v4: Skylake-SP, Zen 4)
//   avx512bf16: + AVX-512 BF16 and VNNI (Cooper Lake, Sapphire Rapids, Zen 4)
enum class Level : int { kGeneric = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

// Rows of a 2-D float32 / bfloat16 / float16 tensor, contiguous within a row.
struct Rows {
  void* data;
  int64_t rows, cols, stride;  // stride: elements from one row to the next
  c10::ScalarType dtype;
};

// Short-query attention over a paged KV cache (kernels/attention.h), blocks of at most
// kMaxAttentionBlockSize tokens.
constexpr int64_t kMaxAttentionBlockSize = 64;

struct AttentionArgs {
  Rows q, out;                          // [num_tokens, num_heads * head_dim]
  const void *key_cache, *value_cache;  // [num_blocks, block_size, num_kv_heads, slot_dim]
  c10::ScalarType cache_dtype;
  const int64_t *block_tables, *context_lens, *query_starts;  // [batch, max_blocks], [batch],
                                                              // [batch + 1]
  int64_t batch, max_blocks, block_size, num_heads, num_kv_heads, head_dim, slot_dim;
  float scale;
};

// int4 / int8 weight tiles times bfloat16 rows (kernels/quant_gemm.h, quant/tiles.py), tiles of
// kQuantTile output channels.
constexpr int64_t kQuantTile = 16;

struct QuantGemmArgs {
  const uint16_t* x;  // bfloat16 bits, row m at x + m * stride
  int64_t rows, in, stride;
  const uint8_t* tiles;      // [num_tiles, in / 2, 16 (int4) or 32 (int8)]
  const uint16_t* scales_zeros;  // bfloat16 bits [num_tiles, in / group_size, 2, 16]
  int64_t num_tiles, group_size;
  bool int4;
  void* y;  // [rows, num_tiles * 16]: float32, or bfloat16 bits
  bool y_float32;
};

struct Kernels {
  const char* name;
  Level level;
  void (*paged_attention)(const AttentionArgs&);
  // out = RMSNorm(x (+= delta first, x float32, where delta.data is not null)) * weight
  void (*rms_norm)(const Rows& x, const Rows& delta, const float* weight, float eps,
                   const Rows& out);
  void (*silu_mul)(const Rows& gate_up, const Rows& out);  // silu(gate) * up of [gate | up]
  // RoPE of q's and k's heads in place, rotate-half convention, cos / sin [rows, head_dim]
  void (*rotary)(const Rows& q, const Rows& k, const Rows& cos, const Rows& sin,
                 int64_t head_dim);
  // y [rows, out] = x [rows, in] @ weight [out, in]^T (+ bias [out] float32, may be null),
  // all float32 or all bfloat16 (bf16), summed in float32 and rounded once
  void (*row_gemm)(const void* x, const void* weight, const float* bias, void* y, int64_t rows,
                   int64_t in, int64_t out, bool bf16);
  void (*quant_gemm)(const QuantGemmArgs&);
};

// The tables built into this library, lowest level first (x86-64: all four; elsewhere generic).
std::vector<const Kernels*> built();
// The highest level this CPU (and its operating system) runs.
Level cpu_level();

}  // namespace isa
