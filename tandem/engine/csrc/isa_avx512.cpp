// The kernels for AVX-512 F/BW/DQ/VL (x86-64-v4); nothing elsewhere.
#if defined(__x86_64__)
#define TANDEM_ISA avx512
#define TANDEM_ISA_NAME "avx512"
#define TANDEM_ISA_LEVEL Level::kAvx512
#define TANDEM_TARGET "avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt,movbe,avx512f,avx512bw,avx512dq,avx512vl"
#define TANDEM_VEC_WIDTH 16
#define TANDEM_VEC_REGISTERS 32
#define TANDEM_BF16_DOTS 0
#include "isa_kernels.h"
#endif
