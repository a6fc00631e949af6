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

/* `static inline F NAME(const char *row, int64_t i, int dtype)`: the elements [i, i + lanes of F) of a float32
 * or bfloat16 row, as float32 (bfloat16 widens exactly); U16 and U32 are F's lane counts in uint16 / uint32. */
#define DEFINE_ROW_LOAD(NAME, F, U16, U32)                                  \
    static inline F NAME(const char *row, int64_t i, int dtype) {          \
        if (dtype == DTYPE_BF16) {                                          \
            U16 h;                                                          \
            memcpy(&h, row + i * 2, sizeof h);                              \
            return (F)(__builtin_convertvector(h, U32) << 16);              \
        }                                                                   \
        F x;                                                                \
        memcpy(&x, row + i * 4, sizeof x);                                  \
        return x;                                                           \
    }

DEFINE_ROW_LOAD(load16, f32x16, u16x16, u32x16)

#endif
