// The kernels for the build's baseline (x86-64: SSE2; Arm: the build's own target, NEON).
#define TANDEM_ISA generic
#define TANDEM_ISA_NAME "generic"
#define TANDEM_ISA_LEVEL Level::kGeneric
#if defined(__x86_64__) || defined(__i386__)
#define TANDEM_VEC_REGISTERS 4
#else
#define TANDEM_VEC_REGISTERS 8
#endif
#define TANDEM_VEC_IS_ONE_REGISTER 0
#define TANDEM_BF16_DOTS 0
#include "isa_kernels.h"
