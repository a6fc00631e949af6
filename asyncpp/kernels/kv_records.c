/* Whole KV blocks between a paged cache and store records, checksummed on the way: one call a chunk.
 *
 * A record is `header_nbytes` of header and a payload: one block over the
 * stage's layers, `pieces_per_record` pieces of `piece_nbytes`, piece p of
 * block b at `piece_bases[p] + b * piece_nbytes` in the cache (a base per
 * layer and K/V) and at `p * piece_nbytes` in the payload. A "row" below is
 * a payload (rows[i] at rows + i * row_stride). Bytes are copied as they are.
 *
 *   kv_gather:  row row_ids[i] := block block_ids[i]; optionally noted_crcs[row_ids[i]] :=
 *               that row's CRC32C, each piece checksummed while it is in L1 after its copy;
 *   kv_scatter: block block_ids[i] := row row_ids[i]; with `expected`, each row is checked
 *               whole first (it is then in L2 for the copy) and one that fails is not copied;
 *   kv_begin_write / kv_seal / kv_verify: the shm store's headers (`RecordFormat`): a header
 *               is a template with the block's hash and the payload's CRC32C set in it;
 *               sealing uses a CRC noted by a gather, else reads the payload.
 *
 * Every index is checked against its bound before anything is written: a call
 * with one out of range returns -1 and changes nothing. One call does a whole
 * chunk because from Python each call, and each numpy operation around it,
 * costs 10-40 us when its code is out of the CPU's caches (as it is after a
 * forward streamed the weights): a chunk's copy takes about a millisecond.
 *
 * CRC32C (Castagnoli, reflected 0x82F63B78, inverted in and out) is the value
 * the `crc32c` package computes, so records stay valid across both paths.
 * With SSE4.2 it runs on the CRC32 instruction in six interleaved streams
 * whose registers are combined by table-driven shifts (the interleave of
 * Mark Adler's public crc32c code, with more streams): CRC32 has a latency
 * of 3 cycles and Zen 5 issues two a cycle, so six streams keep it busy
 * (~66 GB/s on one core there, ~11 GB/s with one stream; a CPU that issues
 * one a cycle needs only three and loses nothing with six). Builds without
 * SSE4.2 (the generic level) use a portable slicing-by-8 table: correct but
 * ~10x slower (`kv_hw_crc` says which).
 *
 * A random block's cache piece starts where no hardware prefetcher looks, so
 * a gather prefetches the next piece's lines while it copies one (~1.4x on a
 * random gather). A cold checksum prefetches ahead too (~30 GB/s, not ~15).
 * `streaming` copies write around the caches (non-temporal stores, then a
 * fence): no read of the destination lines first, no eviction of others.
 */

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "kv_records reads the CRC's words little-endian" /* a failed build: the numpy path runs */
#endif

#if defined(__SSE4_2__)
#include <immintrin.h>
#define HW_CRC 1
#else
#define HW_CRC 0
#endif

#define POLY 0x82F63B78u
#define STREAMS 6
#define LONG_STRIDE 1024 /* bytes per stream in a long round: 6 KiB, one piece of the default stage shape */
#define SHORT_STRIDE 128 /* bytes per stream in a short round (768 bytes) */
#define LINE 64
#define CRC_AHEAD 8192   /* a cold checksum prefetches this far ahead: ~25-30 GB/s instead of ~15 */

static uint32_t byte_table[8][256]; /* slicing-by-8: byte_table[k][i] = byte i pushed through k+1 bytes */
static uint32_t long_shift[4][256]; /* the register after LONG_STRIDE zero bytes, one table per register byte */
static uint32_t short_shift[4][256];

static uint32_t zeros_bitwise(uint32_t crc, size_t nbytes) {
    for (size_t i = 0; i < 8 * nbytes; i++) crc = (crc & 1) ? (crc >> 1) ^ POLY : crc >> 1;
    return crc;
}

/* Appending zeros is linear in the register: the images of its 32 bits, xored per byte value. */
static void build_shift(uint32_t table[4][256], size_t nbytes) {
    uint32_t basis[32];
    for (int bit = 0; bit < 32; bit++) basis[bit] = zeros_bitwise(1u << bit, nbytes);
    for (int k = 0; k < 4; k++)
        for (int i = 0; i < 256; i++) {
            uint32_t image = 0;
            for (int bit = 0; bit < 8; bit++)
                if ((i >> bit) & 1) image ^= basis[8 * k + bit];
            table[k][i] = image;
        }
}

/* Runs once, when the library is loaded, before any call can read the tables. */
__attribute__((constructor)) static void build_tables(void) {
    for (uint32_t i = 0; i < 256; i++) byte_table[0][i] = zeros_bitwise(i, 1);
    for (int k = 1; k < 8; k++)
        for (int i = 0; i < 256; i++)
            byte_table[k][i] = byte_table[0][byte_table[k - 1][i] & 0xff] ^ (byte_table[k - 1][i] >> 8);
    build_shift(long_shift, LONG_STRIDE);
    build_shift(short_shift, SHORT_STRIDE);
}

static inline uint64_t load64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8); /* unaligned; little-endian, as CRC32 reads memory */
    return v;
}

/* crc(A || B) = shifted_|B|(crc(A)) ^ crc_from_0(B), for raw registers. */
static inline uint32_t shifted(const uint32_t table[4][256], uint32_t crc) {
    return table[0][crc & 0xff] ^ table[1][(crc >> 8) & 0xff] ^ table[2][(crc >> 16) & 0xff] ^ table[3][crc >> 24];
}

#if HW_CRC
static inline uint32_t combine(const uint32_t table[4][256], uint64_t c0, uint64_t c1, uint64_t c2, uint64_t c3,
                               uint64_t c4, uint64_t c5) {
    uint32_t c = shifted(table, (uint32_t)c0) ^ (uint32_t)c1;
    c = shifted(table, c) ^ (uint32_t)c2;
    c = shifted(table, c) ^ (uint32_t)c3;
    c = shifted(table, c) ^ (uint32_t)c4;
    return shifted(table, c) ^ (uint32_t)c5;
}

/* Eight words of each of the six stripes at offset i. */
#define CRC_LINE(p, stride, i)                                          \
    for (size_t w = 0; w < LINE; w += 8) {                              \
        c0 = _mm_crc32_u64(c0, load64((p) + (i) + w));                  \
        c1 = _mm_crc32_u64(c1, load64((p) + (stride) + (i) + w));       \
        c2 = _mm_crc32_u64(c2, load64((p) + 2 * (stride) + (i) + w));   \
        c3 = _mm_crc32_u64(c3, load64((p) + 3 * (stride) + (i) + w));   \
        c4 = _mm_crc32_u64(c4, load64((p) + 4 * (stride) + (i) + w));   \
        c5 = _mm_crc32_u64(c5, load64((p) + 5 * (stride) + (i) + w));   \
    }

/* One round of six consecutive stripes of `stride` bytes, prefetching up to `end`. */
static inline uint32_t crc_round(uint32_t crc, const uint8_t *p, const uint8_t *end, size_t stride,
                                 const uint32_t table[4][256]) {
    uint64_t c0 = crc, c1 = 0, c2 = 0, c3 = 0, c4 = 0, c5 = 0;
    for (size_t i = 0; i < stride; i += LINE) {
        /* the lines CRC_AHEAD bytes past the round's front, six a step, as fast as it reads them */
        const uint8_t *ahead = p + CRC_AHEAD + STREAMS * i;
        for (int s = 0; s < STREAMS; s++)
            if (ahead + s * LINE < end) __builtin_prefetch(ahead + s * LINE, 0, 3);
        CRC_LINE(p, stride, i)
    }
    return combine(table, c0, c1, c2, c3, c4, c5);
}
#endif

/* The raw register (no inversions) after `nbytes` more bytes. */
static uint32_t crc_update(uint32_t crc, const uint8_t *p, size_t nbytes) {
#if HW_CRC
    const uint8_t *end = p + nbytes;
    for (; nbytes >= STREAMS * LONG_STRIDE; p += STREAMS * LONG_STRIDE, nbytes -= STREAMS * LONG_STRIDE)
        crc = crc_round(crc, p, end, LONG_STRIDE, long_shift);
    for (; nbytes >= STREAMS * SHORT_STRIDE; p += STREAMS * SHORT_STRIDE, nbytes -= STREAMS * SHORT_STRIDE)
        crc = crc_round(crc, p, end, SHORT_STRIDE, short_shift);
    uint64_t c = crc;
    for (; nbytes >= 8; p += 8, nbytes -= 8) c = _mm_crc32_u64(c, load64(p));
    crc = (uint32_t)c;
    for (; nbytes > 0; p++, nbytes--) crc = _mm_crc32_u8(crc, *p);
#else
    for (; nbytes >= 8; p += 8, nbytes -= 8) {
        const uint64_t v = load64(p) ^ crc;
        crc = byte_table[7][v & 0xff] ^ byte_table[6][(v >> 8) & 0xff] ^ byte_table[5][(v >> 16) & 0xff] ^
              byte_table[4][(v >> 24) & 0xff] ^ byte_table[3][(v >> 32) & 0xff] ^ byte_table[2][(v >> 40) & 0xff] ^
              byte_table[1][(v >> 48) & 0xff] ^ byte_table[0][v >> 56];
    }
    for (; nbytes > 0; p++, nbytes--) crc = byte_table[0][(crc ^ *p) & 0xff] ^ (crc >> 8);
#endif
    return crc;
}

/* One 64-byte line; `streaming`: around the caches (dst 64-byte aligned), for bytes nobody reads soon. */
static inline void copy_line(uint8_t *dst, const uint8_t *src, int streaming) {
#if defined(__AVX512F__)
    const __m512i v = _mm512_loadu_si512(src);
    if (streaming) _mm512_stream_si512((void *)dst, v);
    else _mm512_storeu_si512(dst, v);
#elif defined(__AVX2__)
    const __m256i lo = _mm256_loadu_si256((const __m256i *)src), hi = _mm256_loadu_si256((const __m256i *)(src + 32));
    if (streaming) {
        _mm256_stream_si256((__m256i *)dst, lo);
        _mm256_stream_si256((__m256i *)(dst + 32), hi);
    } else {
        _mm256_storeu_si256((__m256i *)dst, lo);
        _mm256_storeu_si256((__m256i *)(dst + 32), hi);
    }
#else
    (void)streaming;
    memcpy(dst, src, LINE);
#endif
}

/* dst := src (`nbytes`), prefetching `next` (the piece read after this one, or NULL) line by line as it
 * goes; with `crc`, *crc goes on over the piece. The checksum reads src's lines just loaded for the copy
 * (in L1, where dst's may not be): they hold what dst now holds, unless src changed meanwhile, and then
 * the record fails its check, as it should. */
static void copy_piece(uint8_t *dst, const uint8_t *src, size_t nbytes, const uint8_t *next, int streaming,
                       uint32_t *crc) {
    if (!streaming && next == NULL && crc == NULL) { /* a plain copy: libc's is at least as fast */
        memcpy(dst, src, nbytes);
        return;
    }
    streaming = streaming && ((uintptr_t)dst % LINE) == 0;
    size_t done = 0, checked = 0;
#if HW_CRC
    for (; done + STREAMS * LONG_STRIDE <= nbytes; done += STREAMS * LONG_STRIDE) {
        const uint8_t *s = src + done;
        uint8_t *d = dst + done;
        uint64_t c0 = crc != NULL ? *crc : 0, c1 = 0, c2 = 0, c3 = 0, c4 = 0, c5 = 0;
        for (size_t i = 0; i < LONG_STRIDE; i += LINE) {
            for (int k = 0; k < STREAMS; k++) {
                if (next != NULL) __builtin_prefetch(next + done + k * LONG_STRIDE + i, 0, 3);
                copy_line(d + k * LONG_STRIDE + i, s + k * LONG_STRIDE + i, streaming);
            }
            if (crc != NULL) CRC_LINE(s, LONG_STRIDE, i)
        }
        if (crc != NULL) *crc = combine(long_shift, c0, c1, c2, c3, c4, c5);
    }
    checked = done;
#endif
    for (; done + LINE <= nbytes; done += LINE) {
        if (next != NULL) __builtin_prefetch(next + done, 0, 3);
        copy_line(dst + done, src + done, streaming);
    }
    memcpy(dst + done, src + done, nbytes - done);
    if (crc != NULL) *crc = crc_update(*crc, src + checked, nbytes - checked);
}

static inline const uint8_t *cache_piece(const int64_t *piece_bases, int64_t piece, int64_t block, int64_t nbytes) {
    return (const uint8_t *)(uintptr_t)piece_bases[piece] + block * nbytes;
}

static int all_below(const int64_t *ids, int64_t num, int64_t bound) {
    for (int64_t i = 0; i < num; i++)
        if (ids[i] < 0 || ids[i] >= bound) return 0;
    return 1;
}

static inline void fence_streamed(int streaming) {
#if defined(__AVX2__)
    if (streaming) _mm_sfence(); /* streamed stores are weakly ordered: visible before any store after the call */
#else
    (void)streaming;
#endif
}

int kv_hw_crc(void) { return HW_CRC; }

/* What crc32c.crc32c(data, value=crc) returns. */
uint32_t kv_crc32c(uint32_t crc, const uint8_t *data, int64_t nbytes) { return ~crc_update(~crc, data, (size_t)nbytes); }

int kv_gather(const int64_t *piece_bases, int64_t pieces_per_record, int64_t piece_nbytes, int64_t num_blocks,
              const int64_t *block_ids, uint8_t *rows, int64_t row_stride, int64_t num_rows, const int64_t *row_ids,
              int64_t num, int64_t *noted_crcs, int streaming) {
    if (!all_below(block_ids, num, num_blocks) || !all_below(row_ids, num, num_rows)) return -1;
    for (int64_t r = 0; r < num; r++) {
        uint8_t *row = rows + row_ids[r] * row_stride;
        uint32_t crc = ~0u;
        for (int64_t p = 0; p < pieces_per_record; p++) {
            const int64_t next_r = p + 1 < pieces_per_record ? r : r + 1, next_p = p + 1 < pieces_per_record ? p + 1 : 0;
            const uint8_t *next = next_r < num ? cache_piece(piece_bases, next_p, block_ids[next_r], piece_nbytes) : NULL;
            copy_piece(row + p * piece_nbytes, cache_piece(piece_bases, p, block_ids[r], piece_nbytes),
                       (size_t)piece_nbytes, next, streaming, noted_crcs != NULL ? &crc : NULL);
        }
        if (noted_crcs != NULL) noted_crcs[row_ids[r]] = ~crc;
    }
    fence_streamed(streaming);
    return 0;
}

int kv_scatter(const int64_t *piece_bases, int64_t pieces_per_record, int64_t piece_nbytes, int64_t num_blocks,
               const int64_t *block_ids, const uint8_t *rows, int64_t row_stride, int64_t num_rows,
               const int64_t *row_ids, int64_t num, const uint32_t *expected, uint8_t *is_intact, int streaming) {
    if (!all_below(block_ids, num, num_blocks) || !all_below(row_ids, num, num_rows)) return -1;
    for (int64_t r = 0; r < num; r++) {
        const uint8_t *row = rows + row_ids[r] * row_stride;
        if (expected != NULL) {
            is_intact[r] = ~crc_update(~0u, row, (size_t)(pieces_per_record * piece_nbytes)) == expected[r];
            if (!is_intact[r]) continue;
        }
        for (int64_t p = 0; p < pieces_per_record; p++) {
            uint8_t *dst = (uint8_t *)cache_piece(piece_bases, p, block_ids[r], piece_nbytes);
            copy_piece(dst, row + p * piece_nbytes, (size_t)piece_nbytes, NULL, streaming, NULL);
        }
    }
    fence_streamed(streaming);
    return 0;
}

/* ---- the shm store's records ------------------------------------------------------------- */

#define MAX_HEADER_NBYTES 256 /* checked by kv_records.py */

/* Mirrors `RecordFormat` in kv_records.py. */
typedef struct {
    uint8_t *records;               /* num_slots records of record_nbytes, each header then payload */
    int64_t num_slots, record_nbytes, header_nbytes;
    const uint8_t *header_template; /* header_nbytes: every header, but for the hash and the CRC */
    int64_t hash_at, crc_at;        /* where a header holds the block's 32-byte hash and the little-endian CRC32C */
    int64_t *noted_crcs;            /* [num_slots]: a payload's CRC32C noted by kv_gather, or -1 */
} RecordFormat;

static inline uint8_t *record_at(const RecordFormat *f, int64_t slot) { return f->records + slot * f->record_nbytes; }

static inline uint32_t payload_crc(const RecordFormat *f, int64_t slot) {
    return ~crc_update(~0u, record_at(f, slot) + f->header_nbytes, (size_t)(f->record_nbytes - f->header_nbytes));
}

/* Zero the headers (the slots read as missing) and forget noted CRCs. */
int kv_begin_write(const RecordFormat *f, const int64_t *slots, int64_t num) {
    if (!all_below(slots, num, f->num_slots)) return -1;
    for (int64_t r = 0; r < num; r++) {
        memset(record_at(f, slots[r]), 0, (size_t)f->header_nbytes);
        f->noted_crcs[slots[r]] = -1;
    }
    return 0;
}

/* Header of slots[r] := the template with hashes[r] (32 bytes each) and its payload's CRC32C: the one noted
 * (then forgotten), else read now. */
int kv_seal(const RecordFormat *f, const int64_t *slots, int64_t num, const uint8_t *hashes) {
    if (!all_below(slots, num, f->num_slots)) return -1;
    for (int64_t r = 0; r < num; r++) {
        const int64_t noted = f->noted_crcs[slots[r]];
        const uint32_t crc = noted >= 0 ? (uint32_t)noted : payload_crc(f, slots[r]);
        f->noted_crcs[slots[r]] = -1;
        uint8_t header[MAX_HEADER_NBYTES]; /* built aside, then written whole */
        memcpy(header, f->header_template, (size_t)f->header_nbytes);
        memcpy(header + f->hash_at, hashes + 32 * r, 32);
        for (int k = 0; k < 4; k++) header[f->crc_at + k] = (uint8_t)(crc >> (8 * k));
        memcpy(record_at(f, slots[r]), header, (size_t)f->header_nbytes);
    }
    return 0;
}

/* status[r]: 0 the header fits (template and hashes[r]) and, with check_payload, the payload's CRC32C is the
 * one it holds; 1 the header does not fit; 2 the payload's CRC32C differs. header_crcs[r] (if not NULL): the
 * CRC32C the header holds. */
int kv_verify(const RecordFormat *f, const int64_t *slots, int64_t num, const uint8_t *hashes, int check_payload,
              uint8_t *status, uint32_t *header_crcs) {
    if (!all_below(slots, num, f->num_slots)) return -1;
    for (int64_t r = 0; r < num; r++) {
        const uint8_t *header = record_at(f, slots[r]);
        uint32_t crc = 0;
        for (int k = 0; k < 4; k++) crc |= (uint32_t)header[f->crc_at + k] << (8 * k);
        if (header_crcs != NULL) header_crcs[r] = crc;
        /* everything before the CRC: the template's bytes but for the hash */
        const int fits = memcmp(header, f->header_template, (size_t)f->hash_at) == 0 &&
                         memcmp(header + f->hash_at, hashes + 32 * r, 32) == 0 &&
                         memcmp(header + f->hash_at + 32, f->header_template + f->hash_at + 32,
                                (size_t)(f->crc_at - f->hash_at - 32)) == 0;
        status[r] = !fits ? 1 : (check_payload && payload_crc(f, slots[r]) != crc) ? 2 : 0;
    }
    return 0;
}
