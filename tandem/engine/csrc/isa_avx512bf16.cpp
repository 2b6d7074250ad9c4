// The kernels for AVX-512 with BF16 and VNNI (Cooper Lake, Sapphire Rapids, Zen 4); nothing
// elsewhere.
#if defined(__x86_64__)
#define TANDEM_ISA avx512bf16
#define TANDEM_ISA_NAME "avx512bf16"
#define TANDEM_ISA_LEVEL Level::kAvx512Bf16
#define TANDEM_TARGET \
  "avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt,movbe,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx512vnni"
#define TANDEM_VEC_WIDTH 16
#define TANDEM_VEC_REGISTERS 32
#define TANDEM_BF16_DOTS 1
#include "isa_kernels.h"
#endif
