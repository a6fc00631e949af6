/* Paged decode attention on CPU: one query token per request, keys read in place.
 *
 * For every (request, kv head) pair, the G = num_heads / num_kv_heads query
 * heads that share the kv head are computed together, so each key and value
 * row is loaded and widened once for G heads. Keys and values are read
 * straight from the paged cache through the block table: no gather copy, no
 * padding, no mask. Arithmetic is float32 in 16-lane vectors (GCC vector
 * extensions, lowered to whatever SIMD the machine has) whatever the cache
 * dtype; bfloat16 is widened on load and rounded to nearest even on store,
 * as torch does.
 *
 * Each (request, kv head) is computed by one thread in a fixed order, so a
 * request's result never depends on the rest of the batch.
 *
 * Layouts (element strides, innermost dimension contiguous):
 *   q, out        [num_tokens, num_heads, head_dim], token stride given
 *   k/v cache     [num_slots, num_kv_heads, head_dim], contiguous
 *   block_table   [num_reqs, block_table_stride] int64
 *   rows          [num_reqs] int64: the token row of each request's query
 *   context_lens  [num_reqs] int64: keys to attend, the new token included
 * head_dim must be a multiple of 16 and at most 256; G at most 16.
 */

#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"

#define LANES 16
#define MAX_CHUNKS 16 /* head_dim / LANES */
#define MAX_GROUP 16

typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1 };

static const f32x16 ZERO = {0};

/* Lanes [i*16, i*16+16) of a float32 or bfloat16 row, as float32. */
static inline f32x16 load16(const char *row, int64_t i, int dtype) {
    if (dtype == DTYPE_BF16) {
        u16x16 h;
        memcpy(&h, row + i * LANES * 2, sizeof h);
        return (f32x16)(__builtin_convertvector(h, u32x16) << 16);
    }
    f32x16 x;
    memcpy(&x, row + i * LANES * 4, sizeof x);
    return x;
}

static inline void store16(char *row, int64_t i, int dtype, f32x16 x) {
    if (dtype == DTYPE_BF16) {
        uint16_t *h = (uint16_t *)row + i * LANES;
        for (int l = 0; l < LANES; l++) h[l] = narrow(x[l]);
    } else {
        memcpy(row + i * LANES * 4, &x, sizeof x);
    }
}

/* Sum of the lanes as a tree of halves (a serial sum would be a 16-add dependency chain). */
static inline float hsum(f32x16 x) {
    f32x8 lo8, hi8;
    memcpy(&lo8, &x, sizeof lo8);
    memcpy(&hi8, (const char *)&x + sizeof lo8, sizeof hi8);
    const f32x8 y = lo8 + hi8;
    f32x4 lo4, hi4;
    memcpy(&lo4, &y, sizeof lo4);
    memcpy(&hi4, (const char *)&y + sizeof lo4, sizeof hi4);
    const f32x4 z = lo4 + hi4;
    return (z[0] + z[2]) + (z[1] + z[3]);
}

/* Walks positions 0, 1, 2, ... through the block table without a division per position. */
struct slot_cursor {
    int64_t block, offset;
};

/* The cache slot of the cursor's position, then advance the cursor by one position. */
static inline int64_t next_slot(const int64_t *blocks, int64_t block_size, struct slot_cursor *cur) {
    const int64_t slot = blocks[cur->block] * block_size + cur->offset;
    if (++cur->offset == block_size) {
        cur->offset = 0;
        cur->block++;
    }
    return slot;
}

/* One (request, kv head): `group` query heads of `chunks` * 16 lanes each. */
static inline __attribute__((always_inline)) void attend(
    const char *q, const char *k_cache, const char *v_cache, char *out, const int64_t *blocks, int64_t ctx,
    int64_t kv_row_bytes, int64_t block_size, int dtype, float scale, float *restrict scores, const int group,
    const int chunks) {
    f32x16 qv[MAX_GROUP][MAX_CHUNKS], acc[MAX_GROUP][MAX_CHUNKS];
    const int64_t head_bytes = (int64_t)chunks * LANES * (dtype == DTYPE_BF16 ? 2 : 4);
    for (int g = 0; g < group; g++)
        for (int c = 0; c < chunks; c++) {
            qv[g][c] = load16(q + g * head_bytes, c, dtype) * scale;
            acc[g][c] = ZERO;
        }
    /* Pass 1: every key's score for the group's heads; head g's scores start at g * ctx. */
    float max_score[MAX_GROUP];
    for (int g = 0; g < group; g++) max_score[g] = -FLT_MAX;
    struct slot_cursor cursor = {0, 0};
    for (int64_t pos = 0; pos < ctx; pos++) {
        const char *k_row = k_cache + next_slot(blocks, block_size, &cursor) * kv_row_bytes;
        f32x16 s[MAX_GROUP];
        for (int g = 0; g < group; g++) s[g] = ZERO;
        for (int c = 0; c < chunks; c++) {
            const f32x16 k = load16(k_row, c, dtype);
            for (int g = 0; g < group; g++) s[g] += qv[g][c] * k;
        }
        for (int g = 0; g < group; g++) {
            const float sg = hsum(s[g]);
            scores[g * ctx + pos] = sg;
            max_score[g] = sg > max_score[g] ? sg : max_score[g];
        }
    }
    /* Softmax numerators. */
    float denom[MAX_GROUP];
    for (int g = 0; g < group; g++) {
        float *sg = scores + g * ctx, sum = 0.0f;
        const float m = max_score[g];
#pragma omp simd reduction(+ : sum)
        for (int64_t pos = 0; pos < ctx; pos++) {
            sg[pos] = exp_nonpositive(sg[pos] - m);
            sum += sg[pos];
        }
        denom[g] = sum;
    }
    /* Pass 2: the weighted sum of values. */
    cursor = (struct slot_cursor){0, 0};
    for (int64_t pos = 0; pos < ctx; pos++) {
        const char *v_row = v_cache + next_slot(blocks, block_size, &cursor) * kv_row_bytes;
        for (int c = 0; c < chunks; c++) {
            const f32x16 v = load16(v_row, c, dtype);
            for (int g = 0; g < group; g++) acc[g][c] += scores[g * ctx + pos] * v;
        }
    }
    for (int g = 0; g < group; g++)
        for (int c = 0; c < chunks; c++) store16(out + g * head_bytes, c, dtype, acc[g][c] * (1.0f / denom[g]));
}

/* Returns 0, or 1 for shapes this kernel does not take, 2 when scratch memory could not be allocated. */
int decode_attention(const void *q, int64_t q_token_stride, const void *k_cache, const void *v_cache,
                     const int64_t *block_table, int64_t block_table_stride, const int64_t *rows,
                     const int64_t *context_lens, void *out, int64_t out_token_stride, int64_t num_reqs,
                     int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                     int64_t max_context_len, int dtype, int num_threads) {
    const int64_t group = num_kv_heads > 0 ? num_heads / num_kv_heads : 0, chunks = head_dim / LANES;
    if (group < 1 || group > MAX_GROUP || group * num_kv_heads != num_heads || head_dim % LANES != 0 ||
        chunks > MAX_CHUNKS)
        return 1;
    const int64_t elem = dtype == DTYPE_BF16 ? 2 : 4, head_bytes = head_dim * elem;
    int status = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc(sizeof(float) * group * (max_context_len > 0 ? max_context_len : 1));
        if (scores == NULL) {
#pragma omp atomic write
            status = 2;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_reqs * num_kv_heads; item++) {
            if (scores == NULL) continue;
            const int64_t req = item / num_kv_heads, kvh = item % num_kv_heads;
            const char *q_heads = (const char *)q + rows[req] * q_token_stride * elem + kvh * group * head_bytes;
            char *out_heads = (char *)out + rows[req] * out_token_stride * elem + kvh * group * head_bytes;
            const char *k = (const char *)k_cache + kvh * head_bytes, *v = (const char *)v_cache + kvh * head_bytes;
            const int64_t *blocks = block_table + req * block_table_stride;
            const int64_t ctx = context_lens[req], row_bytes = num_kv_heads * head_bytes;
            /* Constant shapes let the compiler keep the accumulators in registers. */
            if (group == 3 && chunks == 4)
                attend(q_heads, k, v, out_heads, blocks, ctx, row_bytes, block_size, dtype, scale, scores, 3, 4);
            else if (group == 4 && chunks == 4)
                attend(q_heads, k, v, out_heads, blocks, ctx, row_bytes, block_size, dtype, scale, scores, 4, 4);
            else if (group == 2 && chunks == 1)
                attend(q_heads, k, v, out_heads, blocks, ctx, row_bytes, block_size, dtype, scale, scores, 2, 1);
            else
                attend(q_heads, k, v, out_heads, blocks, ctx, row_bytes, block_size, dtype, scale, scores,
                       (int)group, (int)chunks);
        }
        free(scores);
    }
    return status;
}
