/* Fused optimizer kernels for the PS: one pass over the arrays instead of numpy's dozen.
 *
 * Plain C called through ctypes (no Python API). Each kernel follows torch.optim's
 * single-tensor formulas operation by operation, in float32, so results match torch's to
 * float32 rounding. Built as an optional extension; paramserver.server.optimizers falls back
 * to numpy when it is missing.
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
