/* A stage's decoder layers in one call: the CPU path of `LlamaModel.forward` over native linears.
 *
 * A decode step of a small batch spends as long in Python between kernels
 * (module calls, tensor allocations, ctypes) as in the kernels themselves:
 * about 100 us per layer. This runs the same kernels in the same order on the
 * same data, called through function pointers the Python side takes from the
 * other kernel libraries (qlinear, fused_ops, decode_attention), so its
 * results are bit-identical to the module-by-module forward:
 *
 *   normed, residual = add_rms_norm(hidden, residual)      (residual absent: hidden)
 *   qkv = qkv_proj(normed); rope(q and k heads of qkv); k, v -> cache slots
 *   attn = attention(q of every token over its own context)
 *   hidden = o_proj(attn)
 *   normed, residual = add_rms_norm(hidden, residual)
 *   hidden = down_proj(silu(gate) * up), [gate, up] = gate_up_proj(normed)
 *
 * Activations are float32 (qlinear, the *_f32 ops) or bfloat16 (linear_bf16_q, the *_bf16
 * ops): `elem_bytes` and `dtype` say which; every pointer below is to that element type.
 * `hidden` and `residual` [num_tokens, hidden] are read and overwritten;
 * `scratch` holds the intermediate rows (stack_scratch_elems elements).
 */

#include <stdint.h>
#include <string.h>
#include <time.h>

/* Where a stage's layer time goes, when asked (layer_stack_set_timing): nanoseconds in the linears,
 * the attention, and everything else (norms, RoPE, cache writes, SiLU * up), summed over calls. */
enum { T_LINEAR, T_ATTENTION, T_OTHER, T_KINDS };
static int timing_on = 0;
static int64_t timing_ns[T_KINDS];

void layer_stack_set_timing(int on) { timing_on = on; }

/* The sums so far into out[T_KINDS], then zeroed. */
void layer_stack_times(int64_t *out) {
    for (int i = 0; i < T_KINDS; i++) out[i] = timing_ns[i], timing_ns[i] = 0;
}

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Charge the time since the last mark to `kind`. */
#define MARK(kind)                              \
    if (timing_on) {                            \
        const int64_t t_ = now_ns();            \
        timing_ns[kind] += t_ - mark, mark = t_; \
    }

typedef int (*linear_fn)(int fmt, const void *x, int64_t ldx, int64_t m, const uint8_t *packed, int64_t n,
                         int64_t k, void *y, int64_t ldy, int num_threads);
typedef void (*norm_fn)(const void *x, const void *residual, const void *weight, void *residual_out, void *out,
                        int64_t rows, int64_t dim, float eps, int num_threads);
typedef void (*silu_fn)(const void *gate_up, void *out, int64_t rows, int64_t dim, int num_threads);
typedef void (*rope_fn)(void *x, int64_t row_stride, const int64_t *positions, const float *cos_table,
                        const float *sin_table, int64_t rows, int64_t num_heads, int64_t head_dim, int num_threads);
typedef int (*attention_fn)(const void *q, int64_t q_token_stride, const void *k_cache, const void *v_cache,
                            const int64_t *block_table, int64_t block_table_stride, const int64_t *rows,
                            const int64_t *context_lens, void *out, int64_t out_token_stride, int64_t num_reqs,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                            int64_t max_context_len, int dtype, int num_threads);

#define MAX_RUNS 4

/* One linear layer: runs of output columns, each packed in one format. Mirrors ctypes in layer_stack.py. */
typedef struct {
    int64_t num_runs, in_features;
    int64_t formats[MAX_RUNS], out_features[MAX_RUNS];
    const uint8_t *packed[MAX_RUNS];
} stack_linear;

typedef struct {
    const void *input_norm, *post_norm;
    stack_linear qkv, o, gate_up, down;
    char *k_cache, *v_cache; /* [num_slots, num_kv_heads, head_dim] */
} stack_layer;

typedef struct {
    linear_fn linear;
    norm_fn norm;
    silu_fn silu;
    rope_fn rope;
    attention_fn attention;
    int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size;
    int64_t elem_bytes, dtype; /* 4 and 0 (float32) or 2 and 1 (bfloat16, the attention kernel's code) */
    float eps, scale;
    const float *cos_table, *sin_table; /* [max_position, head_dim] */
} stack_model;

typedef struct {
    int64_t num_tokens;
    const int64_t *positions, *slot_mapping; /* [num_tokens] */
    const int64_t *block_table;              /* [num_tokens, block_table_stride]: each token's request's table */
    int64_t block_table_stride;
    const int64_t *rows, *context_lens;      /* [num_tokens] */
    int64_t max_context_len;
} stack_step;

int64_t stack_scratch_elems(int64_t num_tokens, int64_t hidden, int64_t q_size, int64_t kv_size, int64_t inter) {
    return num_tokens * (hidden + (q_size + 2 * kv_size) + q_size + 2 * inter + inter);
}

static int linear(const stack_model *m, const stack_linear *l, const char *x, int64_t rows, char *y, int64_t ldy,
                  int num_threads) {
    int64_t col = 0;
    for (int64_t r = 0; r < l->num_runs; r++) {
        const int status = m->linear((int)l->formats[r], x, l->in_features, rows, l->packed[r], l->out_features[r],
                                     l->in_features, y + col * m->elem_bytes, ldy, num_threads);
        if (status != 0) return status;
        col += l->out_features[r];
    }
    return 0;
}

/* Returns 0, or the first failing kernel's status (10 + attention status, 20 + linear status). */
int layer_stack(const stack_model *m, const stack_layer *layers, int64_t num_layers, const stack_step *s,
                char *hidden, char *residual, int has_residual, char *scratch, int num_threads) {
    const int64_t t = s->num_tokens, h = m->hidden, hd = m->head_dim, e = m->elem_bytes;
    const int64_t q_size = m->num_heads * hd, kv_size = m->num_kv_heads * hd, qkv_size = q_size + 2 * kv_size;
    const int64_t inter = m->intermediate;
    char *normed = scratch, *qkv = normed + t * h * e, *attn = qkv + t * qkv_size * e;
    char *gate_up = attn + t * q_size * e, *act = gate_up + t * 2 * inter * e;
    int status;
    int64_t mark = timing_on ? now_ns() : 0;
    for (int64_t li = 0; li < num_layers; li++) {
        const stack_layer *l = layers + li;
        m->norm(hidden, has_residual || li > 0 ? residual : NULL, l->input_norm, residual, normed, t, h, m->eps,
                num_threads);
        MARK(T_OTHER)
        if ((status = linear(m, &l->qkv, normed, t, qkv, qkv_size, num_threads)) != 0) return 20 + status;
        MARK(T_LINEAR)
        m->rope(qkv, qkv_size, s->positions, m->cos_table, m->sin_table, t, m->num_heads + m->num_kv_heads, hd,
                num_threads);
        for (int64_t i = 0; i < t; i++) { /* write first, then read: a token attends to itself */
            const char *row = qkv + i * qkv_size * e;
            memcpy(l->k_cache + s->slot_mapping[i] * kv_size * e, row + q_size * e, (size_t)(kv_size * e));
            memcpy(l->v_cache + s->slot_mapping[i] * kv_size * e, row + (q_size + kv_size) * e, (size_t)(kv_size * e));
        }
        MARK(T_OTHER)
        status = m->attention(qkv, qkv_size, l->k_cache, l->v_cache, s->block_table, s->block_table_stride, s->rows,
                              s->context_lens, attn, q_size, t, m->num_heads, m->num_kv_heads, hd, m->block_size,
                              m->scale, s->max_context_len, (int)m->dtype, num_threads);
        if (status != 0) return 10 + status;
        MARK(T_ATTENTION)
        if ((status = linear(m, &l->o, attn, t, hidden, h, num_threads)) != 0) return 20 + status;
        MARK(T_LINEAR)
        m->norm(hidden, residual, l->post_norm, residual, normed, t, h, m->eps, num_threads);
        MARK(T_OTHER)
        if ((status = linear(m, &l->gate_up, normed, t, gate_up, 2 * inter, num_threads)) != 0) return 20 + status;
        MARK(T_LINEAR)
        m->silu(gate_up, act, t, inter, num_threads);
        MARK(T_OTHER)
        if ((status = linear(m, &l->down, act, t, hidden, h, num_threads)) != 0) return 20 + status;
        MARK(T_LINEAR)
    }
    return 0;
}
