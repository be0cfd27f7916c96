// One struct per ggml type: QK elements per block, BB bytes per block, and dq(block, e) that
// decodes element e (< QK) of one block to f32. The formulas and field offsets are those of the
// reference dequantizers in redlite_gguf::quant (which document each layout); the matvec, embedding
// and expert kernels are written once over these structs.
//
// Element-wise decoding re-reads a block's scales for every element: simple and obviously right,
// the form part 1 wants. The fast paths (whole sub-blocks per thread, vector loads) come later.

struct T_F32 {
    enum { QK = 1, BB = 4 };
    static __device__ __forceinline__ float dq(const u8* b, int) { return __uint_as_float(ld_u32(b)); }
};

struct T_F16 {
    enum { QK = 1, BB = 2 };
    static __device__ __forceinline__ float dq(const u8* b, int) { return ld_f16(b); }
};

struct T_BF16 {
    enum { QK = 1, BB = 2 };
    static __device__ __forceinline__ float dq(const u8* b, int) { return bf16_to_f32(ld_u16(b)); }
};

// d: f16 | qs[16]: low nibbles are elements 0..15, high nibbles 16..31; x = d * (q - 8).
struct T_Q4_0 {
    enum { QK = 32, BB = 18 };
    static __device__ __forceinline__ float dq(const u8* b, int e) {
        const u8 q = b[2 + (e & 15)];
        const int v = (e < 16 ? (q & 15) : (q >> 4)) - 8;
        return ld_f16(b) * (float)v;
    }
};

// d: f16 | qs: i8[32]; x = d * q.
struct T_Q8_0 {
    enum { QK = 32, BB = 34 };
    static __device__ __forceinline__ float dq(const u8* b, int e) { return ld_f16(b) * (float)(i8)b[2 + e]; }
};

// Like Q4_0 with the non-linear value table.
struct T_IQ4_NL {
    enum { QK = 32, BB = 18 };
    static __device__ __forceinline__ float dq(const u8* b, int e) {
        const u8 q = b[2 + (e & 15)];
        return ld_f16(b) * (float)g_kvalues_iq4nl[e < 16 ? (q & 15) : (q >> 4)];
    }
};

// scales[16] | qs[64] | d | dmin. e = 128c + 32s + l.
struct T_Q2_K {
    enum { QK = 256, BB = 84 };
    static __device__ __forceinline__ float dq(const u8* b, int e) {
        const int c = e >> 7, s = (e >> 5) & 3, l = e & 31;
        const u8 sc = b[e >> 4];
        const float dl = ld_f16(b + 80) * (float)(sc & 15);
        const float ml = ld_f16(b + 82) * (float)(sc >> 4);
        const int q = (b[16 + 32 * c + l] >> (2 * s)) & 3;
        return dl * (float)q - ml;
    }
};

// hmask[32] | qs[64] | scales[12] | d.
struct T_Q3_K {
    enum { QK = 256, BB = 110 };
    static __device__ __forceinline__ float dq(const u8* b, int e) {
        const u8* sc = b + 96;
        const int i = e >> 4;
        const int low = i < 8 ? (sc[i] & 15) : (sc[i - 8] >> 4);
        const int high = (sc[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
        const float dl = ld_f16(b + 108) * (float)((low | (high << 4)) - 32);
        const int c = e >> 7, s = (e >> 5) & 3, l = e & 31;
        const int lo = (b[32 + 32 * c + l] >> (2 * s)) & 3;
        const int hbit = (b[l] >> (4 * c + s)) & 1;
        return dl * (float)(hbit ? lo : lo - 4);
    }
};

// The 6-bit (scale, min) pair j of the 12 packed scale bytes of Q4_K / Q5_K.
__device__ __forceinline__ void scale_min_k4(const u8* s, int j, int* sc, int* m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// d | dmin | scales[12] | qs[128]; sub-block sub = e / 32 reads nibble (sub & 1) of qs[32 (sub/2) + l].
struct T_Q4_K {
    enum { QK = 256, BB = 144 };
    static __device__ __forceinline__ float dq(const u8* b, int e) {
        const int sub = e >> 5, l = e & 31;
        int sc, m;
        scale_min_k4(b + 4, sub, &sc, &m);
        const int q = (b[16 + 32 * (sub >> 1) + l] >> (4 * (sub & 1))) & 15;
        return (ld_f16(b) * (float)sc) * (float)q - ld_f16(b + 2) * (float)m;
    }
};

// d | dmin | scales[12] | qh[32] | qs[128]; Q4_K plus bit `sub` of qh[l] as the fifth bit.
struct T_Q5_K {
    enum { QK = 256, BB = 176 };
    static __device__ __forceinline__ float dq(const u8* b, int e) {
        const int sub = e >> 5, l = e & 31;
        int sc, m;
        scale_min_k4(b + 4, sub, &sc, &m);
        const int lo = (b[48 + 32 * (sub >> 1) + l] >> (4 * (sub & 1))) & 15;
        const int hi = (b[16 + l] >> sub) & 1;
        return (ld_f16(b) * (float)sc) * (float)(lo | (hi << 4)) - ld_f16(b + 2) * (float)m;
    }
};

// ql[128] | qh[64] | scales: i8[16] | d. Half c = e / 128, quarter k, lane l.
struct T_Q6_K {
    enum { QK = 256, BB = 210 };
    static __device__ __forceinline__ float dq(const u8* b, int e) {
        const int c = e >> 7, k = (e >> 5) & 3, l = e & 31;
        const u8 lo = b[64 * c + l + 32 * (k & 1)];
        const u8 hi = b[128 + 32 * c + l];
        const int q = ((lo >> (4 * (k >> 1))) & 15) | (((hi >> (2 * k)) & 3) << 4);
        return (ld_f16(b + 208) * (float)(i8)b[192 + (e >> 4)]) * (float)(q - 32);
    }
};

// d: f32 | qs: i8[256] | bsums (unused).
struct T_Q8_K {
    enum { QK = 256, BB = 292 };
    static __device__ __forceinline__ float dq(const u8* b, int e) {
        return __uint_as_float(ld_u32(b)) * (float)(i8)b[4 + e];
    }
};

// d | scales_h: u16 | scales_l[4] | qs[128].
struct T_IQ4_XS {
    enum { QK = 256, BB = 136 };
    static __device__ __forceinline__ float dq(const u8* b, int e) {
        const int ib = e >> 5, j = e & 31;
        const int low = (b[4 + (ib >> 1)] >> (4 * (ib & 1))) & 15;
        const int high = (ld_u16(b + 2) >> (2 * ib)) & 3;
        const float dl = ld_f16(b) * (float)((low | (high << 4)) - 32);
        const u8 q = b[8 + 16 * ib + (j & 15)];
        return dl * (float)g_kvalues_iq4nl[j < 16 ? (q & 15) : (q >> 4)];
    }
};

__device__ __forceinline__ float sign_of(u8 mask, int j) { return ((mask >> j) & 1) ? -1.0f : 1.0f; }

// d | qs[64] | aux: u32[8].
struct T_IQ3_XXS {
    enum { QK = 256, BB = 98 };
    static __device__ __forceinline__ float dq(const u8* b, int e) {
        const int ib = e >> 5, l = (e >> 3) & 3, j = e & 7;
        const u32 aux = ld_u32(b + 66 + 4 * ib);
        const float db = ld_f16(b) * (0.5f + (float)(aux >> 28)) * 0.5f;
        const u8 signs = g_ksigns_iq2xs[(aux >> (7 * l)) & 127];
        const u32 row = g_iq3xxs_grid[b[2 + 8 * ib + 2 * l + (j >> 2)]];
        const u32 g = (row >> (8 * (j & 3))) & 255;
        return db * (float)g * sign_of(signs, j);
    }
};

// d | qs[64] | qh[8] | signs[32] | scales[4].
struct T_IQ3_S {
    enum { QK = 256, BB = 110 };
    static __device__ __forceinline__ float dq(const u8* b, int e) {
        const int ib = e >> 5, k = e >> 2, j = e & 3;
        const int s = (b[106 + (ib >> 1)] >> (4 * (ib & 1))) & 15;
        const float db = ld_f16(b) * (float)(1 + 2 * s);
        const int hbit = (b[66 + (k >> 3)] >> (k & 7)) & 1;
        const u32 row = g_iq3s_grid[b[2 + k] | (hbit << 8)];
        const u32 g = (row >> (8 * j)) & 255;
        return db * (float)g * sign_of(b[74 + (e >> 3)], e & 7);
    }
};

// d | 8 x { idx[4], aux: u32 }.
struct T_IQ2_XXS {
    enum { QK = 256, BB = 66 };
    static __device__ __forceinline__ float dq(const u8* b, int e) {
        const int ib = e >> 5, l = (e >> 3) & 3, j = e & 7;
        const u8* at = b + 2 + 8 * ib;
        const u32 aux = ld_u32(at + 4);
        const float db = ld_f16(b) * (0.5f + (float)(aux >> 28)) * 0.25f;
        const u64 row = g_iq2xxs_grid[at[l]];
        const u8 signs = g_ksigns_iq2xs[(aux >> (7 * l)) & 127];
        return db * (float)((row >> (8 * j)) & 255) * sign_of(signs, j);
    }
};

// Nibble k of a packed 4-bit scale array.
__device__ __forceinline__ int scale_nibble(const u8* s, int k) { return (s[k >> 1] >> (4 * (k & 1))) & 15; }

// d | qs: u16[32] | scales[8].
struct T_IQ2_XS {
    enum { QK = 256, BB = 74 };
    static __device__ __forceinline__ float dq(const u8* b, int e) {
        const int g = e >> 3, j = e & 7;
        const u16 v = ld_u16(b + 2 + 2 * g);
        const u64 row = g_iq2xs_grid[v & 511];
        const u8 signs = g_ksigns_iq2xs[v >> 9];
        const float db = ld_f16(b) * (0.5f + (float)scale_nibble(b + 66, g >> 1)) * 0.25f;
        return db * (float)((row >> (8 * j)) & 255) * sign_of(signs, j);
    }
};

// d | qs[32] | signs[32] | qh[8] | scales[8].
struct T_IQ2_S {
    enum { QK = 256, BB = 82 };
    static __device__ __forceinline__ float dq(const u8* b, int e) {
        const int g = e >> 3, j = e & 7;
        const int high = (b[66 + (g >> 2)] >> (2 * (g & 3))) & 3;
        const u64 row = g_iq2s_grid[b[2 + g] | (high << 8)];
        const float db = ld_f16(b) * (0.5f + (float)scale_nibble(b + 74, g >> 1)) * 0.25f;
        return db * (float)((row >> (8 * j)) & 255) * sign_of(b[34 + g], j);
    }
};

// d | qs[32] | qh: u16[8].
struct T_IQ1_S {
    enum { QK = 256, BB = 50 };
    static __device__ __forceinline__ float dq(const u8* b, int e) {
        const int ib = e >> 5, l = (e >> 3) & 3, j = e & 7;
        const u16 qh = ld_u16(b + 34 + 2 * ib);
        const float dl = ld_f16(b) * (float)(2 * ((qh >> 12) & 7) + 1);
        const float delta = (qh & 0x8000) ? -0.125f : 0.125f;
        const u64 row = g_iq1s_grid[b[2 + 4 * ib + l] | (((qh >> (3 * l)) & 7) << 8)];
        const float g = (float)(i8)(u8)((row >> (8 * j)) & 255);
        return dl * (g + delta);
    }
};

// qs[32] | qh[16] | sc: u16[4] (the f16 d is spread over the top nibbles of sc).
struct T_IQ1_M {
    enum { QK = 256, BB = 56 };
    static __device__ __forceinline__ float dq(const u8* b, int e) {
        const int k = e >> 3, j = e & 7, i = k >> 1;
        const u16 s0 = ld_u16(b + 48), s1 = ld_u16(b + 50), s2 = ld_u16(b + 52), s3 = ld_u16(b + 54);
        const u16 dbits = (u16)((s0 >> 12) | ((s1 >> 12) << 4) | ((s2 >> 12) << 8) | ((s3 >> 12) << 12));
        const u16 sc = ld_u16(b + 48 + 2 * (i >> 2));
        const int s = (sc >> (3 * (i & 3))) & 7;
        const float dl = f16_to_f32(dbits) * (float)(2 * s + 1);
        const int nib = (b[32 + (k >> 1)] >> (4 * (k & 1))) & 15;
        const u64 row = g_iq1s_grid[b[k] | ((nib & 7) << 8)];
        const float delta = (nib & 8) ? -0.125f : 0.125f;
        const float g = (float)(i8)(u8)((row >> (8 * j)) & 255);
        return dl * (g + delta);
    }
};

// Instantiate a per-type kernel macro for every type: X(name, struct).
#define FOR_EACH_TYPE(X) \
    X(f32, T_F32) X(f16, T_F16) X(bf16, T_BF16) X(q4_0, T_Q4_0) X(q8_0, T_Q8_0) \
    X(iq4_nl, T_IQ4_NL) X(q2_k, T_Q2_K) X(q3_k, T_Q3_K) X(q4_k, T_Q4_K) X(q5_k, T_Q5_K) \
    X(q6_k, T_Q6_K) X(q8_k, T_Q8_K) X(iq4_xs, T_IQ4_XS) X(iq3_xxs, T_IQ3_XXS) X(iq3_s, T_IQ3_S) \
    X(iq2_xxs, T_IQ2_XXS) X(iq2_xs, T_IQ2_XS) X(iq2_s, T_IQ2_S) X(iq1_s, T_IQ1_S) X(iq1_m, T_IQ1_M)
