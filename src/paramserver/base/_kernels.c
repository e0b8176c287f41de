/* C kernels for the PS's hot loops: one pass over the arrays instead of numpy's dozen.
 *
 * Plain C called through ctypes (no Python API; loaded by paramserver.base.kernels). The
 * optimizer kernels follow torch.optim's single-tensor formulas operation by operation, in
 * float32, so results match torch's to float32 rounding; the index and initializer kernels
 * do what their numpy counterparts do. Built as an optional extension; every caller falls
 * back to numpy when it is missing.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Adam / AdamW update of n elements. vmax may be NULL unless amsgrad. */
void ps_adam(float *p, const float *g, float *m, float *v, float *vmax, int64_t n,
             float one_minus_beta1, float beta2, float one_minus_beta2, float step_size,
             float bias_correction2_sqrt, float eps, double weight_decay, float decay_factor,
             int decoupled, int amsgrad, int maximize) {
    for (int64_t i = 0; i < n; i++) {
        float grad = maximize ? -g[i] : g[i];
        float param = p[i];
        if (weight_decay != 0.0) {
            if (decoupled) {
                param = param * decay_factor;
            } else {
                grad = (float)((double)grad + weight_decay * (double)param);
            }
        }
        float mi = m[i] + one_minus_beta1 * (grad - m[i]);
        float vi = v[i] * beta2 + one_minus_beta2 * grad * grad;
        m[i] = mi;
        v[i] = vi;
        if (amsgrad) {
            if (vi < vmax[i]) vi = vmax[i];
            vmax[i] = vi;
        }
        float denom = sqrtf(vi) / bias_correction2_sqrt + eps;
        p[i] = param + (-step_size) * (mi / denom);
    }
}

/* Plain SGD (no momentum, weight decay or maximize) of n elements: p += g * -lr, as numpy's two steps. */
void ps_sgd(float *p, const float *g, int64_t n, float neg_lr) {
    for (int64_t i = 0; i < n; i++) p[i] = p[i] + g[i] * neg_lr;
}

/* Adagrad update of n elements. */
void ps_adagrad(float *p, const float *g, float *sum, int64_t n, float clr, float eps,
                double weight_decay, int maximize) {
    for (int64_t i = 0; i < n; i++) {
        float grad = maximize ? -g[i] : g[i];
        if (weight_decay != 0.0) grad = (float)((double)grad + weight_decay * (double)p[i]);
        float s = sum[i] + grad * grad;
        sum[i] = s;
        p[i] = p[i] + (-clr) * (grad / (sqrtf(s) + eps));
    }
}

/* ---- Embedding tables: the hash index and initial rows. ---- */

static inline uint64_t mix64(uint64_t x) { /* the murmur3 finalizer, as hash_index.mix64 */
    x ^= x >> 33;
    x *= 0xFF51AFD7ED558CCDULL;
    x ^= x >> 33;
    x *= 0xC4CEB9FE1A85EC53ULL;
    return x ^ (x >> 33);
}

/* The index is one array of (key, row + 1) slots, so a probe reads one cache line; 0 marks an
 * empty slot (a zeroed array is an empty index: no fill pass when it grows); capacity is a power
 * of two; linear probing. The loops prefetch the slot (or row) AHEAD ids on: at random positions
 * in tables of hundreds of MB, waiting on memory is most of the work, and issuing the loads early
 * lets them overlap. (ps_unique's scratch slots keep their own convention: row < 0 is empty.)
 * 8, 16 and 32 measured alike at 50M rows with huge pages (docs/benchmarks/scale.md); -DAHEAD=N sets it. */
#ifndef AHEAD
#define AHEAD 8
#endif

static inline uint64_t slot_of(int64_t id, uint64_t mask) { return mix64((uint64_t)id) & mask; }

/* Row of each id, or -1 where the id is absent; returns how many are absent. */
int64_t ps_index_find(const int64_t *slots, int64_t capacity, const int64_t *ids, int64_t n, int64_t *out) {
    uint64_t mask = (uint64_t)capacity - 1;
    int64_t missing = 0;
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n) __builtin_prefetch(&slots[2 * slot_of(ids[i + AHEAD], mask)]);
        uint64_t s = slot_of(ids[i], mask);
        while (slots[2 * s + 1] != 0 && slots[2 * s] != ids[i]) s = (s + 1) & mask;
        out[i] = slots[2 * s + 1] - 1;
        missing += slots[2 * s + 1] == 0;
    }
    return missing;
}

/* changed[rows[i]] = epoch for each row >= 0 (a table's change stamps: rows -1 have none). */
void ps_stamp_rows(uint32_t *changed, const int64_t *rows, int64_t n, uint32_t epoch) {
    for (int64_t i = 0; i < n; i++) {
        if (rows[i] >= 0) changed[rows[i]] = epoch;
    }
}

/* Store absent, distinct ids with the given rows (>= 0). The caller keeps the index at most 11/16 full. */
void ps_index_place(int64_t *slots, int64_t capacity, const int64_t *ids, const int64_t *new_rows, int64_t n) {
    uint64_t mask = (uint64_t)capacity - 1;
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n) __builtin_prefetch(&slots[2 * slot_of(ids[i + AHEAD], mask)], 1);
        uint64_t s = slot_of(ids[i], mask);
        while (slots[2 * s + 1] != 0) s = (s + 1) & mask;
        slots[2 * s] = ids[i];
        slots[2 * s + 1] = new_rows[i] + 1;
    }
}

/* Remove ids (absent ones are skipped) from an index that is not growing; returns how many were
 * there. Backward-shift deletion: the slots after a freed one that probed past it move back into
 * it, so every probe run stays unbroken and no tombstones are left to slow later probes. */
int64_t ps_index_remove(int64_t *slots, int64_t capacity, const int64_t *ids, int64_t n) {
    uint64_t mask = (uint64_t)capacity - 1;
    int64_t removed = 0;
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n) __builtin_prefetch(&slots[2 * slot_of(ids[i + AHEAD], mask)], 1);
        uint64_t s = slot_of(ids[i], mask);
        while (slots[2 * s + 1] != 0 && slots[2 * s] != ids[i]) s = (s + 1) & mask;
        if (slots[2 * s + 1] == 0) continue;
        removed++;
        uint64_t hole = s;
        for (uint64_t j = (s + 1) & mask; slots[2 * j + 1] != 0; j = (j + 1) & mask) {
            uint64_t home = slot_of(slots[2 * j], mask);
            if (((j - home) & mask) >= ((j - hole) & mask)) { /* its probe passes the hole: it may sit there */
                slots[2 * hole] = slots[2 * j];
                slots[2 * hole + 1] = slots[2 * j + 1];
                hole = j;
            }
        }
        slots[2 * hole] = 0;
        slots[2 * hole + 1] = 0;
    }
    return removed;
}

/* ---- A growing index (server/hash_index.py): ids move from `old` to `slots` (twice its size),
 * old slot by old slot from `start` on. An id whose home in `old`, counted from `start`, lies
 * below `moved` lives in `slots`; any other in `old`, unless a probe of `old` for it runs into
 * slot `start` (kept empty while growing: the way from the part not moved yet into the moved
 * part), then in `slots`. So each id is looked for where its slot pages are already faulted in. */

static inline int moved_home(uint64_t home, int64_t start, int64_t moved, uint64_t old_mask) {
    return (int64_t)((home - (uint64_t)start) & old_mask) < moved;
}

void ps_index_find_growing(const int64_t *old, int64_t old_capacity, int64_t start, int64_t moved,
                           const int64_t *slots, int64_t capacity, const int64_t *ids, int64_t n, int64_t *out) {
    uint64_t old_mask = (uint64_t)old_capacity - 1, mask = (uint64_t)capacity - 1;
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n) {
            uint64_t h = mix64((uint64_t)ids[i + AHEAD]);
            if (moved_home(h & old_mask, start, moved, old_mask)) __builtin_prefetch(&slots[2 * (h & mask)]);
            else __builtin_prefetch(&old[2 * (h & old_mask)]);
        }
        uint64_t h = mix64((uint64_t)ids[i]), s = h & old_mask;
        if (!moved_home(s, start, moved, old_mask)) {
            while (old[2 * s + 1] != 0 && old[2 * s] != ids[i]) s = (s + 1) & old_mask;
            if (old[2 * s + 1] != 0 || s != (uint64_t)start) {
                out[i] = old[2 * s + 1] - 1;
                continue;
            }
        }
        s = h & mask;
        while (slots[2 * s + 1] != 0 && slots[2 * s] != ids[i]) s = (s + 1) & mask;
        out[i] = slots[2 * s + 1] - 1;
    }
}

void ps_index_place_growing(int64_t *old, int64_t old_capacity, int64_t start, int64_t moved, int64_t *slots,
                            int64_t capacity, const int64_t *ids, const int64_t *new_rows, int64_t n) {
    uint64_t old_mask = (uint64_t)old_capacity - 1, mask = (uint64_t)capacity - 1;
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n) {
            uint64_t h = mix64((uint64_t)ids[i + AHEAD]);
            if (moved_home(h & old_mask, start, moved, old_mask)) __builtin_prefetch(&slots[2 * (h & mask)], 1);
            else __builtin_prefetch(&old[2 * (h & old_mask)], 1);
        }
        uint64_t h = mix64((uint64_t)ids[i]), s = h & old_mask;
        int64_t *target = old;
        if (!moved_home(s, start, moved, old_mask)) {
            while (old[2 * s + 1] != 0) s = (s + 1) & old_mask;
        }
        if (moved_home(h & old_mask, start, moved, old_mask) || s == (uint64_t)start) {
            target = slots;
            s = h & mask;
            while (slots[2 * s + 1] != 0) s = (s + 1) & mask;
        }
        target[2 * s] = ids[i];
        target[2 * s + 1] = new_rows[i] + 1;
    }
}

/* Move the occupied slots of old[lo, hi) into slots (the new array, kept at most 11/16 full by
 * the caller), zeroing them in old: a growth's share of its rehash. */
void ps_index_move(int64_t *old, int64_t lo, int64_t hi, int64_t *slots, int64_t capacity) {
    uint64_t mask = (uint64_t)capacity - 1;
    for (int64_t i = lo; i < hi; i++) {
        if (i + AHEAD < hi && old[2 * (i + AHEAD) + 1] != 0)
            __builtin_prefetch(&slots[2 * slot_of(old[2 * (i + AHEAD)], mask)], 1);
        if (old[2 * i + 1] == 0) continue;
        uint64_t s = slot_of(old[2 * i], mask);
        while (slots[2 * s + 1] != 0) s = (s + 1) & mask;
        slots[2 * s] = old[2 * i];
        slots[2 * s + 1] = old[2 * i + 1];
        old[2 * i] = 0;
        old[2 * i + 1] = 0;
    }
}

/* out (n x dim) = values[rows] (rows >= 0). */
void ps_gather_rows(const float *values, const int64_t *rows, int64_t n, int64_t dim, float *out) {
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n) __builtin_prefetch(&values[rows[i + AHEAD] * dim]);
        memcpy(&out[i * dim], &values[rows[i] * dim], (size_t)dim * sizeof(float));
    }
}

/* Initial rows (n x dim) from a hash of (id, column), as embedding.initial_rows: kind 1 is
 * normal (Box-Muller, scaled by `scale` = std), kind 2 uniform in [-scale, scale]. */
void ps_random_rows(const int64_t *ids, int64_t n, int64_t dim, int kind, float scale, float *out) {
    const float inv24 = 1.0f / 16777216.0f, two_pi = 6.2831855f;
    for (int64_t i = 0; i < n; i++) {
        uint64_t h = mix64((uint64_t)ids[i]);
        for (int64_t j = 0; j < dim; j++) {
            uint64_t bits = mix64(h ^ ((uint64_t)j * 0x9E3779B97F4A7C15ULL));
            float u1 = ((float)(bits >> 40) + 0.5f) * inv24;
            float u2 = ((float)(bits & 0xFFFFFF) + 0.5f) * inv24;
            float value;
            if (kind == 1) {
                value = sqrtf(-2.0f * logf(u1)) * cosf(u2 * two_pi) * scale;
            } else {
                value = (u1 * 2.0f - 1.0f) * scale;
            }
            out[i * dim + j] = value;
        }
    }
}

/* Row-wise Adam (torch.optim.SparseAdam's formulas) on rows[0..n) of p/m/v (dim columns each),
 * from grads (n x dim). The ids of one update are distinct, so every row is touched once. */
void ps_sparse_adam(float *p, float *m, float *v, const int64_t *rows, const float *g, int64_t n, int64_t dim,
                    float one_minus_beta1, float one_minus_beta2, float step_size, float eps) {
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n) {
            int64_t ahead = rows[i + AHEAD] * dim;
            __builtin_prefetch(&p[ahead], 1);
            __builtin_prefetch(&m[ahead], 1);
            __builtin_prefetch(&v[ahead], 1);
        }
        int64_t base = rows[i] * dim;
        for (int64_t j = 0; j < dim; j++) {
            float grad = g[i * dim + j];
            float mi = (grad - m[base + j]) * one_minus_beta1 + m[base + j];
            float vi = (grad * grad - v[base + j]) * one_minus_beta2 + v[base + j];
            m[base + j] = mi;
            v[base + j] = vi;
            p[base + j] = p[base + j] + (-step_size) * (mi / (sqrtf(vi) + eps));
        }
    }
}

/* Row-wise Adagrad on rows[0..n) of p/sum, from grads (n x dim). */
void ps_sparse_adagrad(float *p, float *sum, const int64_t *rows, const float *g, int64_t n, int64_t dim, float clr,
                       float eps) {
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n) {
            __builtin_prefetch(&p[rows[i + AHEAD] * dim], 1);
            __builtin_prefetch(&sum[rows[i + AHEAD] * dim], 1);
        }
        int64_t base = rows[i] * dim;
        for (int64_t j = 0; j < dim; j++) {
            float grad = g[i * dim + j];
            float s = sum[base + j] + grad * grad;
            sum[base + j] = s;
            p[base + j] = p[base + j] + (-clr) * (grad / (sqrtf(s) + eps));
        }
    }
}

/* ---- The worker's side of a lookup: distinct ids, and the gradient summed per distinct id. ---- */

/* The distinct values of ids[0..n) in order of first appearance -> unique (returns how many),
 * and where each id is among them -> inverse. slots (2 * capacity int64, all -1 on entry, a
 * power-of-two capacity >= 2n) is scratch: (id, position) pairs. */
int64_t ps_unique(const int64_t *ids, int64_t n, int64_t *slots, int64_t capacity, int64_t *unique,
                  int64_t *inverse) {
    uint64_t mask = (uint64_t)capacity - 1;
    int64_t count = 0;
    for (int64_t i = 0; i < n; i++) {
        uint64_t s = slot_of(ids[i], mask);
        while (slots[2 * s + 1] >= 0 && slots[2 * s] != ids[i]) s = (s + 1) & mask;
        if (slots[2 * s + 1] < 0) {
            slots[2 * s] = ids[i];
            slots[2 * s + 1] = count;
            unique[count++] = ids[i];
        }
        inverse[i] = slots[2 * s + 1];
    }
    return count;
}

/* out[inverse[i]] += grads[i] for i in [0, n) (dim columns; out zeroed by the caller). */
void ps_scatter_add_rows(const float *grads, const int64_t *inverse, int64_t n, int64_t dim, float *out) {
    for (int64_t i = 0; i < n; i++) {
        float *target = &out[inverse[i] * dim];
        const float *source = &grads[i * dim];
        for (int64_t j = 0; j < dim; j++) target[j] += source[j];
    }
}

/* ---- float32 <-> bfloat16 / float16, mixed precision's wire (paramserver.base.half). ----
 * Round to nearest even, as torch (c10's BFloat16.h and Half.h, whose float16 formulas these are). */
static inline uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float float_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

void ps_bf16_from_f32(const uint32_t *x, int64_t n, uint16_t *out) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t u = x[i];
        out[i] = (u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0 : (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    }
}

void ps_f32_from_bf16(const uint16_t *x, int64_t n, uint32_t *out) {
    for (int64_t i = 0; i < n; i++) out[i] = (uint32_t)x[i] << 16;
}

void ps_f16_from_f32(const float *x, int64_t n, uint16_t *out) {
    for (int64_t i = 0; i < n; i++) {
        float base = (fabsf(x[i]) * 0x1.0p+112f) * 0x1.0p-110f;  /* overflows to infinity where float16 does */
        uint32_t w = bits_of(x[i]), shl1_w = w + w, sign = w & 0x80000000u;
        uint32_t bias = shl1_w & 0xFF000000u;
        if (bias < 0x71000000u) bias = 0x71000000u;
        base = float_of((bias >> 1) + 0x07800000u) + base;  /* the float addition rounds to nearest even */
        uint32_t bits = bits_of(base), nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
        out[i] = (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
    }
}

void ps_f32_from_f16(const uint16_t *x, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t w = (uint32_t)x[i] << 16, sign = w & 0x80000000u, two_w = w + w;
        float normalized = float_of((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
        float denormalized = float_of((two_w >> 17) | (126u << 23)) - 0.5f;
        out[i] = float_of(sign | (two_w < (1u << 27) ? bits_of(denormalized) : bits_of(normalized)));
    }
}

/* ---- The Criteo TSV parser (paramserver.data.criteo). ---- */

static int parse_long_count(const char *s, int64_t n, int64_t *out);

/* An integer field: -?[0-9]+ whose value fits in int64, any number of digits (leading zeros are
 * fine); never truncated. Only max(x, 0) is used, so a negative one reads as 0. Counts have a few
 * digits: up to 18 cannot overflow, and skip the overflow checks (they cost ~5% of the parse). */
static inline int parse_count(const char *s, int64_t n, int64_t *out) {
    int negative = n > 0 && s[0] == '-';
    int64_t value = 0;
    if (n - negative < 1) return 0;
    if (n - negative > 18) return parse_long_count(s, n, out);
    for (int64_t k = negative; k < n; k++) {
        if (s[k] < '0' || s[k] > '9') return 0;
        value = value * 10 + (s[k] - '0');
    }
    *out = negative ? 0 : value;
    return 1;
}

__attribute__((noinline)) static int parse_long_count(const char *s, int64_t n, int64_t *out) {
    int negative = s[0] == '-';
    uint64_t value = 0, limit = negative ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX;
    for (int64_t k = negative; k < n; k++) {
        unsigned digit = (unsigned)((unsigned char)s[k] - '0');
        if (digit > 9) return 0;
        if (__builtin_mul_overflow(value, 10, &value) || __builtin_add_overflow(value, digit, &value)) return 0;
    }
    if (value > limit) return 0;
    *out = negative ? 0 : (int64_t)value;
    return 1;
}

/* Length of the UTF-8 sequence at s (a byte >= 0x80), or 0 where it is not one that Python's
 * strict decoder takes (overlong forms, surrogates, beyond U+10FFFF, cut short). */
static int utf8_length(const unsigned char *s, const unsigned char *end) {
    unsigned char c = s[0], low = 0x80, high = 0xBF;
    int length = c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
    if (length == 0 || end - s < length) return 0;
    if (c == 0xE0) low = 0xA0;        /* overlong */
    if (c == 0xED) high = 0x9F;       /* surrogates */
    if (c == 0xF0) low = 0x90;        /* overlong */
    if (c == 0xF4) high = 0x8F;       /* beyond U+10FFFF */
    if (s[1] < low || s[1] > high) return 0;
    for (int k = 2; k < length; k++) {
        if (s[k] < 0x80 || s[k] > 0xBF) return 0;
    }
    return length;
}

/* The hash of a categorical value's n bytes (criteo.py's docstring defines it): w0, w1 its first
 * 16 bytes, zero-padded, h = mix64(w0 ^ mix64(w1)) -- the whole hash for 16 bytes or fewer, as
 * before whole values were hashed, so their ids keep their rows; past 16 bytes every further word
 * is folded in, h = mix64(h ^ w), then the length, h = mix64(h ^ n), so values sharing their first
 * 16 bytes differ. */
static inline uint64_t hash_value(const char *s, int64_t n) {
    uint64_t words[2] = {0, 0};
    memcpy(words, s, n < 16 ? n : 16);
    uint64_t h = mix64(words[0] ^ mix64(words[1]));
    if (__builtin_expect(n <= 16, 1)) return h; /* Criteo's values are 8 hex digits */
    for (int64_t k = 16; k < n; k += 8) {
        uint64_t word = 0;
        memcpy(&word, s + k, n - k < 8 ? n - k : 8);
        h = mix64(h ^ word);
    }
    return mix64(h ^ (uint64_t)n);
}

/* `lines` Criteo lines ('\n'-terminated, an optional '\r' before it, 40 tab-separated fields) ->
 * labels (lines), dense (lines x 13: log1p of max(x, 0), missing = 0) and sparse (lines x 26:
 * feature << 56 | the value's 56-bit hash). Takes exactly the lines criteo.py's numpy parser
 * takes and gives exactly what it gives: label "0" or "1", integers as parse_count, text of valid
 * UTF-8 without NUL bytes. Returns `lines`, or -1 at the first bad line (the caller then parses
 * the text with numpy, which names the line and what is wrong with it). */
int64_t ps_parse_criteo(const char *text, int64_t length, int64_t lines, float *labels, float *dense,
                        int64_t *sparse) {
    const char *p = text, *end = text + length;
    if (length < 1 || end[-1] != '\n') return -1; /* then the last '\n' ends every scan: no bound check per byte */
    for (int64_t i = 0; i < lines; i++) {
        if (p == end) return -1; /* fewer lines than `lines` */
        for (int f = 0; f < 40; f++) {
            const char *start = p;
            while (*p != '\t' && *p != '\n') {
                if ((signed char)*p > 0) { /* ASCII, not NUL: one test, as the old ASCII-only check */
                    p++;
                    continue;
                }
                int k = *p == 0 ? 0 : utf8_length((const unsigned char *)p, (const unsigned char *)end);
                if (k == 0) return -1;
                p += k;
            }
            if (*p != (f < 39 ? '\t' : '\n')) return -1; /* not 40 fields */
            int64_t n = p - start, value = 0;
            p++;
            if (f == 39 && n > 0 && start[n - 1] == '\r') n--; /* a Windows line end is a line end */
            if (f == 0) {
                if (n != 1 || (start[0] != '0' && start[0] != '1')) return -1;
                labels[i] = (float)(start[0] - '0');
            } else if (f <= 13) {
                if (n > 0 && !parse_count(start, n, &value)) return -1;
                /* max(value, 0) again: the sign it tells the compiler spares a call to libm's wrapper */
                dense[i * 13 + f - 1] = (float)log1p((double)(value > 0 ? value : 0));
            } else {
                uint64_t h = hash_value(start, n);
                sparse[i * 26 + f - 14] = (int64_t)((h & 0x00FFFFFFFFFFFFFFULL) | ((uint64_t)(f - 14) << 56));
            }
        }
    }
    return p == end ? lines : -1;
}

/* The largest |x[i]| of float32 bits x[0..n), as bits (NaN above infinity above every finite value:
 * for non-negative floats the order of their bits is the order of their values). One number answers
 * every later check of the array: finite when below 0x7f800000, within a bound b when at most b's bits. */
/* Sixteen running maxima, not one: a single one is a chain of dependent steps (a quarter of the speed). */
#define MAX_LANES 16

uint32_t ps_max_abs_bits(const uint32_t *x, int64_t n) {
    uint32_t lanes[MAX_LANES] = {0}, most = 0;
    int64_t i = 0;
    for (; i + MAX_LANES <= n; i += MAX_LANES) {
        for (int k = 0; k < MAX_LANES; k++) {
            uint32_t a = x[i + k] & 0x7fffffffu;
            lanes[k] = a > lanes[k] ? a : lanes[k];
        }
    }
    for (; i < n; i++) {
        uint32_t a = x[i] & 0x7fffffffu;
        most = a > most ? a : most;
    }
    for (int k = 0; k < MAX_LANES; k++) most = lanes[k] > most ? lanes[k] : most;
    return most;
}

/* dst[0..n) = src[0..n), and the largest |src[i]| as ps_max_abs_bits: the check of a gradient done by the
 * copy that takes it out of the wire's memory, so that the check reads nothing again. Each value is read
 * once, so the copy and its figure agree even if a peer writes src meanwhile. */
uint32_t ps_copy_max_abs_bits(const uint32_t *src, uint32_t *dst, int64_t n) {
    uint32_t lanes[MAX_LANES] = {0}, most = 0;
    int64_t i = 0;
    for (; i + MAX_LANES <= n; i += MAX_LANES) {
        for (int k = 0; k < MAX_LANES; k++) {
            uint32_t v = src[i + k];
            dst[i + k] = v;
            uint32_t a = v & 0x7fffffffu;
            lanes[k] = a > lanes[k] ? a : lanes[k];
        }
    }
    for (; i < n; i++) {
        uint32_t v = src[i];
        dst[i] = v;
        uint32_t a = v & 0x7fffffffu;
        most = a > most ? a : most;
    }
    for (int k = 0; k < MAX_LANES; k++) most = lanes[k] > most ? lanes[k] : most;
    return most;
}

/* Whether every |x[i]| is at most the float whose bits are `limit` (NaN and infinities are not):
 * for non-negative floats, the order of their bits is the order of their values. */
int ps_all_within(const float *x, int64_t n, uint32_t limit) {
    const uint32_t *bits = (const uint32_t *)x;
    uint32_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        bad |= (uint32_t)((bits[i] & 0x7fffffffu) > limit);
    }
    return bad == 0;
}

/* 1 when none of x[0..n) is NaN or infinite (an exponent of all ones), else 0. Reads the array once
 * and allocates nothing. */
int ps_all_finite(const float *x, int64_t n) {
    const uint32_t *bits = (const uint32_t *)x;
    uint32_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        bad |= (uint32_t)((bits[i] & 0x7f800000u) == 0x7f800000u);
    }
    return bad == 0;
}

/* ---- The module's one Python function (the kernels above are called through ctypes) ------------ */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* address(array) -> the address of its data, as numpy's `array.ctypes.data` (which costs several
 * times the buffer request here: a kernel call passes a few addresses each time). */
static PyObject *ps_address(PyObject *self, PyObject *array) {
    (void)self;
    Py_buffer view;
    if (PyObject_GetBuffer(array, &view, PyBUF_STRIDED_RO) < 0) return NULL;
    PyObject *address = PyLong_FromVoidPtr(view.buf);
    PyBuffer_Release(&view);
    return address;
}

static PyMethodDef ps_methods[] = {
    {"address", ps_address, METH_O, "The address of an array's data."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef ps_module = {PyModuleDef_HEAD_INIT, "_kernels", NULL, -1, ps_methods};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&ps_module); }
