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

typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x4 __attribute__((vector_size(16)));
typedef uint16_t u16x4 __attribute__((vector_size(8)));

/* bfloat16 bits h as float32 bits (exact: h moved to the high half). GCC 12 lowers the vector-extension
 * conversion of 16 (AVX-512) or 8 (AVX2) lanes through 128-bit halves, 5-6 instructions where one
 * zero-extending load and a shift do: decode attention's score loop widens 4 keys' chunks per key. */
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
static inline u32x16 widen_bf16x16(u16x16 h) { return (u32x16)_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16); }
#else
static inline u32x16 widen_bf16x16(u16x16 h) { return __builtin_convertvector(h, u32x16) << 16; }
#endif
#if defined(__AVX2__)
static inline u32x8 widen_bf16x8(u16x8 h) { return (u32x8)_mm256_slli_epi32(_mm256_cvtepu16_epi32((__m128i)h), 16); }
#else
static inline u32x8 widen_bf16x8(u16x8 h) { return __builtin_convertvector(h, u32x8) << 16; }
#endif
static inline u32x4 widen_bf16x4(u16x4 h) { return __builtin_convertvector(h, u32x4) << 16; }
#define WIDEN_BF16(h) _Generic((h), u16x16: widen_bf16x16, u16x8: widen_bf16x8, u16x4: widen_bf16x4)(h)

/* cpu_math.h's narrow() on 16 lanes (nearest, ties to even; a NaN stays a quiet NaN), the NaN test
 * from a sign bit: bfloat16 bits in each lane's low half. */
static inline u32x16 narrow16(f32x16 f) {
    const u32x16 u = (u32x16)f;
    const i32x16 is_nan = (0x7F800000 - ((i32x16)u & 0x7FFFFFFF)) >> 31;
    const u32x16 quiet = (u >> 16) | 0x40, rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16;
    return (u32x16)(((i32x16)quiet & is_nan) | ((i32x16)rounded & ~is_nan));
}

/* bfloat16 bits in each lane's low half (narrow16's result) -> float32, exactly. */
static inline f32x16 widen16(u32x16 h) { return (f32x16)(h << 16); }

/* `static inline F NAME(const char *row, int64_t i, int dtype)`: the elements [i, i + lanes of F) of a float32
 * or bfloat16 row, as float32 (bfloat16 widens exactly); U16 is F's lane count in uint16 (16, 8 or 4). */
#define DEFINE_ROW_LOAD(NAME, F, U16)                                       \
    static inline F NAME(const char *row, int64_t i, int dtype) {           \
        if (dtype == DTYPE_BF16) {                                          \
            U16 h;                                                          \
            memcpy(&h, row + i * 2, sizeof h);                              \
            return (F)WIDEN_BF16(h);                                        \
        }                                                                   \
        F x;                                                                \
        memcpy(&x, row + i * 4, sizeof x);                                  \
        return x;                                                           \
    }

DEFINE_ROW_LOAD(load16, f32x16, u16x16)

#endif
