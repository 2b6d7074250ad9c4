// The body of one instruction-set level's translation unit (isa_<level>.cpp): every kernel of
// `kernels/`, compiled for the level and kept in its own namespace, and the level's table.
//
// The includer defines TANDEM_ISA (the namespace), TANDEM_ISA_NAME, TANDEM_ISA_LEVEL,
// TANDEM_TARGET (the compiler's target string, or none: the build's baseline), TANDEM_VEC_WIDTH
// (float32 lanes of a vector register: 16 AVX-512, 8 AVX2, 4 SSE or NEON), TANDEM_VEC_REGISTERS
// (how many: 32 AVX-512 and NEON, 16 AVX2 and SSE) and TANDEM_BF16_DOTS (AVX-512 BF16's
// `vdpbf16ps`).
//
// Every header the kernels need is included here, before the target is switched on: the library
// and torch code they call is compiled for the baseline, which any level may call and inline.
// Only the kernels, in their level's namespace, are compiled for the level, so no function of
// one level can stand in for another's at link time.

#include "isa.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

// (#pragma does not expand macros; _Pragma of a string built from the expanded TANDEM_TARGET does)
#define TANDEM_PRAGMA(text) _Pragma(#text)
#define TANDEM_TARGET_ON(features) TANDEM_PRAGMA(GCC target(features))
#define TANDEM_CLANG_TARGET_ON(features) \
  TANDEM_PRAGMA(clang attribute push(__attribute__((target(features))), apply_to = function))

#ifdef TANDEM_TARGET
#if defined(__clang__)
TANDEM_CLANG_TARGET_ON(TANDEM_TARGET)
#else
#pragma GCC push_options
TANDEM_TARGET_ON(TANDEM_TARGET)
#endif
#endif

namespace isa::TANDEM_ISA {

#include "simd.h"
#include "kernels/attention.h"
#include "kernels/layer_ops.h"
#include "kernels/quant_gemm.h"
#include "kernels/row_gemm.h"

extern const Kernels kTable = {
    TANDEM_ISA_NAME,          TANDEM_ISA_LEVEL,   attention::paged_attention,
    layer_ops::rms_norm,      layer_ops::silu_mul, layer_ops::rotary,
    row_gemm::row_gemm,       quant_gemm::quant_gemm,
};

}  // namespace isa::TANDEM_ISA

#ifdef TANDEM_TARGET
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif
