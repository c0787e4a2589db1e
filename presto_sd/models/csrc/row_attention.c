/* Decode-row attention read in place: each (row, KV head) unit alone, in one fixed order.
 *
 * A unit is one query row's ``G`` query heads over the keys of one KV head: ``seen`` keys at
 * the positions ``pos`` names in a ``[capacity, D]`` run of a KV page (a session's slot and
 * KV head), no copy. Every unit runs the same loops in the same order whatever else the call
 * holds, so a tree node's row is bitwise the AR step that reads the same keys: row-invariant
 * by construction (``invariant.py`` probes it anyway). Scores, softmax and the weighted sum
 * in fp32; the output rounded to the input dtype. Built by ``native_rows.py`` with the
 * machine's C compiler; without one the verifier keeps torch's SDPA.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16
#define MAX_G 16
#define MAX_D 256

typedef uint16_t bf16_t;

static inline float load_f32(const float *x, int64_t i) { return x[i]; }
static inline float load_bf16(const bf16_t *x, int64_t i) {
    uint32_t u = (uint32_t)x[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline void store_f32(float *x, int64_t i, float f) { x[i] = f; }
static inline void store_bf16(bf16_t *x, int64_t i, float f) { /* round to nearest even, as torch */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        x[i] = (bf16_t)((u >> 16) | 0x40);
        return;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    x[i] = (bf16_t)(u >> 16);
}

/* 16 lanes summed in one fixed halving order */
static inline float lanes_sum(float *a) {
    for (int l = 0; l < 8; l++) a[l] += a[l + 8];
    for (int l = 0; l < 4; l++) a[l] += a[l + 4];
    for (int l = 0; l < 2; l++) a[l] += a[l + 2];
    return a[0] + a[1];
}

/* exp(x) for x <= 0: exp2 by a degree-6 polynomial on [-0.5, 0.5] (relative error ~2e-7) */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float t = x * 1.44269504088896341f;
    float e = floorf(t + 0.5f);
    float f = t - e;
    float y = 1.5353362e-4f;
    y = y * f + 1.3398874e-3f;
    y = y * f + 9.6180325e-3f;
    y = y * f + 5.5504112e-2f;
    y = y * f + 2.4022652e-1f;
    y = y * f + 6.9314718e-1f;
    y = y * f + 1.0f;
    int32_t bits = ((int32_t)e + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return y * scale;
}

/* query, out [units, G, D]; keys, values: unit u's run starts at kv_offset[u] (elements), key j
 * of it at row pos[pos_row[u] * W + j]; the first seen[u] of a pos row are the unit's keys.
 * Returns 0, or 1 for shapes past MAX_G / MAX_D, 2 out of memory. */
#define ROW_ATTENTION(NAME, T, LOAD, STORE)                                                        \
    int NAME(const T *query, const T *keys, const T *values, T *out, const int64_t *kv_offset,     \
             const int64_t *pos, const int64_t *pos_row, const int64_t *seen, int64_t units,       \
             int64_t G, int64_t D, int64_t W, float scaling) {                                      \
        if (G > MAX_G || D > MAX_D) return 1;                                                      \
        float *scores = malloc(sizeof(float) * (size_t)(G * (W > 0 ? W : 1)));                     \
        if (!scores) return 2;                                                                     \
        for (int64_t u = 0; u < units; u++) {                                                      \
            const T *kbase = keys + kv_offset[u], *vbase = values + kv_offset[u];                  \
            const int64_t *p = pos + pos_row[u] * W, n = seen[u];                                  \
            float q[MAX_G][MAX_D], o[MAX_G][MAX_D], row[MAX_D], mx[MAX_G], inv[MAX_G];              \
            for (int64_t g = 0; g < G; g++) {                                                      \
                for (int64_t d = 0; d < D; d++) q[g][d] = LOAD(query, (u * G + g) * D + d) * scaling; \
                mx[g] = -INFINITY;                                                                 \
            }                                                                                      \
            for (int64_t j = 0; j < n; j++) { /* scores: each key once for the G heads */          \
                for (int64_t d = 0; d < D; d++) row[d] = LOAD(kbase, p[j] * D + d);                \
                for (int64_t g = 0; g < G; g++) {                                                  \
                    float acc[LANES] = {0};                                                        \
                    int64_t d = 0;                                                                 \
                    for (; d + LANES <= D; d += LANES)                                             \
                        for (int l = 0; l < LANES; l++) acc[l] += q[g][d + l] * row[d + l];        \
                    for (int l = 0; d < D; d++, l++) acc[l] += q[g][d] * row[d];                   \
                    float s = lanes_sum(acc);                                                      \
                    scores[g * W + j] = s;                                                         \
                    mx[g] = s > mx[g] ? s : mx[g];                                                 \
                }                                                                                  \
            }                                                                                      \
            for (int64_t g = 0; g < G; g++) { /* softmax's weights, unnormalised, and their sum */ \
                float *s = scores + g * W, acc[LANES] = {0};                                       \
                for (int64_t j = 0; j < n; j++) s[j] = exp_nonpositive(s[j] - mx[g]);              \
                int64_t j = 0;                                                                     \
                for (; j + LANES <= n; j += LANES)                                                 \
                    for (int l = 0; l < LANES; l++) acc[l] += s[j + l];                            \
                for (int l = 0; j < n; j++, l++) acc[l] += s[j];                                   \
                inv[g] = 1.0f / lanes_sum(acc);                                                    \
                for (int64_t d = 0; d < D; d++) o[g][d] = 0.0f;                                    \
            }                                                                                      \
            for (int64_t j = 0; j < n; j++) { /* the weighted values: each value row once */       \
                for (int64_t d = 0; d < D; d++) row[d] = LOAD(vbase, p[j] * D + d);                \
                for (int64_t g = 0; g < G; g++) {                                                  \
                    const float w = scores[g * W + j];                                             \
                    for (int64_t d = 0; d < D; d++) o[g][d] += w * row[d];                         \
                }                                                                                  \
            }                                                                                      \
            for (int64_t g = 0; g < G; g++)                                                        \
                for (int64_t d = 0; d < D; d++) STORE(out, (u * G + g) * D + d, o[g][d] * inv[g]); \
        }                                                                                          \
        free(scores);                                                                              \
        return 0;                                                                                  \
    }

ROW_ATTENTION(row_attention_bf16, bf16_t, load_bf16, store_bf16)
ROW_ATTENTION(row_attention_f32, float, load_f32, store_f32)
