/* C kernels for the PS's hot loops: one pass over the arrays instead of numpy's dozen.
 *
 * Plain C called through ctypes (no Python API; loaded by paramserver.server.kernels). The
 * optimizer kernels follow torch.optim's single-tensor formulas operation by operation, in
 * float32, so results match torch's to float32 rounding; the index and initializer kernels
 * do what their numpy counterparts do. Built as an optional extension; every caller falls
 * back to numpy when it is missing.
 */
#include <math.h>
#include <stdint.h>

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

/* Row of each id in an open-addressing index (linear probing; rows[s] < 0 marks an empty
 * slot; capacity a power of two), or -1 where the id is absent. */
void ps_index_find(const int64_t *keys, const int64_t *rows, int64_t capacity, const int64_t *ids, int64_t n,
                   int64_t *out) {
    uint64_t mask = (uint64_t)capacity - 1;
    for (int64_t i = 0; i < n; i++) {
        uint64_t s = mix64((uint64_t)ids[i]) & mask;
        while (rows[s] >= 0 && keys[s] != ids[i]) s = (s + 1) & mask;
        out[i] = rows[s];
    }
}

/* Store absent, distinct ids with the given rows. The caller keeps the index at most half full. */
void ps_index_place(int64_t *keys, int64_t *rows, int64_t capacity, const int64_t *ids, const int64_t *new_rows,
                    int64_t n) {
    uint64_t mask = (uint64_t)capacity - 1;
    for (int64_t i = 0; i < n; i++) {
        uint64_t s = mix64((uint64_t)ids[i]) & mask;
        while (rows[s] >= 0) s = (s + 1) & mask;
        keys[s] = ids[i];
        rows[s] = new_rows[i];
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
        int64_t base = rows[i] * dim;
        for (int64_t j = 0; j < dim; j++) {
            float grad = g[i * dim + j];
            float s = sum[base + j] + grad * grad;
            sum[base + j] = s;
            p[base + j] = p[base + j] + (-clr) * (grad / (sqrtf(s) + eps));
        }
    }
}
