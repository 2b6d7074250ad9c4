// The kernels for the build's baseline (x86-64: SSE2; Arm: the build's own target, NEON).
#define TANDEM_ISA generic
#define TANDEM_ISA_NAME "generic"
#define TANDEM_ISA_LEVEL Level::kGeneric
#define TANDEM_VEC_WIDTH 4
#if defined(__aarch64__)
#define TANDEM_VEC_REGISTERS 32
#else
#define TANDEM_VEC_REGISTERS 16
#endif
#define TANDEM_BF16_DOTS 0
#include "isa_kernels.h"
