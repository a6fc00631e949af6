/* 16-lane float32 vectors shared by the CPU kernels (GCC vector extensions, lowered to
 * whatever SIMD the machine has), the dtype codes the Python wrappers pass, and a
 * float32-or-bfloat16 row load.
 */

#ifndef ASYNCPP_CPU_VEC_H
#define ASYNCPP_CPU_VEC_H

#include <stdint.h>
#include <string.h>

#define LANES 16

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1 };

/* Elements [i, i + 16) of a float32 or bfloat16 row, as float32 (bfloat16 widens exactly). */
static inline f32x16 load16(const char *row, int64_t i, int dtype) {
    if (dtype == DTYPE_BF16) {
        u16x16 h;
        memcpy(&h, row + i * 2, sizeof h);
        return (f32x16)(__builtin_convertvector(h, u32x16) << 16);
    }
    f32x16 x;
    memcpy(&x, row + i * 4, sizeof x);
    return x;
}

#endif
