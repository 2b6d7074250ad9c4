// The kernels for AVX2 + FMA + F16C (x86-64-v3); nothing elsewhere.
#if defined(__x86_64__)
#define TANDEM_ISA avx2
#define TANDEM_ISA_NAME "avx2"
#define TANDEM_ISA_LEVEL Level::kAvx2
#define TANDEM_TARGET "avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt,movbe"
#define TANDEM_VEC_WIDTH 8
#define TANDEM_VEC_REGISTERS 16
#define TANDEM_BF16_DOTS 0
#include "isa_kernels.h"
#endif
