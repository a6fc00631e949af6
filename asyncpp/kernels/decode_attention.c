/* Paged decode attention on CPU: one query token per row, keys read in place.
 *
 * A row (one query token) is computed whole by one thread, all its heads
 * together, in two passes over its context, 16 positions (a tile) at a time:
 * pass 1 scores every key for every head, pass 2, after the softmax
 * numerators, sums the values weighted by them. Keys and values are read
 * straight from the paged cache through the block table: no gather copy, no
 * padding, no mask. Arithmetic is float32 in 16-lane vectors (GCC vector
 * extensions, lowered to whatever SIMD the machine has) whatever the cache
 * dtype; bfloat16 is widened on load and rounded to nearest even on store,
 * as torch does. With AVX2 (16 registers of 8 lanes) the per-tile functions
 * are written for 8-lane vectors instead (16-lane ones would spill), with
 * the same operations lane for lane, so the same results as the generic
 * level bit for bit.
 *
 * Memory: a step reads every layer's cache once, so a row's K and V rows are
 * mostly cold, and reading them is most of the cost. A tile's slots are
 * read whole (all kv heads: one slot is contiguous), each kv head's G =
 * num_heads / num_kv_heads query heads computed together so a key or value
 * row is widened once for G heads. Each pass streams one cache and requests
 * the next one the thread needs into the cache hierarchy: pass 1 reads the
 * tile's K slots and prefetches its V slots; pass 2 reads the V slots and
 * prefetches the K slots of the thread's next row (its next row is known:
 * each thread takes a contiguous range of rows, balanced by context length).
 * `python -m asyncpp.bench.attention` times a cold stage step (1.4x faster
 * than one (request, kv head) per work item, K then V, prefetched 16
 * positions ahead, with the same results bit for bit).
 *
 * Rows of one request (a token and its speculative drafts, a prefill chunk:
 * the same block table) that follow each other go through the tiles in
 * groups of up to 4 (`attend_group`): each key and value row is widened
 * once for the group, and the group requests its keys eight tiles ahead. Each
 * row's arithmetic is unchanged, so its bits are those it gets alone
 * (1.05-1.1x on 8 requests x 5 rows, 1.1x on prefill chunks, Zen 4: bench
 * `--rows-per-request`). The arithmetic is bound by the multiplies and adds
 * themselves (no FMA: -std=c11 keeps every level's rounding the same), so
 * sharing the loads gains little more.
 *
 * Arithmetic, per head: a key's score is the lane sums of q * k over the
 * 16-lane chunks of the head, added chunk after chunk, reduced by a tree of
 * halves (`hsum16`, 16 keys at once; with AVX2 the first step adds the
 * two 8-lane halves, `hsum8` does the rest); the softmax numerators
 * exp(s - max) and their sum (position after position, except with AVX-512,
 * where GCC vectorises that loop); then the values, weighted, added
 * position after position, times 1 / sum. The order is fixed per row, so a
 * row's result never depends on the rest of the batch or on the number of
 * threads.
 *
 * At the avx512_bf16 level, bfloat16 caches with head_dim a multiple of 32 take vdpbf16ps instead, for
 * every row: `attention_dpbf16.h` (its own arithmetic and bits, with the same invariances).
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
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"
#include "cpu_vec.h"

#if defined(__AVX2__) && !defined(__AVX512F__)
#include <immintrin.h>
#define EIGHT_LANES /* the per-tile arithmetic in 8-lane vectors: see "AVX2" below */
#endif

#define MAX_CHUNKS 16 /* head_dim / LANES */
#define MAX_GROUP 16

static const f32x16 ZERO = {0};

/* Store x as elements [i, i + 16) of a float32 or bfloat16 row (bfloat16 rounded to nearest even, 16
 * lanes at once: lane by lane, the 576 outputs of a SmolLM2 row took 8% of a 4-row call). */
static inline void store16(char *row, int64_t i, int dtype, f32x16 x) {
    if (dtype == DTYPE_BF16) {
        const u16x16 h = __builtin_convertvector(narrow16(x), u16x16);
        memcpy((uint16_t *)row + i, &h, sizeof h);
    } else {
        memcpy(row + i * 4, &x, sizeof x);
    }
}

/* The shapes of one call. */
struct layer {
    const char *k_cache, *v_cache;
    int64_t num_kv_heads, head_bytes, slot_bytes, block_size; /* slot_bytes: all kv heads of one slot */
    int dtype;
    float scale;
};

/* The rows of one call, as the caller passes them. */
struct batch {
    const char *q;
    char *out;
    int64_t q_stride, out_stride, elem; /* token strides in elements; bytes per element */
    const int64_t *rows, *block_table, *context_lens;
    int64_t block_table_stride;
};

/* One row: its query and output heads, its blocks, its context length. */
struct row {
    const char *q;
    char *out;
    const int64_t *blocks;
    int64_t ctx;
};

static inline struct row row_at(const struct batch *B, int64_t i) {
    return (struct row){B->q + B->rows[i] * B->q_stride * B->elem, B->out + B->rows[i] * B->out_stride * B->elem,
                        B->block_table + i * B->block_table_stride, B->context_lens[i]};
}

/* Per-thread scratch for one row of `num_heads` heads and up to `stride` positions. */
struct scratch {
    float *scores;     /* [num_heads][stride]: scores, then softmax numerators */
    float *q;          /* [num_heads][head_dim]: the scaled query */
    f32x16 *acc;       /* [num_heads][chunks]: the weighted value sums */
    f32x16 *max_score; /* [num_heads]: per lane, the largest score so far */
    float *denom;      /* [num_heads]: the sum of the softmax numerators */
    int64_t stride;
};

/* The positions in tile t (positions [16t, 16t + 16)) of a row of ctx positions. */
static inline int tile_size(int64_t ctx, int64_t t) { return ctx - t * LANES < LANES ? (int)(ctx - t * LANES) : LANES; }

/* The byte offsets in the cache of the n first positions of tile t of a row with these blocks. */
static inline void tile_offsets(const struct layer *L, const int64_t *blocks, int64_t t, int n, int64_t off[LANES]) {
    int64_t block = t * LANES / L->block_size, offset = t * LANES % L->block_size;
    for (int j = 0; j < n; j++) {
        off[j] = (blocks[block] * L->block_size + offset) * L->slot_bytes;
        if (++offset == L->block_size) {
            offset = 0;
            block++;
        }
    }
}

/* Request `bytes` at p into L2 (what a thread requests is read up to a row later, which L1 would not keep:
 * into L1, the step of `asyncpp.bench.attention` took 1.35x as long). */
static inline void prefetch(const char *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 2);
}

/* Request the K slots of a row's tiles [first, last). */
static inline void prefetch_keys(const struct layer *L, const struct row *r, int64_t first, int64_t last) {
    int64_t off[LANES];
    for (int64_t t = first; t < last; t++) {
        const int n = tile_size(r->ctx, t);
        tile_offsets(L, r->blocks, t, n, off);
        for (int j = 0; j < n; j++) prefetch(L->k_cache + off[j], L->slot_bytes);
    }
}

/* The slots of a tile to request while another is computed: at `base` + off[j], j < n. */
struct ahead {
    const char *base;
    const int64_t *off;
    int n;
};

/* The largest of x's lanes. */
static inline float largest_lane(f32x16 x) {
    float m = -FLT_MAX;
    for (int l = 0; l < LANES; l++) m = x[l] > m ? x[l] : m;
    return m;
}

#ifndef EIGHT_LANES
/* The per-tile arithmetic in 16-lane vectors (AVX-512: one register each; generic: lowered to what the
 * target has). */

#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (u32x16){__VA_ARGS__})
#endif

/* r[j] = the sum of v[j]'s lanes, for 16 vectors at once. Each sum is a tree of halves (lane l + lane
 * l+8, then +4, +2, +1; a serial sum would be a 16-add chain), the same for every key whatever its
 * tile; 16 x 3 shuffle-and-adds instead of 16 x 4 horizontal steps. */
static inline f32x16 hsum16(const f32x16 v[LANES]) {
    f32x16 w[8], x[4], y[2];
    for (int i = 0; i < 8; i++) /* lanes 0-7: v[2i]'s 8 partial sums, 8-15: v[2i+1]'s */
        w[i] = SHUFFLE(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               SHUFFLE(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++) /* quads: v[4i], v[4i+2], v[4i+1], v[4i+3] */
        x[i] = SHUFFLE(w[2 * i], w[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
               SHUFFLE(w[2 * i], w[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++) /* pairs: v[8i + 0, 4, 2, 6, 1, 5, 3, 7] */
        y[i] = SHUFFLE(x[2 * i], x[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
               SHUFFLE(x[2 * i], x[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    /* z[2k] = sum of v[p[k]], z[2k+1] = sum of v[8 + p[k]], p = 0, 4, 2, 6, 1, 5, 3, 7 */
    const f32x16 z = SHUFFLE(y[0], y[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
                     SHUFFLE(y[0], y[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    return SHUFFLE(z, z, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}

static const i32x16 LANE_INDEX = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

/* A head's scores sg for a tile's 16 positions, stored at dst; those of its n first positions (the keys)
 * kept in the per-lane maxima. */
static inline void keep_scores(float *dst, f32x16 sg, f32x16 *max_score, int n) {
    memcpy(dst, &sg, sizeof sg);
    const i32x16 larger = (sg > *max_score) & (LANE_INDEX < (i32x16){0} + n);
    *max_score = (f32x16)(((i32x16)sg & larger) | ((i32x16)*max_score & ~larger));
}

/* Pass 1 for one kv head and one tile of n keys (at `k_head` + off[j]): the scores of its `group` heads,
 * head g's stored at scores[g * stride], and their per-lane maxima. This kv head's part of the slots in
 * `pf` (`pf_head`: its offset) is requested meanwhile. */
static inline __attribute__((always_inline)) void score_tile(
    const float *q, const char *k_head, const int64_t off[LANES], int n, const struct ahead *pf, int64_t pf_head,
    int dtype, float *scores, int64_t stride, f32x16 *max_score, const int group, const int chunks) {
    const int64_t head_bytes = (int64_t)chunks * LANES * (dtype == DTYPE_BF16 ? 2 : 4);
    f32x16 qv[MAX_GROUP][MAX_CHUNKS], s[MAX_GROUP][LANES];
    for (int g = 0; g < group; g++)
        for (int c = 0; c < chunks; c++) memcpy(&qv[g][c], q + (g * chunks + c) * LANES, sizeof(f32x16));
    for (int j = 0; j < LANES; j++) {
        if (j < pf->n) prefetch(pf->base + pf->off[j] + pf_head, head_bytes);
        if (j >= n) {
            for (int g = 0; g < group; g++) s[g][j] = ZERO;
            continue;
        }
        const f32x16 k0 = load16(k_head + off[j], 0, dtype);
        for (int g = 0; g < group; g++) s[g][j] = qv[g][0] * k0;
        for (int c = 1; c < chunks; c++) {
            const f32x16 k = load16(k_head + off[j], c * LANES, dtype);
            for (int g = 0; g < group; g++) s[g][j] += qv[g][c] * k;
        }
    }
    for (int g = 0; g < group; g++) keep_scores(scores + g * stride, hsum16(s[g]), &max_score[g], n);
}

/* Pass 2 for one kv head and one tile of n value rows (at `v_head` + off[j]): acc[g][c] += w * v for its
 * `group` heads, head g's weights at weights[g * stride]. This kv head's part of the slots in `pf` is
 * requested meanwhile. */
static inline __attribute__((always_inline)) void value_tile(
    const float *weights, int64_t stride, const char *v_head, const int64_t off[LANES], int n,
    const struct ahead *pf, int64_t pf_head, int dtype, f32x16 *acc, const int group, const int chunks) {
    const int64_t head_bytes = (int64_t)chunks * LANES * (dtype == DTYPE_BF16 ? 2 : 4);
    f32x16 a[MAX_GROUP][MAX_CHUNKS];
    for (int g = 0; g < group; g++)
        for (int c = 0; c < chunks; c++) a[g][c] = acc[g * chunks + c];
    for (int j = 0; j < n; j++) {
        if (j < pf->n) prefetch(pf->base + pf->off[j] + pf_head, head_bytes);
        for (int c = 0; c < chunks; c++) {
            const f32x16 v = load16(v_head + off[j], c * LANES, dtype);
            for (int g = 0; g < group; g++) a[g][c] += weights[g * stride + j] * v;
        }
    }
    for (int j = n; j < pf->n; j++) prefetch(pf->base + pf->off[j] + pf_head, head_bytes);
    for (int g = 0; g < group; g++)
        for (int c = 0; c < chunks; c++) acc[g * chunks + c] = a[g][c];
}

/* Replace one head's scores by exp(score - max) and return their sum. */
static inline float softmax_numerators(float *scores, int64_t ctx, float max) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t pos = 0; pos < ctx; pos++) {
        scores[pos] = exp_nonpositive(scores[pos] - max);
        sum += scores[pos];
    }
    return sum;
}

/* softmax_numerators for the `group` heads of a kv head, head g's scores at scores[g * stride]. */
static inline void softmax_group(float *scores, int64_t stride, int64_t ctx, const f32x16 *max_score, float *denom,
                                 const int group) {
    for (int g = 0; g < group; g++) denom[g] = softmax_numerators(scores + g * stride, ctx, largest_lane(max_score[g]));
}

/* ---- Rows of one request together ----
 * A prefill chunk's tokens, or a token and its speculative drafts, are rows of one request: the same
 * keys and values, each row to its own length. Up to GROUP_ROWS such rows go through a tile together:
 * each key (or value) row is widened once for all of them, not once per row. Every row's scores,
 * softmax and sums are the operations of `score_tile` / `value_tile` above in the same order, so each
 * row gets the bits it gets alone. (Not with AVX2: its loops below are shaped for one row's registers;
 * there rows go one by one.) */
#define GROUP_ROWS 4
#define GROUP_KEYS_AHEAD 8 /* tiles: a group requests its keys this far ahead of the tile it scores */

/* score_tile for the `nr` rows of a group: row r's `group` scaled query heads at q[r], n[r] of the
 * tile's keys valid for it (n[r] <= 0: none, its scores are left alone), n_max the most. */
static inline __attribute__((always_inline)) void score_tile_rows(
    const float *const q[GROUP_ROWS], const char *k_head, const int64_t off[LANES], const int n[GROUP_ROWS],
    int n_max, const struct ahead *pf, int64_t pf_head, int dtype, float *const scores[GROUP_ROWS], int64_t stride,
    f32x16 *const max_score[GROUP_ROWS], const int nr, const int group, const int chunks) {
    const int64_t head_bytes = (int64_t)chunks * LANES * (dtype == DTYPE_BF16 ? 2 : 4);
    f32x16 s[GROUP_ROWS][MAX_GROUP][LANES];
    for (int j = 0; j < LANES; j++) {
        if (j < pf->n) prefetch(pf->base + pf->off[j] + pf_head, head_bytes);
        if (j >= n_max) {
            for (int r = 0; r < nr; r++)
                for (int g = 0; g < group; g++) s[r][g][j] = ZERO;
            continue;
        }
        f32x16 k[MAX_CHUNKS];
        for (int c = 0; c < chunks; c++) k[c] = load16(k_head + off[j], c * LANES, dtype);
        for (int r = 0; r < nr; r++) {
            if (j >= n[r]) {
                for (int g = 0; g < group; g++) s[r][g][j] = ZERO;
                continue;
            }
            f32x16 qv[MAX_GROUP][MAX_CHUNKS];
            for (int g = 0; g < group; g++)
                for (int c = 0; c < chunks; c++) memcpy(&qv[g][c], q[r] + (g * chunks + c) * LANES, sizeof(f32x16));
            for (int g = 0; g < group; g++) s[r][g][j] = qv[g][0] * k[0];
            for (int c = 1; c < chunks; c++)
                for (int g = 0; g < group; g++) s[r][g][j] += qv[g][c] * k[c];
        }
    }
    for (int r = 0; r < nr; r++)
        for (int g = 0; g < group && n[r] > 0; g++)
            keep_scores(scores[r] + g * stride, hsum16(s[r][g]), &max_score[r][g], n[r]);
}

/* value_tile for two rows of a group (nr = 1 or 2; 2 * group * chunks accumulators): row r's weights
 * at weights[r], n[r] of the tile's values valid for it, n_max the most. */
static inline __attribute__((always_inline)) void value_tile_pair(
    const float *const weights[2], int64_t stride, const char *v_head, const int64_t off[LANES], const int n[2],
    int n_max, const struct ahead *pf, int64_t pf_head, int dtype, f32x16 *const acc[2], const int nr,
    const int group, const int chunks) {
    const int64_t head_bytes = (int64_t)chunks * LANES * (dtype == DTYPE_BF16 ? 2 : 4);
    f32x16 a[2][MAX_GROUP][MAX_CHUNKS];
    for (int r = 0; r < nr; r++)
        for (int g = 0; g < group; g++)
            for (int c = 0; c < chunks; c++) a[r][g][c] = acc[r][g * chunks + c];
    for (int j = 0; j < n_max; j++) {
        if (j < pf->n) prefetch(pf->base + pf->off[j] + pf_head, head_bytes);
        f32x16 v[MAX_CHUNKS];
        for (int c = 0; c < chunks; c++) v[c] = load16(v_head + off[j], c * LANES, dtype);
        for (int r = 0; r < nr; r++) {
            if (j >= n[r]) continue;
            for (int c = 0; c < chunks; c++)
                for (int g = 0; g < group; g++) a[r][g][c] += weights[r][g * stride + j] * v[c];
        }
    }
    for (int j = n_max; j < pf->n; j++) prefetch(pf->base + pf->off[j] + pf_head, head_bytes);
    for (int r = 0; r < nr; r++)
        for (int g = 0; g < group; g++)
            for (int c = 0; c < chunks; c++) acc[r][g * chunks + c] = a[r][g][c];
}

#else
/* AVX2 (16 registers of 8 lanes): the 16-lane arithmetic above on the two 8-lane halves of each 16-lane
 * vector (lanes 0-7 and 8-15), so with the same results bit for bit, in loops shaped so that their
 * accumulators fit the registers. As pairs of registers, 16-lane vectors made 4x slower code (a tile's
 * scores and the queries did not fit, hsum16 went through the stack), and GCC left the softmax loop scalar. */

typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

DEFINE_ROW_LOAD(load8, f32x8, u16x8) /* elements [i, i + 8) of a row (cpu_vec.h) */

/* The 8-lane sums of q * k over a key's chunks for `group` heads, head g's in w[g]: a chunk's halves
 * accumulated apart (the lanes of hsum16's input), then added (hsum16's first step, lane l + lane l+8).
 * q is read from memory, so the 2 * group sums stay in registers. */
static inline __attribute__((always_inline)) void key_sums(const float *q, const char *key, int dtype, f32x8 *w,
                                                           const int group, const int chunks) {
    f32x8 lo[MAX_GROUP], hi[MAX_GROUP];
    for (int c = 0; c < chunks; c++) {
        const f32x8 k0 = load8(key, c * LANES, dtype), k1 = load8(key, c * LANES + 8, dtype);
        for (int g = 0; g < group; g++) {
            f32x8 q0, q1;
            memcpy(&q0, q + (g * chunks + c) * LANES, sizeof q0);
            memcpy(&q1, q + (g * chunks + c) * LANES + 8, sizeof q1);
            lo[g] = c == 0 ? q0 * k0 : lo[g] + q0 * k0;
            hi[g] = c == 0 ? q1 * k1 : hi[g] + q1 * k1;
        }
    }
    for (int g = 0; g < group; g++) w[g] = lo[g] + hi[g];
}

/* r[j] = the sum of v[j]'s lanes, for 8 vectors at once, by the rest of hsum16's tree: lane l + lane
 * l+4, then +2, +1. */
static inline f32x8 hsum8(const f32x8 v[8]) {
    f32x8 x[4], y[2];
    for (int i = 0; i < 4; i++) /* lanes 0-3: v[i]'s 4 partial sums, 4-7: v[i+4]'s */
        x[i] = _mm256_permute2f128_ps(v[i], v[i + 4], 0x20) + _mm256_permute2f128_ps(v[i], v[i + 4], 0x31);
    for (int i = 0; i < 2; i++) /* pairs: v[2i], v[2i+1], v[2i+4], v[2i+5] */
        y[i] = _mm256_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44) + _mm256_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE);
    return _mm256_shuffle_ps(y[0], y[1], 0x88) + _mm256_shuffle_ps(y[0], y[1], 0xDD);
}

/* Per lane, the larger of the 8 maxima at `max` and the scores s of the positions among them that are
 * keys (the n first). */
static inline void update_max8(float *max, f32x8 s, int n) {
    static const i32x8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
    f32x8 m;
    memcpy(&m, max, sizeof m);
    const i32x8 larger = (s > m) & (lane < (i32x8){0} + n);
    m = (f32x8)(((i32x8)s & larger) | ((i32x8)m & ~larger));
    memcpy(max, &m, sizeof m);
}

/* Pass 1 for one kv head and one tile of n keys (at `k_head` + off[j]): the scores of its `group` heads,
 * head g's stored at scores[g * stride], and their per-lane maxima; 8 keys at a time: key_sums, then
 * hsum8 per head. This kv head's part of the slots in `pf` (`pf_head`: its offset) is requested
 * meanwhile. */
static inline __attribute__((always_inline)) void score_tile(
    const float *q, const char *k_head, const int64_t off[LANES], int n, const struct ahead *pf, int64_t pf_head,
    int dtype, float *scores, int64_t stride, f32x16 *max_score, const int group, const int chunks) {
    const int64_t head_bytes = (int64_t)chunks * LANES * (dtype == DTYPE_BF16 ? 2 : 4);
    for (int half = 0; half < 2; half++) {
        f32x8 w[8][MAX_GROUP];
        for (int i = 0; i < 8; i++) {
            const int j = half * 8 + i;
            if (j < pf->n) prefetch(pf->base + pf->off[j] + pf_head, head_bytes);
            if (j < n)
                key_sums(q, k_head + off[j], dtype, w[i], group, chunks);
            else
                for (int g = 0; g < group; g++) w[i][g] = (f32x8){0};
        }
        for (int g = 0; g < group; g++) {
            const f32x8 v[8] = {w[0][g], w[1][g], w[2][g], w[3][g], w[4][g], w[5][g], w[6][g], w[7][g]};
            const f32x8 sg = hsum8(v);
            memcpy(scores + g * stride + half * 8, &sg, sizeof sg);
            update_max8((float *)&max_score[g] + half * 8, sg, n - half * 8);
        }
    }
}

/* Pass 2 for one kv head and one tile of n value rows (at `v_head` + off[j]): acc[g][c] += w * v for its
 * `group` heads, head g's weights at weights[g * stride]; one 16-lane chunk of every head at a time
 * (2 * group accumulators). Line c of this kv head's part of each slot in `pf` is requested while chunk
 * c is computed (a head has no more lines than chunks). */
static inline __attribute__((always_inline)) void value_tile(
    const float *weights, int64_t stride, const char *v_head, const int64_t off[LANES], int n,
    const struct ahead *pf, int64_t pf_head, int dtype, f32x16 *acc, const int group, const int chunks) {
    const int64_t head_bytes = (int64_t)chunks * LANES * (dtype == DTYPE_BF16 ? 2 : 4);
    for (int c = 0; c < chunks; c++) {
        const int pf_n = c * 64 < head_bytes ? pf->n : 0;
        f32x8 a[MAX_GROUP][2];
#pragma GCC unroll 16 /* copied in a loop, a[] went through the stack */
        for (int g = 0; g < group; g++) {
            memcpy(&a[g][0], (const float *)&acc[g * chunks + c], sizeof a[g][0]);
            memcpy(&a[g][1], (const float *)&acc[g * chunks + c] + 8, sizeof a[g][1]);
        }
        for (int j = 0; j < n; j++) {
            if (j < pf_n) prefetch(pf->base + pf->off[j] + pf_head + c * 64, 64);
            const char *v = v_head + off[j];
            const f32x8 v0 = load8(v, c * LANES, dtype), v1 = load8(v, c * LANES + 8, dtype);
            for (int g = 0; g < group; g++) {
                a[g][0] += weights[g * stride + j] * v0;
                a[g][1] += weights[g * stride + j] * v1;
            }
        }
        for (int j = n; j < pf_n; j++) prefetch(pf->base + pf->off[j] + pf_head + c * 64, 64);
#pragma GCC unroll 16
        for (int g = 0; g < group; g++) {
            memcpy((float *)&acc[g * chunks + c], &a[g][0], sizeof a[g][0]);
            memcpy((float *)&acc[g * chunks + c] + 8, &a[g][1], sizeof a[g][1]);
        }
    }
}

/* exp_nonpositive on 8 lanes: its operations in its order, so the same bits. */
static inline f32x8 exp8(f32x8 x) {
    const f32x8 lowest = _mm256_set1_ps(-87.0f);
    x = _mm256_blendv_ps(x, lowest, _mm256_cmp_ps(x, lowest, _CMP_LT_OQ)); /* a NaN stays */
    const f32x8 n = _mm256_round_ps(x * EXP_LOG2E, _MM_FROUND_CUR_DIRECTION); /* rintf */
    const f32x8 r = EXP_REDUCE(x, n);
    const f32x8 p = EXP_POLY(r);
    const i32x8 bits = (__builtin_convertvector(n, i32x8) + 127) << 23;
    return p * (f32x8)bits;
}

/* Replace the scores of a kv head's `group` heads (head g's at scores[g * stride]) by exp(score - max)
 * and store their sums in denom: 8 positions at a time (the last ctx % 8 one by one), then each sum
 * position after position, as the generic level's scalar loop adds it, the heads' sums interleaved
 * (independent chains of adds). */
static inline __attribute__((always_inline)) void softmax_group(float *scores, int64_t stride, int64_t ctx,
                                                                const f32x16 *max_score, float *denom,
                                                                const int group) {
    float sum[MAX_GROUP];
    for (int g = 0; g < group; g++) {
        float *s = scores + g * stride;
        const float max = largest_lane(max_score[g]);
        int64_t pos = 0;
        for (; pos + 8 <= ctx; pos += 8) {
            f32x8 x;
            memcpy(&x, s + pos, sizeof x);
            x = exp8(x - max);
            memcpy(s + pos, &x, sizeof x);
        }
        for (; pos < ctx; pos++) s[pos] = exp_nonpositive(s[pos] - max);
        sum[g] = 0.0f;
    }
    for (int64_t pos = 0; pos < ctx; pos++)
        for (int g = 0; g < group; g++) sum[g] += scores[g * stride + pos];
    for (int g = 0; g < group; g++) denom[g] = sum[g];
}

#endif

/* The query, accumulators and running maxima of row r, before its first tile. */
static inline __attribute__((always_inline)) void start_row(const struct layer *L, const struct row *r,
                                                            const struct scratch *S, const int group,
                                                            const int chunks) {
    const int64_t head_dim = (int64_t)chunks * LANES, num_heads = L->num_kv_heads * group;
    for (int64_t h = 0; h < num_heads; h++) {
        for (int c = 0; c < chunks; c++) {
            const f32x16 qv = load16(r->q + h * L->head_bytes, c * LANES, L->dtype) * L->scale;
            memcpy(S->q + h * head_dim + c * LANES, &qv, sizeof qv);
            S->acc[h * chunks + c] = ZERO;
        }
        S->max_score[h] = ZERO - FLT_MAX;
    }
}

/* One row, all heads: `group` query heads per kv head, `chunks` * 16 lanes each. `next` is the row this
 * thread computes next (NULL if none): its K slots are requested during pass 2. */
static inline __attribute__((always_inline)) void attend_row(const struct layer *L, const struct row *r,
                                                             const struct row *next, const struct scratch *S,
                                                             const int group, const int chunks) {
    const int64_t ctx = r->ctx, head_dim = (int64_t)chunks * LANES, num_heads = L->num_kv_heads * group;
    const int64_t tiles = (ctx + LANES - 1) / LANES, next_tiles = next ? (next->ctx + LANES - 1) / LANES : 0;
    start_row(L, r, S, group, chunks);
    int64_t off[LANES], next_off[LANES];
    struct ahead pf;
    /* Pass 1: scores; this tile's V slots are requested for pass 2. */
    for (int64_t t = 0; t < tiles; t++) {
        const int n = tile_size(ctx, t);
        tile_offsets(L, r->blocks, t, n, off);
        pf = (struct ahead){L->v_cache, off, n};
        for (int64_t kvh = 0; kvh < L->num_kv_heads; kvh++)
            score_tile(S->q + kvh * group * head_dim, L->k_cache + kvh * L->head_bytes, off, n, &pf,
                       kvh * L->head_bytes, L->dtype, S->scores + kvh * group * S->stride + t * LANES, S->stride,
                       S->max_score + kvh * group, group, chunks);
    }
    for (int64_t kvh = 0; kvh < L->num_kv_heads; kvh++)
        softmax_group(S->scores + kvh * group * S->stride, S->stride, ctx, S->max_score + kvh * group,
                      S->denom + kvh * group, group);
    /* Pass 2: the weighted sum of values; the K slots of the thread's next row are requested. */
    for (int64_t t = 0; t < tiles; t++) {
        const int n = tile_size(ctx, t);
        tile_offsets(L, r->blocks, t, n, off);
        pf = (struct ahead){L->k_cache, next_off, t < next_tiles ? tile_size(next->ctx, t) : 0};
        if (pf.n) tile_offsets(L, next->blocks, t, pf.n, next_off);
        for (int64_t kvh = 0; kvh < L->num_kv_heads; kvh++)
            value_tile(S->scores + kvh * group * S->stride + t * LANES, S->stride, L->v_cache + kvh * L->head_bytes,
                       off, n, &pf, kvh * L->head_bytes, L->dtype, S->acc + kvh * group * chunks, group, chunks);
    }
    if (tiles < next_tiles) prefetch_keys(L, next, tiles, next_tiles);
    for (int64_t h = 0; h < num_heads; h++)
        for (int c = 0; c < chunks; c++)
            store16(r->out + h * L->head_bytes, c * LANES, L->dtype, S->acc[h * chunks + c] * (1.0f / S->denom[h]));
}

#ifndef EIGHT_LANES

/* The tile count of each of the nr rows of a group in tiles[], and their longest context. */
static inline int64_t group_tiles(const struct row *r, int nr, int64_t *tiles) {
    int64_t ctx_max = 0;
    for (int i = 0; i < nr; i++) {
        tiles[i] = (r[i].ctx + LANES - 1) / LANES;
        ctx_max = r[i].ctx > ctx_max ? r[i].ctx : ctx_max;
    }
    return ctx_max;
}

/* Tile t of a group: the offsets of its slots (the longest row's n_max positions, returned) and each row's
 * count of them in n[] (0 past the row's tiles). */
static inline int group_tile(const struct layer *L, const struct row *r, int nr, const int64_t *tiles, int64_t ctx_max,
                             int64_t t, int64_t off[LANES], int *n) {
    const int n_max = tile_size(ctx_max, t);
    tile_offsets(L, r[0].blocks, t, n_max, off);
    for (int i = 0; i < nr; i++) n[i] = t < tiles[i] ? tile_size(r[i].ctx, t) : 0;
    return n_max;
}

/* attend_row for the nr (2..GROUP_ROWS) rows r[] of one request (the same blocks), row i with scratch S[i]. */
static inline __attribute__((always_inline)) void attend_group(const struct layer *L, const struct row *r, int nr,
                                                               const struct row *next, const struct scratch *S,
                                                               const int group, const int chunks) {
    const int64_t head_dim = (int64_t)chunks * LANES, num_heads = L->num_kv_heads * group;
    int64_t tiles[GROUP_ROWS];
    for (int i = 0; i < nr; i++) start_row(L, &r[i], &S[i], group, chunks);
    const int64_t ctx_max = group_tiles(r, nr, tiles);
    const int64_t tiles_max = (ctx_max + LANES - 1) / LANES, next_tiles = next ? (next->ctx + LANES - 1) / LANES : 0;
    int64_t off[LANES], next_off[LANES];
    int n[GROUP_ROWS];
    struct ahead pf;
    /* Pass 1: scores; this tile's V slots are requested for pass 2. */
    for (int64_t t = 0; t < tiles_max; t++) {
        const int n_max = group_tile(L, r, nr, tiles, ctx_max, t, off, n);
        pf = (struct ahead){L->v_cache, off, n_max};
        if (t + GROUP_KEYS_AHEAD < tiles_max) prefetch_keys(L, &r[0], t + GROUP_KEYS_AHEAD, t + GROUP_KEYS_AHEAD + 1);
        for (int64_t kvh = 0; kvh < L->num_kv_heads; kvh++) {
            const float *q[GROUP_ROWS];
            float *scores[GROUP_ROWS];
            f32x16 *max_score[GROUP_ROWS];
            for (int i = 0; i < nr; i++) {
                q[i] = S[i].q + kvh * group * head_dim;
                scores[i] = S[i].scores + kvh * group * S[i].stride + t * LANES;
                max_score[i] = S[i].max_score + kvh * group;
            }
            const char *k_head = L->k_cache + kvh * L->head_bytes;
            const int64_t pf_head = kvh * L->head_bytes;
            /* A constant row count keeps the loops over rows unrolled. */
            if (nr == 2)
                score_tile_rows(q, k_head, off, n, n_max, &pf, pf_head, L->dtype, scores, S[0].stride, max_score, 2,
                                group, chunks);
            else if (nr == 3)
                score_tile_rows(q, k_head, off, n, n_max, &pf, pf_head, L->dtype, scores, S[0].stride, max_score, 3,
                                group, chunks);
            else
                score_tile_rows(q, k_head, off, n, n_max, &pf, pf_head, L->dtype, scores, S[0].stride, max_score, 4,
                                group, chunks);
        }
    }
    for (int i = 0; i < nr; i++)
        for (int64_t kvh = 0; kvh < L->num_kv_heads; kvh++)
            softmax_group(S[i].scores + kvh * group * S[i].stride, S[i].stride, r[i].ctx, S[i].max_score + kvh * group,
                          S[i].denom + kvh * group, group);
    /* Pass 2: the weighted sums of values, two rows at a time; the K slots of the next row are requested. */
    for (int64_t t = 0; t < tiles_max; t++) {
        group_tile(L, r, nr, tiles, ctx_max, t, off, n);
        pf = (struct ahead){L->k_cache, next_off, t < next_tiles ? tile_size(next->ctx, t) : 0};
        if (pf.n) tile_offsets(L, next->blocks, t, pf.n, next_off);
        for (int64_t kvh = 0; kvh < L->num_kv_heads; kvh++)
            for (int i = 0; i < nr; i += 2) {
                const int pair = nr - i < 2 ? nr - i : 2;
                const int pn[2] = {n[i], pair > 1 ? n[i + 1] : 0};
                const int pair_max = pn[0] > pn[1] ? pn[0] : pn[1];
                const float *weights[2] = {S[i].scores + kvh * group * S[i].stride + t * LANES,
                                           pair > 1 ? S[i + 1].scores + kvh * group * S[i + 1].stride + t * LANES : NULL};
                f32x16 *acc[2] = {S[i].acc + kvh * group * chunks, pair > 1 ? S[i + 1].acc + kvh * group * chunks : NULL};
                /* The next row's slots are requested once per tile, with the first pair. */
                const struct ahead none = {L->k_cache, next_off, 0};
                const char *v_head = L->v_cache + kvh * L->head_bytes;
                const struct ahead *ahead = i == 0 ? &pf : &none;
                if (pair == 2) /* constant: the accumulators stay in registers */
                    value_tile_pair(weights, S[i].stride, v_head, off, pn, pair_max, ahead, kvh * L->head_bytes,
                                    L->dtype, acc, 2, group, chunks);
                else
                    value_tile_pair(weights, S[i].stride, v_head, off, pn, pair_max, ahead, kvh * L->head_bytes,
                                    L->dtype, acc, 1, group, chunks);
            }
    }
    if (tiles_max < next_tiles) prefetch_keys(L, next, tiles_max, next_tiles);
    for (int i = 0; i < nr; i++)
        for (int64_t h = 0; h < num_heads; h++)
            for (int c = 0; c < chunks; c++)
                store16(r[i].out + h * L->head_bytes, c * LANES, L->dtype,
                        S[i].acc[h * chunks + c] * (1.0f / S[i].denom[h]));
}
#endif

/* One function per shape (constant shapes let the compiler keep the accumulators in registers; apart,
 * each is compiled on its own, as one body they spilled). */
#define ROW_SHAPE(G, C)                                                                                          \
    static __attribute__((noinline)) void attend_row_##G##_##C(const struct layer *L, const struct row *r,     \
                                                               const struct row *next, const struct scratch *S) { \
        attend_row(L, r, next, S, G, C);                                                                       \
    }
ROW_SHAPE(3, 4)
ROW_SHAPE(4, 4)
ROW_SHAPE(2, 1)

static void attend_row_any(const struct layer *L, const struct row *r, const struct row *next, const struct scratch *S,
                           int group, int chunks) {
    if (group == 3 && chunks == 4)
        attend_row_3_4(L, r, next, S);
    else if (group == 4 && chunks == 4)
        attend_row_4_4(L, r, next, S);
    else if (group == 2 && chunks == 1)
        attend_row_2_1(L, r, next, S);
    else
        attend_row(L, r, next, S, group, chunks);
}

/* For a function FN(L, r, nr, next, S, group, chunks) over rows of one request: FN_3_4 and FN_4_4 (the
 * common shapes, each compiled on its own with constant shapes, as for the rows above) and FN_any, which
 * takes one of them or FN itself. */
#define GROUP_SHAPE(FN, G, C)                                                                                   \
    static __attribute__((noinline)) void FN##_##G##_##C(const struct layer *L, const struct row *r, int nr,     \
                                                          const struct row *next, const struct scratch *S) {      \
        FN(L, r, nr, next, S, G, C);                                                                          \
    }
#define GROUP_SHAPES(FN)                                                                                        \
    GROUP_SHAPE(FN, 3, 4)                                                                                       \
    GROUP_SHAPE(FN, 4, 4)                                                                                       \
    static void FN##_any(const struct layer *L, const struct row *r, int nr, const struct row *next,             \
                         const struct scratch *S, int group, int chunks) {                                      \
        if (group == 3 && chunks == 4)                                                                          \
            FN##_3_4(L, r, nr, next, S);                                                                        \
        else if (group == 4 && chunks == 4)                                                                     \
            FN##_4_4(L, r, nr, next, S);                                                                        \
        else                                                                                                    \
            FN(L, r, nr, next, S, group, chunks);                                                               \
    }

#ifndef EIGHT_LANES
GROUP_SHAPES(attend_group)
#endif

#ifdef __AVX512BF16__
#include "attention_dpbf16.h" /* bfloat16 caches at the avx512_bf16 level: vdpbf16ps (see there) */
#define HAS_DPBF16 1
#else
#define HAS_DPBF16 0
#define DP_ROWS 1
#endif

/* Whether rows i and j read the same blocks (rows of one request): equal block table entries up to the
 * longer one's context. */
static int same_blocks(const struct batch *B, int64_t i, int64_t j, int64_t block_size) {
    const int64_t ctx = B->context_lens[i] > B->context_lens[j] ? B->context_lens[i] : B->context_lens[j];
    const int64_t blocks = (ctx + block_size - 1) / block_size;
    return memcmp(B->block_table + i * B->block_table_stride, B->block_table + j * B->block_table_stride,
                  (size_t)blocks * sizeof(int64_t)) == 0;
}

/* The first of the rows thread t of nt takes: rows are split in contiguous ranges of about equal cost. */
static int64_t first_row(const int64_t *context_lens, int64_t num_reqs, int t, int nt) {
    int64_t total = 0, before = 0;
    for (int64_t i = 0; i < num_reqs; i++) total += context_lens[i] + LANES; /* + LANES: a row's own cost */
    for (int64_t i = 0; i < num_reqs; i++) {
        if (before * nt >= total * t) return i;
        before += context_lens[i] + LANES;
    }
    return num_reqs;
}

/* Per-thread scratch for rows of up to `max_ctx` positions; scores == NULL if it could not be allocated. */
static struct scratch scratch_alloc(int64_t num_heads, int64_t chunks, int64_t max_ctx) {
    struct scratch S = {.stride = (max_ctx + LANES - 1) / LANES * LANES};
    const int64_t vectors = num_heads * (S.stride / LANES + 2 * chunks + 1) + (num_heads + LANES - 1) / LANES;
    float *base = aligned_alloc(sizeof(f32x16), vectors * sizeof(f32x16));
    if (base == NULL) return S;
    S.scores = base;
    S.q = S.scores + num_heads * S.stride;
    S.acc = (f32x16 *)(S.q + num_heads * chunks * LANES);
    S.max_score = S.acc + num_heads * chunks;
    S.denom = (float *)(S.max_score + num_heads);
    return S;
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
    const int64_t elem = dtype == DTYPE_BF16 ? 2 : 4;
    const struct layer L = {k_cache, v_cache, num_kv_heads, head_dim * elem, num_heads / group * head_dim * elem,
                            block_size, dtype, scale};
    const struct batch B = {q, out, q_token_stride, out_token_stride, elem, rows, block_table, context_lens,
                            block_table_stride};
    int status = 0;
    const int dpbf16 = HAS_DPBF16 && dtype == DTYPE_BF16 && chunks % 2 == 0;
#ifdef EIGHT_LANES
    enum { GROUP = 1 }; /* AVX2: rows one by one */
    const int group_rows = 1;
    (void)dpbf16;
#else
    enum { GROUP = DP_ROWS > GROUP_ROWS ? DP_ROWS : GROUP_ROWS };
    const int group_rows = dpbf16 ? DP_ROWS : GROUP_ROWS; /* the most rows of a request taken together */
#endif
#pragma omp parallel num_threads(num_threads)
    {
        struct scratch S[GROUP];
        int allocated = 0; /* S[0 .. allocated): as many as the thread's largest group of rows needs so far */
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t first = first_row(context_lens, num_reqs, t, nt);
        const int64_t end = t + 1 == nt ? num_reqs : first_row(context_lens, num_reqs, t + 1, nt);
        if (first < end) {
            const struct row r = row_at(&B, first);
            prefetch_keys(&L, &r, 0, (r.ctx + LANES - 1) / LANES);
        }
        for (int64_t i = first; i < end;) {
            /* The rows of one request that follow each other in this thread's range, up to group_rows. */
            int nr = 1;
            while (nr < group_rows && i + nr < end && same_blocks(&B, i, i + nr, block_size)) nr++;
            for (; allocated < nr; allocated++) {
                S[allocated] = scratch_alloc(num_heads, chunks, max_context_len > 0 ? max_context_len : 1);
                if (S[allocated].scores == NULL) break;
            }
            if (allocated < nr) {
#pragma omp atomic write
                status = 2;
                break;
            }
            struct row r[GROUP];
            for (int k = 0; k < nr; k++) r[k] = row_at(&B, i + k);
            const struct row next = row_at(&B, i + nr < end ? i + nr : i);
            const struct row *nx = i + nr < end ? &next : NULL;
#if HAS_DPBF16
            if (dpbf16) { /* every row, one or several of a request: the same arithmetic */
                dp_attend_any(&L, r, nr, nx, S, (int)group, (int)chunks);
                i += nr;
                continue;
            }
#endif
#ifndef EIGHT_LANES
            if (nr > 1) {
                attend_group_any(&L, r, nr, nx, S, (int)group, (int)chunks);
                i += nr;
                continue;
            }
#endif
            attend_row_any(&L, &r[0], nx, &S[0], (int)group, (int)chunks);
            i += 1;
        }
        for (int i = 0; i < allocated; i++) free(S[i].scores);
    }
    return status;
}
