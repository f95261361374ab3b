/* The compressed moment formats' hot loops, compiled on first use (tierstore/native.py).
 *
 * Two jobs:
 *
 * 1. The int8 codec (ts_int8_encode, ts_int8_decode), bit for bit what
 *    tierstore/codecs.py's torch path computes (and its NumPy reference): per
 *    block, the scale is the largest finite magnitude (signed field) or the
 *    largest finite positive value (non-negative fields, else +0); each
 *    element's code is the lookup table's entry for the upper 20 bits of
 *    x / max(scale, smallest subnormal); decoding multiplies the code's map
 *    value by the block's scale.
 *
 * 2. The fused update of a compressed chunk (ts_update): per block, decode the
 *    moments into fp32 on the stack, run AdamW on the parameter pieces in the
 *    block, encode the moments back; the block never leaves L1. Its AdamW is
 *    torch's fused CPU kernel (aten/src/ATen/native/cpu/FusedAdamKernel.cpp,
 *    ADAMW mode, float) written out operation by operation. What that is
 *    depends on the CPU capability torch dispatches to, because each
 *    capability's copy of the kernel is compiled with other flags:
 *    - AVX2 and AVX512: the multiply-adds the compiler contracts into FMAs,
 *      and the different scalar formulas of a tensor's last numel % vec
 *      elements (vec: the width of torch's Vectorized<float>, 8 or 16);
 *    - AVX512 also vectorises that scalar tail 8 wide, where the
 *      contraction of exp_avg_sq's update is the vector body's (tail_vec);
 *    - DEFAULT: no FMA at all (PIECE_UNFUSED) and the generic maximum.
 *    tierstore/fused_update.py passes the recipe of the capability in use with
 *    every piece and checks it against torch._fused_adamw_ at load; a format
 *    whose bits differ anywhere does not use this kernel.
 *
 * 3. Lion's update on fp32 pieces (ts_lion), one pass over each element:
 *    lion-pytorch's update_fn (p *= 1 - lr * wd; u = sign(m * beta1 + g * (1 - beta1));
 *    p += u * -lr; m = m * beta2 + g * (1 - beta2)), seven torch ops and two
 *    temporaries there. Its multiply-adds are torch's add(..., alpha=), which
 *    the AVX2 and AVX512 builds compute as one FMA and DEFAULT as two
 *    roundings (LION_UNFUSED); sign(NaN) and sign(0) are +0, as torch's sgn.
 *    tierstore/_compute/lion_kernel.py checks it against those torch ops once
 *    per process and keeps the torch ops where any bit differs.
 *
 * Only exactly rounded IEEE operations (+ - * / sqrt, fmaf) and integer ones,
 * in a fixed order: any vector width gives the same bits. Build with
 * -ffp-contract=off (no FMA the source does not write) and never with
 * -ffast-math.
 *
 * Why compiled: in torch ops the int8 encode is eight passes over a chunk and
 * the decode three, and the update's decode -> kernel -> encode moves every
 * moment through the cache several times; here each block is touched once.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h> /* SSE: baseline on x86-64, so both variants may use it */
#define TS_STREAM 1
#else
#define TS_STREAM 0
#endif

#define MAX_BLOCK 4096 /* elements per block this file accepts (the caller checks) */
#define ABI_VERSION 5

/* One build runs everywhere: each entry point has an AVX2+FMA variant, picked
 * at run time where the CPU has both, and a baseline variant. */
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && !defined(TS_NO_CLONES)
#define TS_DISPATCH 1
#define TS_FAST __attribute__((target("avx2,fma")))
static int fast_cpu(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    }
    return known;
}
#else
#define TS_DISPATCH 0
#endif
#define INLINE static inline __attribute__((always_inline))

static inline float float_of(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* ---- the int8 codec ------------------------------------------------------------ */

/* The block's scale: its largest finite value by bit pattern. For non-negative
 * floats the integer order is the float order; NaN and inf (>= 0x7F800000)
 * count as 0. Signed fields compare magnitudes (mask clears the sign bit);
 * non-negative fields keep the sign bit, so a negative value is a negative
 * int32 and never the maximum. */
INLINE float block_scale(const float *x, int64_t len, int32_t mask) {
    const int32_t *bits = (const int32_t *)x;
    int32_t m = 0;
    for (int64_t i = 0; i < len; ++i) {
        int32_t key = bits[i] & mask;
        key = key < 0x7F800000 ? key : 0;
        m = m > key ? m : key;
    }
    return float_of((uint32_t)m);
}

/* Codes of x[0..len) / divisor: the table's entry for the upper 20 bits of each quotient. */
INLINE void lookup(const float *x, int64_t len, float divisor, const uint8_t *table, uint8_t *c) {
    uint32_t bucket[MAX_BLOCK];
    for (int64_t i = 0; i < len; ++i) { /* vectorised: divide, keep the upper 20 bits */
        const float y = x[i] / divisor;
        uint32_t yb;
        memcpy(&yb, &y, 4);
        bucket[i] = yb >> 12;
    }
    int64_t i = 0;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    /* Eight codes gathered into one 8-byte store: measured 11% off the whole int8 update on
     * Zen 3 (a byte store per code was its hottest instruction). */
    for (; i + 8 <= len; i += 8) {
        uint64_t w = 0;
        for (int j = 0; j < 8; ++j) w |= (uint64_t)table[bucket[i + j]] << (8 * j);
        memcpy(c + i, &w, 8);
    }
#endif
    for (; i < len; ++i) c[i] = table[bucket[i]];
}

/* Scalar loads: measured faster than AVX2 gathers on Zen 3, for encode and decode alike. */
INLINE void decode_block(const uint8_t *c, float s, int64_t len, const float *values, float *out) {
    for (int64_t i = 0; i < len; ++i) out[i] = values[c[i]] * s;
}

/* Encode len (<= MAX_BLOCK) elements of one block: the codes and the block's scale. */
INLINE void encode_block(const float *x, int64_t len, int32_t mask, const uint8_t *table, uint8_t *c,
                         float *scale_out) {
    const float tiny = float_of(1u);
    const float scale = block_scale(x, len, mask);
    *scale_out = scale;
    lookup(x, len, scale > tiny ? scale : tiny, table, c); /* a zero block keeps 0, inf and NaN */
}

/* Encode n fp32 elements of src: one byte per element into codes, one fp32
 * scale per block of bn elements (the last block may be partial) into scales.
 * table: 2**20 codes indexed by the upper 20 bits of x / scale. */
INLINE void int8_encode_body(const float *src, int64_t n, int64_t bn, int is_signed,
                             const uint8_t *table, uint8_t *codes, float *scales) {
    const int32_t mask = is_signed ? 0x7FFFFFFF : -1;
    for (int64_t b = 0, k = 0; b < n; b += bn, ++k) {
        const int64_t len = (b + bn < n ? b + bn : n) - b;
        encode_block(src + b, len, mask, table, codes + b, scales + k);
    }
}

/* Decode n codes into fp32 out: values[code] (256 entries, NaN for the reserved
 * code) times the block's scale. */
INLINE void int8_decode_body(const uint8_t *codes, const float *scales, int64_t n, int64_t bn,
                             const float *values, float *out) {
    for (int64_t b = 0, k = 0; b < n; b += bn, ++k) {
        const int64_t len = (b + bn < n ? b + bn : n) - b;
        decode_block(codes + b, scales[k], len, values, out + b);
    }
}

/* ---- bfloat16 ------------------------------------------------------------------- */

/* Round half to even, as torch's conversion; NaN becomes nan (the moments' canonical 0x7FC0; a
 * parameter takes what this torch build's Tensor.copy_ gives, PIECE_OUT_NAN_ONES). */
INLINE void bf16_encode(const float *x, int64_t len, uint16_t nan, uint16_t *c) {
    const uint32_t *bits = (const uint32_t *)x;
    for (int64_t i = 0; i < len; ++i) {
        const uint32_t u = bits[i];
        const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
        c[i] = (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded);
    }
}

INLINE void bf16_decode(const uint16_t *c, int64_t len, float *out) {
    uint32_t *bits = (uint32_t *)out;
    for (int64_t i = 0; i < len; ++i) bits[i] = (uint32_t)c[i] << 16;
}

/* ---- the fused update ------------------------------------------------------------ */

/* One parameter piece inside a chunk (80 bytes; fused_update.Piece.pack packs it). */
typedef struct {
    float *target;       /* the fp32 master (or fp32 CPU parameter) of the piece, updated in place */
    const void *grad;    /* its gradient: fp32, or bfloat16 with PIECE_GRAD_BF16 */
    void *param_out;     /* a CPU parameter that takes the new master values (fp32, or bfloat16 with
                            PIECE_OUT_BF16), or NULL */
    int64_t start;       /* first element, relative to the chunk */
    int64_t numel;       /* elements; the last numel % vec take torch's scalar formulas */
    int32_t vec;         /* torch's Vectorized<float>::size() */
    int32_t tail_vec;    /* the tail's leading multiple of tail_vec elements takes the vectorised tail's
                            formulas (the compiler's epilogue loop in torch's AVX512 build); 0: none */
    float wd_factor;     /* float(1 - lr * weight_decay) */
    float lerp_w;        /* float(1 - beta1) */
    float beta2;         /* float(beta2) */
    float c2;            /* float(1 - beta2) */
    float bc2_sqrt;      /* float(sqrt(1 - beta2 ** step)) */
    float eps;           /* float(eps) */
    float step_size;     /* float(lr / (1 - beta1 ** step)) */
    int32_t flags;       /* PIECE_* below */
} ts_piece;

enum {
    PIECE_WD = 1, PIECE_MAXIMIZE = 2, PIECE_AMSGRAD = 4, PIECE_GRAD_BF16 = 8, PIECE_OUT_BF16 = 16, PIECE_OUT_NAN_ONES = 32,
    PIECE_UNFUSED = 64 /* torch's DEFAULT capability: every multiply-add rounded twice, the generic maximum */
};

/* One moment field of the chunk (32 bytes; fused_update.FIELD packs it). */
typedef struct {
    void *codes;            /* uint8 (int8) or uint16 (bfloat16) codes of the chunk's elements */
    float *scales;          /* int8: one scale per block of the chunk; NULL for bfloat16 */
    const uint8_t *nearest; /* int8: the field's 2**20 lookup table */
    const float *values;    /* int8: the field's 256 decode values */
} ts_field;

enum { FORMAT_BF16 = 1, FORMAT_INT8 = 2 };

/* Copy n floats into a parameter the update will not read again: non-temporal stores
 * where the target is 16-byte aligned (the new values go to memory without first
 * reading the old ones into the cache: measured 25% off a DRAM-bound update). The
 * entry point fences before it returns. */
INLINE void stream_out(float *restrict out, const float *restrict p, int64_t n) {
    int64_t i = 0;
#if TS_STREAM
    if (((uintptr_t)out & 15) == 0)
        for (; i + 4 <= n; i += 4) _mm_stream_ps(out + i, _mm_loadu_ps(p + i));
#endif
    for (; i < n; ++i) out[i] = p[i];
}

/* torch's Vectorized<float>::maximum on AVX2/AVX512: max, or the all-ones NaN if either is NaN. */
INLINE float vec_maximum(float a, float b) {
    const float mx = a > b ? a : b;
    return (a != a || b != b) ? float_of(0xFFFFFFFFu) : mx;
}

/* The generic Vectorized<float>::maximum (vec_base.h, the DEFAULT capability): a NaN a wins,
 * else the larger (a NaN b then too, since a > NaN is false). */
INLINE float generic_maximum(float a, float b) { return a != a ? a : (a > b ? a : b); }

/* a * b + c as one FMA where torch's build contracts it (fused), else rounded twice (DEFAULT:
 * compiled without FMA; this file is built with -ffp-contract=off, so the compiler keeps both). */
INLINE float madd(int fused, float a, float b, float c) { return fused ? fmaf(a, b, c) : a * b + c; }

/* The vector body's formulas on elements [0, n) of the arrays (torch's loop over whole vectors). */
INLINE void adamw_body(const ts_piece *q, float *restrict p, const float *restrict g, float *restrict m,
                       float *restrict v, float *restrict x, float *restrict out, int64_t n, int wd, int maximize,
                       int amsgrad, int fused) {
    const float w = q->lerp_w, b2 = q->beta2, c2 = q->c2, bc = q->bc2_sqrt, eps = q->eps;
    const float neg_step = -q->step_size, wdf = q->wd_factor;
    const int small = fabsf(w) < 0.5f;
    const float coeff = small ? w : w - 1.0f;
    for (int64_t i = 0; i < n; ++i) {
        float gi = g[i];
        if (maximize) gi = gi * -1.0f;
        float pi = p[i];
        if (wd) pi = pi * wdf;
        const float mi = m[i];
        /* exp_avg.lerp_(grad, w): fmadd(coeff, grad - exp_avg, base) */
        const float mn = madd(fused, coeff, gi - mi, small ? mi : gi);
        /* exp_avg_sq * beta2 + c2 * grad * grad, contracted as fma(c2 * grad, grad, exp_avg_sq * beta2) */
        const float vn = madd(fused, c2 * gi, gi, v[i] * b2);
        float denom;
        if (amsgrad) {
            const float xn = fused ? vec_maximum(x[i], vn) : generic_maximum(x[i], vn);
            x[i] = xn;
            denom = sqrtf(xn) / bc + eps;
        } else {
            denom = sqrtf(vn) / bc + eps;
        }
        pi = pi + neg_step * mn / denom;
        m[i] = mn;
        v[i] = vn;
        p[i] = pi;
    }
    if (out) stream_out(out, p, n); /* after the loop: a conditional store would keep it scalar */
}

/* The scalar tail's formulas (torch's loop over the last numel % vec elements). With
 * vector_sq, exp_avg_sq's update is contracted as the compiler's vectorised copy of this loop
 * contracts it (torch's AVX512 build runs the tail's first multiple of 8 elements that way). */
INLINE void adamw_tail(const ts_piece *q, float *p, const float *g, float *m, float *v, float *x, float *out,
                       int64_t n, int wd, int maximize, int amsgrad, int fused, int vector_sq) {
    const float w = q->lerp_w, b2 = q->beta2, c2 = q->c2, bc = q->bc2_sqrt, eps = q->eps;
    const float step = q->step_size, wdf = q->wd_factor;
    const int small = fabsf(w) < 0.5f;
    for (int64_t i = 0; i < n; ++i) {
        float gi = g[i];
        if (maximize) gi = -gi;
        float pi = p[i];
        if (wd) pi = pi * wdf;
        float mi = m[i];
        /* exp_avg + w * (grad - exp_avg), or grad - (grad - exp_avg) * (1 - w), both contracted */
        mi = small ? madd(fused, w, gi - mi, mi) : madd(fused, -(gi - mi), 1.0f - w, gi);
        /* exp_avg_sq * beta2, then + c2 * grad * grad: contracted as fma(exp_avg_sq, beta2, c2 * grad * grad)
         * by the scalar loop, as fma(c2 * grad, grad, exp_avg_sq * beta2) by its vectorised copy */
        const float vn = vector_sq ? madd(fused, c2 * gi, gi, v[i] * b2) : madd(fused, v[i], b2, (c2 * gi) * gi);
        float denom;
        if (amsgrad) {
            const float xn = x[i] < vn ? vn : x[i]; /* std::max */
            x[i] = xn;
            denom = sqrtf(xn) / bc + eps;
        } else {
            denom = sqrtf(vn) / bc + eps;
        }
        pi = pi - step * mi / denom;
        m[i] = mi;
        v[i] = vn;
        p[i] = pi;
    }
    if (out) stream_out(out, p, n);
}

/* Elements [lo, hi) of the block starting at chunk element b, all in piece q.
 *
 * bfloat16 gradients and parameters are what the torch path does around its
 * kernel: the gradient widened into fp32 (exact: a shift), the parameter given
 * the new master rounded to nearest even (bf16_encode, as torch's Tensor.copy_),
 * NaN as 0xFFFF with PIECE_OUT_NAN_ONES (torch's AVX2 conversion) else 0x7FC0. */
INLINE void update_range(const ts_piece *q, int64_t b, int64_t lo, int64_t hi, float *m, float *v, float *x) {
    const int wd = (q->flags & PIECE_WD) != 0, mx = (q->flags & PIECE_MAXIMIZE) != 0;
    const int ams = (q->flags & PIECE_AMSGRAD) != 0, fused = (q->flags & PIECE_UNFUSED) == 0;
    const int out_bf16 = (q->flags & PIECE_OUT_BF16) != 0;
    const int64_t tail = q->numel % q->vec;
    const int64_t body_end = q->start + q->numel - tail;
    /* The tail's vectorised part: [body_end, vtail_end) */
    const int64_t vtail_end = body_end + (q->tail_vec > 0 ? tail - tail % q->tail_vec : 0);
    const int64_t split = lo > body_end ? lo : (hi < body_end ? hi : body_end);
    const int64_t vsplit = split > vtail_end ? split : (hi < vtail_end ? hi : vtail_end);
    const int64_t o = lo - q->start; /* offset into the piece */
    float widened[MAX_BLOCK];
    const float *g = (const float *)q->grad + o;
    if (q->flags & PIECE_GRAD_BF16) {
        bf16_decode((const uint16_t *)q->grad + o, hi - lo, widened);
        g = widened;
    }
    float *out = q->param_out && !out_bf16 ? (float *)q->param_out + o : 0;
    float *xs = ams ? x + (lo - b) : 0;
    /* Specialised loops for the flags (the compiler folds the constants). */
#define BODY(W, M, A) adamw_body(q, q->target + o, g, m + (lo - b), v + (lo - b), xs, out, split - lo, W, M, A, 1)
    if (split > lo) {
        if (!fused) {
            adamw_body(q, q->target + o, g, m + (lo - b), v + (lo - b), xs, out, split - lo, wd, mx, ams, 0);
        } else if (ams) {
            if (wd) { if (mx) BODY(1, 1, 1); else BODY(1, 0, 1); }
            else { if (mx) BODY(0, 1, 1); else BODY(0, 0, 1); }
        } else {
            if (wd) { if (mx) BODY(1, 1, 0); else BODY(1, 0, 0); }
            else { if (mx) BODY(0, 1, 0); else BODY(0, 0, 0); }
        }
    }
#undef BODY
    /* The tail: its vectorised part [split, vsplit), then the scalar rest [vsplit, hi). */
    for (int part = 0; part < 2; ++part) {
        const int64_t from = part ? vsplit : split, to = part ? hi : vsplit;
        if (to <= from) continue;
        const int64_t t = from - lo;
        adamw_tail(q, q->target + o + t, g + t, m + (from - b), v + (from - b), ams ? x + (from - b) : 0,
                   out ? out + t : 0, to - from, wd, mx, ams, fused, !part);
    }
    if (q->param_out && out_bf16)
        bf16_encode(q->target + o, hi - lo, (q->flags & PIECE_OUT_NAN_ONES) ? 0xFFFFu : 0x7FC0u,
                    (uint16_t *)q->param_out + o);
}

INLINE void decode_field(int format, const ts_field *f, int64_t b, int64_t k, int64_t len, float *out) {
    if (format == FORMAT_INT8) decode_block((const uint8_t *)f->codes + b, f->scales[k], len, f->values, out);
    else bf16_decode((const uint16_t *)f->codes + b, len, out);
}

INLINE void encode_field(int format, const ts_field *f, int is_signed, int64_t b, int64_t k, int64_t len,
                         const float *x) {
    if (format == FORMAT_INT8)
        encode_block(x, len, is_signed ? 0x7FFFFFFF : -1, f->nearest, (uint8_t *)f->codes + b, f->scales + k);
    else bf16_encode(x, len, 0x7FC0u, (uint16_t *)f->codes + b);
}

/* Update one chunk of n elements (a compressed shard's elements [lo, lo + n),
 * starting on a block boundary): per block of bn, decode every field (exp_avg,
 * exp_avg_sq and, with nfields == 3, max_exp_avg_sq), update the pieces'
 * elements inside the block, encode every field back. Pieces are sorted by
 * start and do not overlap; elements outside them are decoded and encoded
 * unchanged, as the torch path does. */
INLINE void update_body(int format, int64_t n, int64_t bn, const ts_field *fields, int nfields, const ts_piece *pieces,
                        int64_t npieces) {
    float m[MAX_BLOCK], v[MAX_BLOCK], x[MAX_BLOCK];
    float *moment[3] = {m, v, x};
    int64_t first = 0; /* the first piece that may reach into the current block */
    for (int64_t b = 0, k = 0; b < n; b += bn, ++k) {
        const int64_t len = (b + bn < n ? b + bn : n) - b;
        for (int f = 0; f < nfields; ++f) decode_field(format, &fields[f], b, k, len, moment[f]);
        while (first < npieces && pieces[first].start + pieces[first].numel <= b) ++first;
        for (int64_t j = first; j < npieces && pieces[j].start < b + len; ++j) {
            const ts_piece *q = &pieces[j];
            const int64_t lo = q->start > b ? q->start : b;
            const int64_t end = q->start + q->numel, hi = end < b + len ? end : b + len;
            if (hi > lo) update_range(q, b, lo, hi, m, v, nfields == 3 ? x : 0);
        }
        for (int f = 0; f < nfields; ++f) encode_field(format, &fields[f], f == 0, b, k, len, moment[f]);
    }
#if TS_STREAM
    _mm_sfence(); /* the parameters' non-temporal stores are visible before the caller goes on */
#endif
}

/* ---- Lion ------------------------------------------------------------------------- */

/* One fp32 piece of Lion's update (56 bytes; lion_kernel.PIECE packs it): the constants are
 * float(...) of lion-pytorch's Python scalars, as torch converts them. */
typedef struct {
    float *p;        /* the parameter (or its fp32 master), updated in place */
    const float *g;  /* the gradient */
    float *m;        /* exp_avg, updated in place */
    int64_t numel;
    float wd_factor; /* float(1 - lr * weight_decay) */
    float beta1;     /* float(beta1) */
    float c1;        /* float(1 - beta1) */
    float beta2;     /* float(beta2) */
    float c2;        /* float(1 - beta2) */
    float neg_lr;    /* float(-lr) */
} ts_lion_piece;

enum { LION_UNFUSED = 1 /* torch's DEFAULT capability: add(..., alpha=) rounds twice */ };

INLINE void lion_piece(const ts_lion_piece *q, int fused) {
    float *restrict p = q->p, *restrict m = q->m;
    const float *restrict g = q->g;
    const float wdf = q->wd_factor, b1 = q->beta1, c1 = q->c1, b2 = q->beta2, c2 = q->c2, nlr = q->neg_lr;
    /* x * 1.0f is x (NaNs stay quiet NaNs): the multiply is skipped when there is no weight decay */
    const int wd = wdf != 1.0f;
    for (int64_t i = 0; i < q->numel; ++i) {
        const float gi = g[i], mi = m[i];
        const float c = madd(fused, gi, c1, mi * b1); /* exp_avg.clone().mul_(beta1).add(grad, alpha=1 - beta1) */
        const float u = (float)((c > 0.0f) - (c < 0.0f)); /* .sgn_(): NaN and -0 give +0 */
        float pi = wd ? p[i] * wdf : p[i];
        p[i] = madd(fused, u, nlr, pi); /* p.add_(update, alpha=-lr): u * -lr is exact */
        m[i] = madd(fused, gi, c2, mi * b2); /* exp_avg.mul_(beta2).add_(grad, alpha=1 - beta2) */
    }
}

INLINE void lion_body(const ts_lion_piece *pieces, int64_t npieces, int flags) {
    const int fused = (flags & LION_UNFUSED) == 0;
    for (int64_t j = 0; j < npieces; ++j) {
        if (fused) lion_piece(&pieces[j], 1);
        else lion_piece(&pieces[j], 0);
    }
}

/* ---- entry points ------------------------------------------------------------------ */

/* Each entry point: its body compiled twice, called through the variant this CPU runs. */
#if TS_DISPATCH
#define ENTRY(name, params, ...)                                         \
    TS_FAST static void name##_fast params { name##_body(__VA_ARGS__); } \
    static void name##_base params { name##_body(__VA_ARGS__); }         \
    void ts_##name params {                                                 \
        if (fast_cpu()) name##_fast(__VA_ARGS__);                           \
        else name##_base(__VA_ARGS__);                                      \
    }
#else
#define ENTRY(name, params, ...) \
    void ts_##name params { name##_body(__VA_ARGS__); }
#endif

ENTRY(int8_encode,
      (const float *src, int64_t n, int64_t bn, int is_signed, const uint8_t *table, uint8_t *codes, float *scales),
      src, n, bn, is_signed, table, codes, scales)
ENTRY(int8_decode,
      (const uint8_t *codes, const float *scales, int64_t n, int64_t bn, const float *values, float *out),
      codes, scales, n, bn, values, out)
ENTRY(lion, (const ts_lion_piece *pieces, int64_t npieces, int flags), pieces, npieces, flags)
ENTRY(update,
      (int format, int64_t n, int64_t bn, const ts_field *fields, int nfields, const ts_piece *pieces, int64_t npieces),
      format, n, bn, fields, nfields, pieces, npieces)

/* The ABI version the loader checks (bump it with any signature or struct change). */
int ts_codec_kernel_version(void) { return ABI_VERSION; }

/* The hash of the source this library was built from (tierstore/native.py passes it; a library
 * built from another version of this file is not loaded). */
#ifndef TS_SOURCE_HASH
#define TS_SOURCE_HASH "unknown"
#endif
const char *ts_codec_kernel_source(void) { return TS_SOURCE_HASH; }

/* Whether this process runs the AVX2+FMA variants (describe() and benchmarks say so). */
int ts_codec_kernel_fast(void) {
#if TS_DISPATCH
    return fast_cpu();
#else
    return 0;
#endif
}
