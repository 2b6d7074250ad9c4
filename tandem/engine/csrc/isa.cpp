// Which levels this library holds and which one the CPU runs (isa.h).

#include "isa.h"

namespace isa {

namespace generic {
extern const Kernels kTable;
}
#if defined(__x86_64__)
namespace avx2 {
extern const Kernels kTable;
}
namespace avx512 {
extern const Kernels kTable;
}
namespace avx512bf16 {
extern const Kernels kTable;
}
#endif

std::vector<const Kernels*> built() {
#if defined(__x86_64__)
  return {&generic::kTable, &avx2::kTable, &avx512::kTable, &avx512bf16::kTable};
#else
  return {&generic::kTable};
#endif
}

Level cpu_level() {
#if defined(__x86_64__)
  // __builtin_cpu_supports checks the CPU's flags and, for AVX / AVX-512 state, that the
  // operating system saves those registers (XGETBV): a VM that hides a flag hides the level.
  __builtin_cpu_init();
  if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi2")))
    return Level::kGeneric;
  if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")))
    return Level::kAvx2;
  if (!(__builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni")))
    return Level::kAvx512;
  return Level::kAvx512Bf16;
#else
  return Level::kGeneric;
#endif
}

}  // namespace isa
