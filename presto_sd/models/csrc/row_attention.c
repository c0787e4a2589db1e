/* Decode-row attention read in place: each (row, KV head) unit alone, in one fixed order.
 *
 * A unit is one query row's ``G`` query heads over the keys of one KV head: ``seen`` keys at
 * the positions ``pos`` names in a ``[capacity, D]`` run of a KV page (a session's slot and
 * KV head), no copy. Every unit runs the same arithmetic in the same order whatever else the
 * call holds, so a tree node's row is bitwise the AR step that reads the same keys:
 * row-invariant by construction (``invariant.py`` probes it anyway). Scores, softmax and the
 * weighted sum in fp32; the output rounded to the input dtype. Built by ``native_rows.py``
 * with the machine's C compiler (GCC or Clang: vector extensions); without one the verifier
 * keeps torch's SDPA.
 *
 * A score is a 16-lane dot product summed over its lanes by one halving tree
 * (``lanes_sum``). Where D is a multiple of 16, 16 keys' lanes are summed together by
 * shuffles (``sum_16``): the same tree, lane for lane, so a key's score is the same bits
 * whether it falls in a block of 16 or in the tail.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16
#define MAX_G 16
#define MAX_D 256

typedef uint16_t bf16_t;
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (v16i){__VA_ARGS__})
#endif

static inline float bf16_value(bf16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline bf16_t bf16_round(float f) { /* to nearest even, as torch */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}
/* element i of a bf16 (is_bf16) or fp32 array, as fp32 */
static inline float load1(const void *x, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_value(((const bf16_t *)x)[i]) : ((const float *)x)[i];
}
static inline void store1(void *x, int64_t i, float f, int is_bf16) {
    if (is_bf16)
        ((bf16_t *)x)[i] = bf16_round(f);
    else
        ((float *)x)[i] = f;
}
static inline v16f load16(const void *x, int64_t i, int is_bf16) {
    v16f f;
    if (is_bf16) {
        v16h h;
        memcpy(&h, (const bf16_t *)x + i, sizeof h);
        v16u u = __builtin_convertvector(h, v16u) << 16;
        memcpy(&f, &u, sizeof f);
    } else {
        memcpy(&f, (const float *)x + i, sizeof f);
    }
    return f;
}

/* 16 lanes summed in one fixed halving tree */
static inline float lanes_sum(float *a) {
    for (int l = 0; l < 8; l++) a[l] += a[l + 8];
    for (int l = 0; l < 4; l++) a[l] += a[l + 4];
    for (int l = 0; l < 2; l++) a[l] += a[l + 2];
    return a[0] + a[1];
}

/* t[k]'s 16 lanes summed into lane k, for 16 vectors at once: lanes_sum's tree exactly */
static inline v16f sum_16(const v16f *t) {
    v16f u[8], w[4], r[2];
    for (int i = 0; i < 8; i++) /* lane m of a key plus lane m + 8: keys 2i, 2i+1, 8 lanes each */
        u[i] = SHUFFLE(t[2 * i], t[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               SHUFFLE(t[2 * i], t[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++) /* then m + 4: 4 keys, 4 lanes each */
        w[i] = SHUFFLE(u[2 * i], u[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               SHUFFLE(u[2 * i], u[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++) /* then m + 2: 8 keys, 2 lanes each */
        r[i] = SHUFFLE(w[2 * i], w[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               SHUFFLE(w[2 * i], w[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return SHUFFLE(r[0], r[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           SHUFFLE(r[0], r[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* exp(x) for x <= 0: 2^(x log2 e) as 2^e (e the nearest integer) times a degree-6 polynomial
 * on [-0.5, 0.5] (relative error ~2e-7); below -87 it is exp(-87). 16 at once, or one alone
 * by the same operations. */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_ROUND 12582912.0f /* 1.5 * 2^23: adding and subtracting it rounds to an integer */
#define EXP_POLY(y, f)                       \
    y = f * 0.0f + 1.5353362e-4f;            \
    y = y * f + 1.3398874e-3f;               \
    y = y * f + 9.6180325e-3f;               \
    y = y * f + 5.5504112e-2f;               \
    y = y * f + 2.4022652e-1f;               \
    y = y * f + 6.9314718e-1f;               \
    y = y * f + 1.0f;

static inline v16f exp16_nonpositive(v16f x) {
    const v16f floor_at = x - x - 87.0f;
    const v16i below = x < floor_at;
    x = (v16f)(((v16i)x & ~below) | ((v16i)floor_at & below));
    v16f t = x * EXP_LOG2E, e = (t + EXP_ROUND) - EXP_ROUND, f = t - e, y;
    EXP_POLY(y, f)
    return y * (v16f)((__builtin_convertvector(e, v16i) + 127) << 23);
}

static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float t = x * EXP_LOG2E, e = (t + EXP_ROUND) - EXP_ROUND, f = t - e, y, scale;
    EXP_POLY(y, f)
    int32_t bits = ((int32_t)e + 127) << 23;
    memcpy(&scale, &bits, 4);
    return y * scale;
}

/* unit u's scores (query heads x its n keys) into s[g * W + j], scaled */
static inline __attribute__((always_inline)) void unit_scores(const float (*q)[MAX_D], const void *kbase, const int64_t *p, int64_t n, int64_t G,
                        int64_t D, int64_t W, int is_bf16, float *s) {
    int64_t j = 0;
    if (D % LANES == 0) {
        v16f part[MAX_G][LANES];
        for (; j + LANES <= n; j += LANES) {
            for (int k = 0; k < LANES; k++) {
                const int64_t at = p[j + k] * D;
                for (int64_t g = 0; g < G; g++) {
                    v16f acc = {0};
                    for (int64_t d = 0; d < D; d += LANES) {
                        v16f qv;
                        memcpy(&qv, &q[g][d], sizeof qv);
                        acc += qv * load16(kbase, at + d, is_bf16);
                    }
                    part[g][k] = acc;
                }
            }
            for (int64_t g = 0; g < G; g++) {
                v16f sums = sum_16(part[g]);
                memcpy(s + g * W + j, &sums, sizeof sums);
            }
        }
    }
    for (; j < n; j++) { /* the tail (or any D): one key at a time, the same tree */
        float row[MAX_D];
        for (int64_t d = 0; d < D; d++) row[d] = load1(kbase, p[j] * D + d, is_bf16);
        for (int64_t g = 0; g < G; g++) {
            float acc[LANES] = {0};
            int64_t d = 0;
            for (; d + LANES <= D; d += LANES)
                for (int l = 0; l < LANES; l++) acc[l] += q[g][d + l] * row[d + l];
            for (int l = 0; d < D; d++, l++) acc[l] += q[g][d] * row[d];
            s[g * W + j] = lanes_sum(acc);
        }
    }
}

static inline __attribute__((always_inline)) int attend(const void *query, const void *keys, const void *values, void *out, const int64_t *kv_offset,
                  const int64_t *pos, const int64_t *pos_row, const int64_t *seen, int64_t units, int64_t G,
                  int64_t D, int64_t W, float scaling, int is_bf16) {
    if (G > MAX_G || D > MAX_D) return 1;
    float *scores = malloc(sizeof(float) * (size_t)(G * (W > 0 ? W : 1)));
    if (!scores) return 2;
    const size_t item = is_bf16 ? sizeof(bf16_t) : sizeof(float);
    for (int64_t u = 0; u < units; u++) {
        const char *kbase = (const char *)keys + kv_offset[u] * item;
        const char *vbase = (const char *)values + kv_offset[u] * item;
        const int64_t *p = pos + pos_row[u] * W, n = seen[u];
        float q[MAX_G][MAX_D] __attribute__((aligned(64))), o[MAX_G][MAX_D] __attribute__((aligned(64)));
        float inv[MAX_G];
        if (n <= 0) { /* a row that sees no key (none does: it sees itself) attends to nothing */
            for (int64_t i = 0; i < G * D; i++) store1(out, u * G * D + i, 0.0f, is_bf16);
            continue;
        }
        for (int64_t g = 0; g < G; g++)
            for (int64_t d = 0; d < D; d++) q[g][d] = load1(query, (u * G + g) * D + d, is_bf16) * scaling;
        unit_scores((const float (*)[MAX_D])q, kbase, p, n, G, D, W, is_bf16, scores);
        for (int64_t g = 0; g < G; g++) { /* softmax's weights, unnormalised, and their sum */
            float *s = scores + g * W, acc[LANES] = {0}, mx = -INFINITY;
            for (int64_t j = 0; j < n; j++) mx = s[j] > mx ? s[j] : mx;
            int64_t j = 0;
            for (; j + LANES <= n; j += LANES) {
                v16f x;
                memcpy(&x, s + j, sizeof x);
                x = exp16_nonpositive(x - mx);
                memcpy(s + j, &x, sizeof x);
            }
            for (; j < n; j++) s[j] = exp_nonpositive(s[j] - mx);
            j = 0;
            for (; j + LANES <= n; j += LANES)
                for (int l = 0; l < LANES; l++) acc[l] += s[j + l];
            for (int l = 0; j < n; j++, l++) acc[l] += s[j];
            inv[g] = 1.0f / lanes_sum(acc);
            for (int64_t d = 0; d < D; d++) o[g][d] = 0.0f;
        }
        if (D == 64) { /* the weighted values in registers: even keys' and odd keys' sums apart */
            for (int64_t g = 0; g < G; g++) {
                const float *w = scores + g * W;
                v16f even[4] = {0}, odd[4] = {0};
                int64_t j = 0;
                for (; j + 2 <= n; j += 2)
                    for (int b = 0; b < 4; b++) {
                        even[b] += w[j] * load16(vbase, p[j] * 64 + 16 * b, is_bf16);
                        odd[b] += w[j + 1] * load16(vbase, p[j + 1] * 64 + 16 * b, is_bf16);
                    }
                for (int b = 0; b < 4; b++) {
                    if (j < n) even[b] += w[j] * load16(vbase, p[j] * 64 + 16 * b, is_bf16);
                    v16f sum = even[b] + odd[b];
                    memcpy(&o[g][16 * b], &sum, sizeof sum);
                }
            }
        } else {
            for (int64_t j = 0; j < n; j++) { /* the weighted values: each value row once */
                float row[MAX_D];
                for (int64_t d = 0; d < D; d++) row[d] = load1(vbase, p[j] * D + d, is_bf16);
                for (int64_t g = 0; g < G; g++) {
                    const float w = scores[g * W + j];
                    for (int64_t d = 0; d < D; d++) o[g][d] += w * row[d];
                }
            }
        }
        for (int64_t g = 0; g < G; g++)
            for (int64_t d = 0; d < D; d++) store1(out, (u * G + g) * D + d, o[g][d] * inv[g], is_bf16);
    }
    free(scores);
    return 0;
}

/* query, out [units, G, D]; keys, values: unit u's run starts kv_offset[u] elements in, its
 * key j at row pos[pos_row[u] * W + j]; the first seen[u] of a pos row are the unit's keys.
 * Returns 0, or 1 for shapes past MAX_G / MAX_D, 2 out of memory. */
int row_attention_bf16(const bf16_t *query, const bf16_t *keys, const bf16_t *values, bf16_t *out,
                       const int64_t *kv_offset, const int64_t *pos, const int64_t *pos_row, const int64_t *seen,
                       int64_t units, int64_t G, int64_t D, int64_t W, float scaling) {
    return attend(query, keys, values, out, kv_offset, pos, pos_row, seen, units, G, D, W, scaling, 1);
}

int row_attention_f32(const float *query, const float *keys, const float *values, float *out,
                      const int64_t *kv_offset, const int64_t *pos, const int64_t *pos_row, const int64_t *seen,
                      int64_t units, int64_t G, int64_t D, int64_t W, float scaling) {
    return attend(query, keys, values, out, kv_offset, pos, pos_row, seen, units, G, D, W, scaling, 0);
}
