// Quantized matrix-vector products and the embedding lookup, one kernel per type.
//
// matvec_<type>(w, x, y, rows, cols): y[t][r] = W[r] . x[t] for t < gridDim.y (the batch);
// W is `rows` rows of `cols / QK` blocks in the file's layout, x and y are f32 row-major.
// One warp per output row, f32 accumulation, the warp sums at the end. Q6_K has a warp block
// decoder (WarpBlockDot below: the warp takes one block at a time, lane l 8 of its values, every
// load of the warp contiguous; Q4_K has one too, off by default: slower); Q4_K, Q8_0, IQ2_XXS and
// F32 a group decoder (GroupDot: lane i takes groups i, i + 32, ... of G consecutive values,
// decoding each group's scales once and its quants with 16- or 32-bit loads); every other type takes single values (lane i: values i,
// i + 32, ...) through its dq(). Either way each weight is the value dq() gives, bit for bit.
// Launch: block = 32 * warps threads, grid = (ceil(rows / warps), n).

// Tuning switches (REDLITE_CUDA_DEFINES can set them for an experiment): Q4_K through the warp
// block decoder (1) or the group decoder (0, faster on the H200: 159 against 144 tok/s, see
// docs/perf-ledger.md); blocks per warp iteration unrolled in the warp block loop.
#ifndef Q4K_WARP_BLOCK
#define Q4K_WARP_BLOCK 0
#endif
#ifndef WB_UNROLL
#define WB_UNROLL 4
#endif
// IQ2_XXS group decoder: grid bytes to floats from 32-bit halves (1, default) or from the 64-bit
// row (0, the earlier form; same results bit for bit).
#ifndef IQ2_U32
#define IQ2_U32 1
#endif
// IQ2_XXS group = one grid entry (8 values, default 0) or a whole sub-block (32 values, 1; not
// yet run on a GPU).
#ifndef IQ2_G32
#define IQ2_G32 0
#endif
// Group-decoder iterations of a lane unrolled in row_partial (their loads issued together).
#ifndef MVF_UNROLL
#define MVF_UNROLL 2
#endif

// Byte-to-float: one byte permute (byte j of v, zeros above) and one I2FP. (A magic-number form,
// 0x4B000000 | b as f32 minus 2^23, measured 1.2 % slower on the H200: docs/perf-ledger.md.)
// Byte j of v as an exact f32.
__device__ __forceinline__ float byte_f32(u32 v, int j) {
    return (float)__byte_perm(v, 0u, 0x4440 | j);
}

// Group decoders: dot(block, g, x) = sum over the G values of group g of the block of w * x[j].
// SPLIT = 1: the decoder also has load(block, g) (the group's raw bytes) and dot_loaded(raw, g,
// x), so row_partial can issue two groups' loads before either's arithmetic.
template <typename T>
struct GroupDot {
    enum { G = 0, SPLIT = 0 };  // no group decoder: per-value path
};

// Four activations in one 16-byte load: a group's x starts at a multiple of its G (4, 8 or 16)
// values in a row of whole blocks, so it is 16-byte aligned in an aligned buffer.
__device__ __forceinline__ float4 ld_x4(const float* p) { return *(const float4*)p; }

// Two 16-bit loads (blocks of even size keep quants 2-byte aligned).
__device__ __forceinline__ u32 ld_u32_a2(const u8* p) {
    const u16* h = (const u16*)p;
    return (u32)h[0] | ((u32)h[1] << 16);
}

// Q4_K scale and min of sub-block `sub` (0..7) from the 12 scale bytes held as three u32.
__device__ __forceinline__ void q4k_scale_min(const u32 sw[3], int sub, int& sc, int& m) {
#define Q4K_SB(k) ((int)((((k) < 4 ? sw[0] : (k) < 8 ? sw[1] : sw[2]) >> (8 * ((k) & 3))) & 255))
    if (sub < 4) {
        sc = Q4K_SB(sub) & 63;
        m = Q4K_SB(sub + 4) & 63;
    } else {
        sc = (Q4K_SB(sub + 4) & 15) | ((Q4K_SB(sub - 4) >> 6) << 4);
        m = (Q4K_SB(sub + 4) >> 4) | ((Q4K_SB(sub) >> 6) << 4);
    }
#undef Q4K_SB
}

// Warp block decoders: the 32 lanes of a warp take one block together, lane l its 8 values, laid
// out so that every load instruction of the warp reads contiguous bytes (quants: 128 bytes;
// activations: runs of 128 bytes). dot(block, lane, x) = the lane's share of block . x.
template <typename T>
struct WarpBlockDot {
    enum { ON = 0 };
};

// Q4_K (d, dmin, 12 scale bytes, then 4 chunks of 32 quant bytes; chunk c holds sub-block 2c in
// the low nibbles and 2c + 1 in the high ones). Lane l: chunk c = l / 8, bytes j0 = 4 (l % 8)
// .. j0 + 3: values 64c + j0 + j (low) and 64c + 32 + j0 + j (high). The 144-byte blocks are
// 16-byte aligned in an aligned buffer: the header is one 16-byte load, the quants one u32.
template <>
struct WarpBlockDot<T_Q4_K> {
    enum { ON = Q4K_WARP_BLOCK };
    static __device__ __forceinline__ float dot(const u8* __restrict__ b, int lane, const float* __restrict__ x) {
        const int c = lane >> 3, j0 = 4 * (lane & 7);
        const uint4 hd = *(const uint4*)b;
        const u32 sw[3] = {hd.y, hd.z, hd.w};
        int sc0, m0, sc1, m1;
        q4k_scale_min(sw, 2 * c, sc0, m0);
        q4k_scale_min(sw, 2 * c + 1, sc1, m1);
        const float d = f16_to_f32((u16)(hd.x & 0xffff)), dmin = f16_to_f32((u16)(hd.x >> 16));
        const float ds0 = d * (float)sc0, dm0 = dmin * (float)m0;
        const float ds1 = d * (float)sc1, dm1 = dmin * (float)m1;
        const u32 q = *(const u32*)(b + 16 + 32 * c + j0);
        const float4 xl = ld_x4(x + 64 * c + j0), xh = ld_x4(x + 64 * c + 32 + j0);
        const float xls[4] = {xl.x, xl.y, xl.z, xl.w}, xhs[4] = {xh.x, xh.y, xh.z, xh.w};
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            acc += (ds0 * (float)((q >> (8 * j)) & 15) - dm0) * xls[j];
            acc += (ds1 * (float)((q >> (8 * j + 4)) & 15) - dm1) * xhs[j];
        }
        return acc;
    }
};

// Q6_K (ql 128 bytes, qh 64, 16 i8 scales, d): two halves of 128 values; in half c, ql byte
// 64c + 32h + i holds value 128c + 32h + i (low nibble) and 128c + 64 + 32h + i (high nibble),
// qh byte 128 + 32c + i their top two bits at 2h and 2h + 4. Lane l: c = l / 16, h = (l / 8) % 2,
// i = j0 .. j0 + 3 with j0 = 4 (l % 8). Blocks are 210 bytes, so quants are 2-byte aligned.
template <>
struct WarpBlockDot<T_Q6_K> {
    enum { ON = 1 };
    static __device__ __forceinline__ float dot(const u8* __restrict__ b, int lane, const float* __restrict__ x) {
        const int c = lane >> 4, h = (lane >> 3) & 1, j0 = 4 * (lane & 7);
        const u32 vl = ld_u32_a2(b + 64 * c + 32 * h + j0);
        const u32 vh = ld_u32_a2(b + 128 + 32 * c + j0);
        const float d = ld_f16(b + 208);
        const int s0 = 8 * c + 2 * h + (j0 >> 4);
        const float d0 = d * (float)(i8)b[192 + s0], d1 = d * (float)(i8)b[192 + s0 + 4];
        const int v0 = 128 * c + 32 * h + j0;
        const float4 xl = ld_x4(x + v0), xh = ld_x4(x + v0 + 64);
        const float xls[4] = {xl.x, xl.y, xl.z, xl.w}, xhs[4] = {xh.x, xh.y, xh.z, xh.w};
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int q0 = ((vl >> (8 * j)) & 15) | (((vh >> (8 * j + 2 * h)) & 3) << 4);
            const int q1 = ((vl >> (8 * j + 4)) & 15) | (((vh >> (8 * j + 2 * h + 4)) & 3) << 4);
            const float f0 = (float)(q0 - 32), f1 = (float)(q1 - 32);
            acc += (d0 * f0) * xls[j];
            acc += (d1 * f1) * xhs[j];
        }
        return acc;
    }
};

// The scales and mins of a Q4_K block's sub-blocks 2c and 2c + 1 (c = 0..3), times d and dmin:
// (ds0, dm0, ds1, dm1). hd is the block's first 16 bytes (d, dmin, the 12 scale bytes). The 6-bit
// scales and mins of sub-blocks 0..3 and 4..7 sit four to a word (bytes 0..3 of the scales hold
// sub-blocks 0..3 and the top bits of 4..7, bytes 8..11 their low nibbles) and are decoded
// without branches; unit c takes bytes 2c % 4 and 2c % 4 + 1 of its half.
__device__ __forceinline__ float4 q4k_pair_scales(const uint4 hd, int c) {
    const u32 sc_w = c < 2 ? (hd.y & 0x3F3F3F3Fu) : ((hd.w & 0x0F0F0F0Fu) | ((hd.y >> 2) & 0x30303030u));
    const u32 m_w = c < 2 ? (hd.z & 0x3F3F3F3Fu) : (((hd.w >> 4) & 0x0F0F0F0Fu) | ((hd.z >> 2) & 0x30303030u));
    const int b0 = (2 * c) & 3;
    const float d = f16_to_f32((u16)(hd.x & 0xffff)), dmin = f16_to_f32((u16)(hd.x >> 16));
    return make_float4(d * byte_f32(sc_w, b0), dmin * byte_f32(m_w, b0), d * byte_f32(sc_w, b0 + 1),
                       dmin * byte_f32(m_w, b0 + 1));
}

// Q4_K group decoders. Q4K_PAIR (default) takes units of 32 values: unit u (0..7) of a block is
// quant bytes 16u .. 16u + 15 (chunk c = u / 2, half h = u % 2), whose low nibbles are values
// 64c + 16h + j of sub-block 2c and whose high nibbles are values 64c + 32 + 16h + j of sub-block
// 2c + 1, so every quant byte is loaded once. Q4K_PAIR=0: the earlier decoder, groups of 16
// values of one sub-block (each quant byte loaded by two lanes, one nibble used by each).
#ifndef Q4K_PAIR
#define Q4K_PAIR 1
#endif
#if Q4K_PAIR
// The group pointer x is x[32 g] of the block (its activations start at x - 32 g). Word k of the
// loop is quant word (k + c) % 4 of the unit: the 8 lanes that share a block then read eight
// different 16-byte bank groups of x in shared memory (without the rotation lanes c = 0..3 hit
// the same two: a 4-way conflict on every activation load). The sum order is fixed per unit.
template <>
struct GroupDot<T_Q4_K> {
    enum { G = 32, SPLIT = 1 };
    // A unit's raw bytes: the block header (d, dmin, 12 scale bytes) and its 16 quant bytes.
    struct Raw {
        uint4 hd, q;
    };
    static __device__ __forceinline__ Raw load(const u8* __restrict__ b, int g) {
        return Raw{*(const uint4*)b, *(const uint4*)(b + 16 + 16 * g)};
    }
    // A unit's scales and mins (q4k_pair_scales) and its four quant words in the rotated order
    // (v[k] = word (k + c) % 4).
    struct Unit {
        float4 sc;  // ds0, dm0, ds1, dm1
        u32 v[4];
    };
    static __device__ __forceinline__ Unit unit(const Raw& r, int g) {
        const int c = g >> 1;
        const float4 sc = q4k_pair_scales(r.hd, c);
        u32 v0 = r.q.x, v1 = r.q.y, v2 = r.q.z, v3 = r.q.w;
        if (c & 1) {
            const u32 t = v0;
            v0 = v1, v1 = v2, v2 = v3, v3 = t;
        }
        if (c & 2) {
            u32 t = v0;
            v0 = v2, v2 = t;
            t = v1, v1 = v3, v3 = t;
        }
        return Unit{sc, {v0, v1, v2, v3}};
    }
    static __device__ __forceinline__ float dot_loaded(const Raw& r, int g, const float* __restrict__ x) {
        const int c = g >> 1, h = g & 1;
        const float* xl = x - 32 * g + 64 * c + 16 * h;  // values of sub-block 2c; +32: 2c + 1
        const Unit un = unit(r, g);
        const float ds0 = un.sc.x, dm0 = un.sc.y, ds1 = un.sc.z, dm1 = un.sc.w;
        const u32 v[4] = {un.v[0], un.v[1], un.v[2], un.v[3]};
        float acc = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int kk = (k + c) & 3;
            const float4 a = ld_x4(xl + 4 * kk), e = ld_x4(xl + 32 + 4 * kk);
            const float as[4] = {a.x, a.y, a.z, a.w}, es[4] = {e.x, e.y, e.z, e.w};
            const u32 lo = v[k] & 0x0F0F0F0Fu, hi = (v[k] >> 4) & 0x0F0F0F0Fu;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                acc += (ds0 * byte_f32(lo, j) - dm0) * as[j];
                acc += (ds1 * byte_f32(hi, j) - dm1) * es[j];
            }
        }
        return acc;
    }
    static __device__ __forceinline__ float dot(const u8* __restrict__ b, int g, const float* __restrict__ x) {
        return dot_loaded(load(b, g), g, x);
    }
    // The unit's dot with the activations of nt (<= NT) tokens (token t's at x + t * stride),
    // added to acc[t]: each weight decoded once, then per token the multiply-adds of dot_loaded
    // in its order (a fresh sum per unit, then added), so acc[t] gets dot_loaded's value bit for bit.
    template <int NT>
    static __device__ __forceinline__ void dot_loaded_tok(const Raw& r, int g, const float* __restrict__ x,
                                                          int stride, int nt, float (&acc)[NT]) {
        const int c = g >> 1, h = g & 1;
        const float* xl = x - 32 * g + 64 * c + 16 * h;
        const Unit un = unit(r, g);
        const float ds0 = un.sc.x, dm0 = un.sc.y, ds1 = un.sc.z, dm1 = un.sc.w;
        const u32 v[4] = {un.v[0], un.v[1], un.v[2], un.v[3]};
        float part[NT];
#pragma unroll
        for (int t = 0; t < NT; ++t) part[t] = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int kk = (k + c) & 3;
            const u32 lo = v[k] & 0x0F0F0F0Fu, hi = (v[k] >> 4) & 0x0F0F0F0Fu;
            float w0[4], w1[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                w0[j] = ds0 * byte_f32(lo, j) - dm0;
                w1[j] = ds1 * byte_f32(hi, j) - dm1;
            }
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                if (t < nt) {
                    const float* xt = xl + (size_t)t * stride;
                    const float4 a = ld_x4(xt + 4 * kk), e = ld_x4(xt + 32 + 4 * kk);
                    const float as[4] = {a.x, a.y, a.z, a.w}, es[4] = {e.x, e.y, e.z, e.w};
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        part[t] += w0[j] * as[j];
                        part[t] += w1[j] * es[j];
                    }
                }
            }
        }
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[t] += part[t];
    }
    // A unit's weights as dot_loaded_tok decodes them: w0[k][j] (sub-block 2c, word k of the
    // rotated order) and w1[k][j] (2c + 1); the unit's activations start at x - 32 g + xoff.
    struct Decoded {
        float w0[4][4], w1[4][4];
    };
    static __device__ __forceinline__ Decoded decode(const Raw& r, int g) {
        const Unit un = unit(r, g);
        const float ds0 = un.sc.x, dm0 = un.sc.y, ds1 = un.sc.z, dm1 = un.sc.w;
        const u32 v[4] = {un.v[0], un.v[1], un.v[2], un.v[3]};
        Decoded u;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const u32 lo = v[k] & 0x0F0F0F0Fu, hi = (v[k] >> 4) & 0x0F0F0F0Fu;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                u.w0[k][j] = ds0 * byte_f32(lo, j) - dm0;
                u.w1[k][j] = ds1 * byte_f32(hi, j) - dm1;
            }
        }
        return u;
    }
    // dot_loaded_tok for two rows' units at the same position g (the same activations): each
    // token's activations loaded once for both; each row's sums in dot_loaded_tok's order.
    template <int NT>
    static __device__ __forceinline__ void dot_loaded_tok2(const Raw& ra, const Raw& rb, int g,
                                                           const float* __restrict__ x, int stride, int nt,
                                                           float (&acca)[NT], float (&accb)[NT]) {
        const int c = g >> 1, h = g & 1;
        const float* xl = x - 32 * g + 64 * c + 16 * h;
        const Decoded ua = decode(ra, g), ub = decode(rb, g);
        float pa[NT], pb[NT];
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            pa[t] = 0.0f;
            pb[t] = 0.0f;
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int kk = (k + c) & 3;
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                if (t < nt) {
                    const float* xt = xl + (size_t)t * stride;
                    const float4 a = ld_x4(xt + 4 * kk), e = ld_x4(xt + 32 + 4 * kk);
                    const float as[4] = {a.x, a.y, a.z, a.w}, es[4] = {e.x, e.y, e.z, e.w};
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        pa[t] += ua.w0[k][j] * as[j];
                        pa[t] += ua.w1[k][j] * es[j];
                    }
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        pb[t] += ub.w0[k][j] * as[j];
                        pb[t] += ub.w1[k][j] * es[j];
                    }
                }
            }
        }
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            acca[t] += pa[t];
            accb[t] += pb[t];
        }
    }
    // a's first word made to depend on b's loaded words (an identity lop3: result = a): a's
    // arithmetic then waits for b's loads, so ptxas issues them before it.
    static __device__ __forceinline__ void pin(Raw& a, const Raw& b) {
        asm volatile("lop3.b32 %0, %0, %1, %2, 0xF0;" : "+r"(a.q.x) : "r"(b.q.x), "r"(b.hd.x));
    }
};
#else
// Q4_K (Q4K_PAIR=0): 8 sub-blocks of 32 with 6-bit scale and min; group = half a sub-block (16 values). The
// 144-byte blocks are 16-byte aligned in an aligned buffer (every weight buffer here is), so the
// header and the 16 quant bytes are one 16-byte load each.
template <>
struct GroupDot<T_Q4_K> {
    enum { G = 16, SPLIT = 0 };
    static __device__ __forceinline__ float dot(const u8* __restrict__ b, int g, const float* __restrict__ x) {
        const int sub = g >> 1;
        // d, dmin and the 12 scale bytes in one 16-byte load, decoded in registers.
        const uint4 hd = *(const uint4*)b;
        const u32 sw[3] = {hd.y, hd.z, hd.w};  // scale bytes 0..11
        int sc, m;
        q4k_scale_min(sw, sub, sc, m);
        const float ds = f16_to_f32((u16)(hd.x & 0xffff)) * (float)sc;
        const float dm = f16_to_f32((u16)(hd.x >> 16)) * (float)m;
        const u8* q = b + 16 + 32 * (sub >> 1) + 16 * (g & 1);
        const int sh = 4 * (sub & 1);
        const uint4 u = *(const uint4*)q;
        const u32 v[4] = {u.x, u.y, u.z, u.w};
        float acc = 0.0f;
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            const float4 xv = ld_x4(x + 4 * w);
            const float xs[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) acc += (ds * (float)((v[w] >> (8 * j + sh)) & 15) - dm) * xs[j];
        }
        return acc;
    }
};
#endif

// Q8_0: one scale per block of 32; group = half a block.
template <>
struct GroupDot<T_Q8_0> {
    enum { G = 16, SPLIT = 0 };
    static __device__ __forceinline__ float dot(const u8* __restrict__ b, int g, const float* __restrict__ x) {
        const float d = ld_f16(b);
        const u8* q = b + 2 + 16 * g;
        float acc = 0.0f;
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            const u32 v = ld_u32_a2(q + 4 * w);
            const float4 xv = ld_x4(x + 4 * w);
            const float xs[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) acc += (d * (float)(i8)(v >> (8 * j))) * xs[j];
        }
        return acc;
    }
};

// The IQ2_XXS grid and sign table in shared memory, copied there by every block of a kernel that
// decodes IQ2_XXS rows (stage_tables<T>() first thing in each kernel body): 32 random lookups
// cost a few bank conflicts there, against one L1 wavefront per distinct line of the global table.
__shared__ u64 s_iq2xxs_grid[256];
__shared__ u8 s_ksigns_iq2xs[128];

template <typename T>
__device__ __forceinline__ void stage_tables() {}

template <>
__device__ __forceinline__ void stage_tables<T_IQ2_XXS>() {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) s_iq2xxs_grid[i] = g_iq2xxs_grid[i];
    for (int i = threadIdx.x; i < 128; i += blockDim.x) s_ksigns_iq2xs[i] = g_ksigns_iq2xs[i];
    __syncthreads();
}

// IQ2_XXS: 8 sub-blocks of 32 (4 grid indices, then a u32 of 7-bit sign codes and the scale);
// group = one grid entry (8 values).
#if IQ2_G32
// IQ2_XXS with a whole sub-block (32 values, one scale, four grid entries) per group: its index and
// sign/scale words loaded and the scale computed once for 32 weights instead of once per 8.
template <>
struct GroupDot<T_IQ2_XXS> {
    enum { G = 32, SPLIT = 0 };
    static __device__ __forceinline__ float dot(const u8* __restrict__ b, int g, const float* __restrict__ x) {
        const u8* at = b + 2 + 8 * g;
        const u32 idx = ld_u32_a2(at), aux = ld_u32_a2(at + 4);
        const float db = ld_f16(b) * (0.5f + (float)(aux >> 28)) * 0.25f;
        float acc = 0.0f;
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            const u64 row = s_iq2xxs_grid[(idx >> (8 * l)) & 255];  // staged by stage_tables
            const u8 signs = s_ksigns_iq2xs[(aux >> (7 * l)) & 127];
            const float4 x0 = ld_x4(x + 8 * l), x1 = ld_x4(x + 8 * l + 4);
            const float xs[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
            const u32 lo = (u32)row, hi = (u32)(row >> 32);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                float w = db * byte_f32(j < 4 ? lo : hi, j & 3);
                if ((signs >> j) & 1) w = -w;
                acc += w * xs[j];
            }
        }
        return acc;
    }
};
#else
template <>
struct GroupDot<T_IQ2_XXS> {
    enum { G = 8, SPLIT = 0 };
    static __device__ __forceinline__ float dot(const u8* __restrict__ b, int g, const float* __restrict__ x) {
        const int ib = g >> 2, l = g & 3;
        const u8* at = b + 2 + 8 * ib;
        const u32 aux = ld_u32_a2(at + 4);
        const float db = ld_f16(b) * (0.5f + (float)(aux >> 28)) * 0.25f;
        const u64 row = s_iq2xxs_grid[at[l]];  // staged by stage_tables<T_IQ2_XXS>()
        const u8 signs = s_ksigns_iq2xs[(aux >> (7 * l)) & 127];
        const float4 x0 = ld_x4(x), x1 = ld_x4(x + 4);
        const float xs[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
        float acc = 0.0f;
#if IQ2_U32
        // The grid row as two 32-bit halves: a byte becomes a float by a byte permute and I2FP
        // (from the 64-bit row the compiler emits one I2F.U64 per weight); the sign as a negation
        // (x * -1 is -x exactly). Same values in the same order: bit for bit the form below.
        const u32 lo = (u32)row, hi = (u32)(row >> 32);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            float w = db * byte_f32(j < 4 ? lo : hi, j & 3);
            if ((signs >> j) & 1) w = -w;
            acc += w * xs[j];
        }
#else
#pragma unroll
        for (int j = 0; j < 8; ++j) acc += (db * (float)((row >> (8 * j)) & 255) * sign_of(signs, j)) * xs[j];
#endif
        return acc;
    }
};
#endif

// F32 (blocks of one value): group = 4 values, one 16-byte load when aligned.
template <>
struct GroupDot<T_F32> {
    enum { G = 4, SPLIT = 0 };
    static __device__ __forceinline__ float4 load4(const u8* __restrict__ b) {
        float4 v;
        if (((size_t)b & 15) == 0) {
            v = *(const float4*)b;
        } else {
            const float* f = (const float*)b;
            v = make_float4(f[0], f[1], f[2], f[3]);
        }
        return v;
    }
    // A group's sum: one expression (its contractions) for the one-token and token-tile kernels.
    static __device__ __forceinline__ float dot4(float4 v, float4 u) {
        return v.x * u.x + v.y * u.y + v.z * u.z + v.w * u.w;
    }
    static __device__ __forceinline__ float dot(const u8* __restrict__ b, int, const float* __restrict__ x) {
        return dot4(load4(b), make_float4(x[0], x[1], x[2], x[3]));
    }
};

// The lane's share of one row's dot product when the row is cut into `parts` slices and the warp
// takes slice `part` (units of work dealt round-robin: warp blocks, groups, or values); the warp
// sum of the slices' partials over every slice is the row's dot. parts = 1: the whole row.
template <typename T>
__device__ __forceinline__ float row_partial(const u8* __restrict__ wr, const float* __restrict__ x, int cols,
                                             int lane, int part, int parts) {
    float acc = 0.0f;
    constexpr int G = GroupDot<T>::G;
    if constexpr (WarpBlockDot<T>::ON) {
        // The warp takes one block at a time, every lane a share of it.
        const int nb = cols / T::QK;
        constexpr int U = WB_UNROLL;
#pragma unroll U
        for (int ib = part; ib < nb; ib += parts) {
            acc += WarpBlockDot<T>::dot(wr + (size_t)ib * T::BB, lane, x + (size_t)ib * T::QK);
        }
    } else if constexpr (G > 0 && G <= T::QK) {
        // Groups inside a block.
        constexpr int PER_BLOCK = T::QK / G;
        const int groups = cols / G;
        if constexpr (GroupDot<T>::SPLIT) {
            // Two groups per iteration, both loaded first; the sums in the one-at-a-time order.
            const int stride = parts * WARP;
            int gi = part * WARP + lane;
            for (; gi + stride < groups; gi += 2 * stride) {
                const int gj = gi + stride;
                auto r0 = GroupDot<T>::load(wr + (size_t)(gi / PER_BLOCK) * T::BB, gi % PER_BLOCK);
                const auto r1 = GroupDot<T>::load(wr + (size_t)(gj / PER_BLOCK) * T::BB, gj % PER_BLOCK);
                // Uses of both loads here keep ptxas from sinking the second pair below the first
                // group's arithmetic: the two groups' latencies overlap.
                GroupDot<T>::pin(r0, r1);
                acc += GroupDot<T>::dot_loaded(r0, gi % PER_BLOCK, x + (size_t)gi * G);
                acc += GroupDot<T>::dot_loaded(r1, gj % PER_BLOCK, x + (size_t)gj * G);
            }
            if (gi < groups) {
                acc += GroupDot<T>::dot(wr + (size_t)(gi / PER_BLOCK) * T::BB, gi % PER_BLOCK, x + (size_t)gi * G);
            }
        } else {
#pragma unroll MVF_UNROLL
            for (int gi = part * WARP + lane; gi < groups; gi += parts * WARP) {
                acc += GroupDot<T>::dot(wr + (size_t)(gi / PER_BLOCK) * T::BB, gi % PER_BLOCK, x + (size_t)gi * G);
            }
        }
    } else if constexpr (G > 0) {
        // Groups of several one-value blocks (F32); a tail shorter than a group goes value by value.
        const int groups = cols / G;
        for (int gi = part * WARP + lane; gi < groups; gi += parts * WARP) {
            acc += GroupDot<T>::dot(wr + (size_t)gi * G * T::BB, 0, x + (size_t)gi * G);
        }
        for (int k = groups * G + part * WARP + lane; k < cols; k += parts * WARP) {
            acc += T::dq(wr + (size_t)k * T::BB, 0) * x[k];
        }
    } else {
        for (int k = part * WARP + lane; k < cols; k += parts * WARP) {
            acc += T::dq(wr + (size_t)(k / T::QK) * T::BB, k % T::QK) * x[k];
        }
    }
    return acc;
}

// Two rows' lane partials at once (group decoders with SPLIT only): each iteration loads two
// groups of each row before any arithmetic, so four loads per lane are in flight. Each row's sum
// is in row_partial's order, so the values are row_partial's bit for bit.
template <typename T>
__device__ __forceinline__ void row_partial2(const u8* __restrict__ wa, const u8* __restrict__ wb,
                                             const float* __restrict__ x, int cols, int lane, int part, int parts,
                                             float& acc_a, float& acc_b) {
    using D = GroupDot<T>;
    constexpr int G = D::G, PER_BLOCK = T::QK / G;
    const int groups = cols / G, stride = parts * WARP;
    float a = 0.0f, b = 0.0f;
    int gi = part * WARP + lane;
    for (; gi + stride < groups; gi += 2 * stride) {
        const int gj = gi + stride;
        const size_t oi = (size_t)(gi / PER_BLOCK) * T::BB, oj = (size_t)(gj / PER_BLOCK) * T::BB;
        auto a0 = D::load(wa + oi, gi % PER_BLOCK);
        const auto a1 = D::load(wa + oj, gj % PER_BLOCK);
        const auto b0 = D::load(wb + oi, gi % PER_BLOCK);
        const auto b1 = D::load(wb + oj, gj % PER_BLOCK);
        D::pin(a0, a1);
        D::pin(a0, b0);
        D::pin(a0, b1);
        a += D::dot_loaded(a0, gi % PER_BLOCK, x + (size_t)gi * G);
        a += D::dot_loaded(a1, gj % PER_BLOCK, x + (size_t)gj * G);
        b += D::dot_loaded(b0, gi % PER_BLOCK, x + (size_t)gi * G);
        b += D::dot_loaded(b1, gj % PER_BLOCK, x + (size_t)gj * G);
    }
    if (gi < groups) {
        const size_t oi = (size_t)(gi / PER_BLOCK) * T::BB;
        auto a0 = D::load(wa + oi, gi % PER_BLOCK);
        const auto b0 = D::load(wb + oi, gi % PER_BLOCK);
        D::pin(a0, b0);
        a += D::dot_loaded(a0, gi % PER_BLOCK, x + (size_t)gi * G);
        b += D::dot_loaded(b0, gi % PER_BLOCK, x + (size_t)gi * G);
    }
    acc_a = a;
    acc_b = b;
}

// Two F32 rows' lane partials at once (either row may be null: 0), each in row_partial<T_F32>'s
// order and expression, so each value is row_partial's bit for bit; both rows' loads issue before
// either's arithmetic.
__device__ __forceinline__ void row_partial_pair_f32(const u8* __restrict__ wa, const u8* __restrict__ wb,
                                                     const float* __restrict__ x, int cols, int lane, int part,
                                                     int parts, float& acc_a, float& acc_b) {
    using D = GroupDot<T_F32>;
    constexpr int G = D::G;
    const int groups = cols / G;
    float a = 0.0f, b = 0.0f;
#pragma unroll 2
    for (int gi = part * WARP + lane; gi < groups; gi += parts * WARP) {
        const size_t o = (size_t)gi * G * T_F32::BB;
        const float4 va = wa != nullptr ? D::load4(wa + o) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        const float4 vb = wb != nullptr ? D::load4(wb + o) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        const float* xg = x + (size_t)gi * G;
        const float4 u = make_float4(xg[0], xg[1], xg[2], xg[3]);
        a += D::dot4(va, u);
        b += D::dot4(vb, u);
    }
    for (int k = groups * G + part * WARP + lane; k < cols; k += parts * WARP) {
        if (wa != nullptr) a += T_F32::dq(wa + (size_t)k * T_F32::BB, 0) * x[k];
        if (wb != nullptr) b += T_F32::dq(wb + (size_t)k * T_F32::BB, 0) * x[k];
    }
    acc_a = a;
    acc_b = b;
}

// F32 token tiles: each group's weights loaded once for the tile's tokens (1, default) or the
// whole row walked once per token (0, what sessions up to 28 measured).
#ifndef F32_TOK_LOOP
#define F32_TOK_LOOP 1
#endif
// The lane's partials of one row for nt (<= NT) tokens whose activations are NT rows `stride`
// apart (the token-tile kernels): with a SPLIT group decoder each group's weights are loaded and
// decoded once for all the tokens (dot_loaded_tok); otherwise row_partial per token. Each token's
// value is row_partial's for that token bit for bit (same groups, same order).
template <typename T, int NT>
__device__ __forceinline__ void row_partial_tok(const u8* __restrict__ wr, const float* __restrict__ x, int cols,
                                                int stride, int nt, int lane, int part, int parts,
                                                float (&acc)[NT]) {
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t] = 0.0f;
    using D = GroupDot<T>;
    if constexpr (D::SPLIT && D::G > 0 && D::G <= T::QK) {
        constexpr int G = D::G, PER_BLOCK = T::QK / G;
        const int groups = cols / G, step = parts * WARP;
        int gi = part * WARP + lane;
        for (; gi + step < groups; gi += 2 * step) {
            const int gj = gi + step;
            auto r0 = D::load(wr + (size_t)(gi / PER_BLOCK) * T::BB, gi % PER_BLOCK);
            const auto r1 = D::load(wr + (size_t)(gj / PER_BLOCK) * T::BB, gj % PER_BLOCK);
            D::pin(r0, r1);
            D::template dot_loaded_tok<NT>(r0, gi % PER_BLOCK, x + (size_t)gi * G, stride, nt, acc);
            D::template dot_loaded_tok<NT>(r1, gj % PER_BLOCK, x + (size_t)gj * G, stride, nt, acc);
        }
        if (gi < groups) {
            const auto r0 = D::load(wr + (size_t)(gi / PER_BLOCK) * T::BB, gi % PER_BLOCK);
            D::template dot_loaded_tok<NT>(r0, gi % PER_BLOCK, x + (size_t)gi * G, stride, nt, acc);
        }
    } else if constexpr (F32_TOK_LOOP && D::G > T::QK) {
        // Groups of several one-value blocks (F32): each group's weights loaded once for all the
        // tokens, then row_partial's group sum per token (the same expression: its bits); the
        // tokens' activations as 16-byte loads when they are aligned (values, not order).
        constexpr int G = D::G;
        const int groups = cols / G;
        const bool x16 = ((((size_t)x) | ((size_t)stride * sizeof(float))) & 15) == 0;
        for (int gi = part * WARP + lane; gi < groups; gi += parts * WARP) {
            const float4 v = D::load4(wr + (size_t)gi * G * T::BB);
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                if (t < nt) {
                    const float* xt = x + (size_t)t * stride + (size_t)gi * G;
                    const float4 u = x16 ? *(const float4*)xt : make_float4(xt[0], xt[1], xt[2], xt[3]);
                    acc[t] += D::dot4(v, u);
                }
            }
        }
        for (int k = groups * G + part * WARP + lane; k < cols; k += parts * WARP) {
            const float v = T::dq(wr + (size_t)k * T::BB, 0);
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                if (t < nt) acc[t] += v * x[(size_t)t * stride + k];
            }
        }
    } else {
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if (t < nt) acc[t] = row_partial<T>(wr, x + (size_t)t * stride, cols, lane, part, parts);
        }
    }
}

#if Q4K_PAIR
// row_partial_tok<T_Q4_K> of two rows (wa, wb: wb = wa past the matrix, its sums then unused) with
// each token's activations loaded once for both (dot_loaded_tok2): the same units in the same
// order per row, so each row's partials are row_partial_tok's bit for bit.
template <int NT>
__device__ __forceinline__ void row_partial_tok2_q4k(const u8* __restrict__ wa, const u8* __restrict__ wb,
                                                     const float* __restrict__ x, int cols, int stride, int nt,
                                                     int lane, int part, int parts, float (&acca)[NT],
                                                     float (&accb)[NT]) {
    using D = GroupDot<T_Q4_K>;
    constexpr int G = D::G, PER_BLOCK = T_Q4_K::QK / G;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        acca[t] = 0.0f;
        accb[t] = 0.0f;
    }
    const int groups = cols / G, step = parts * WARP;
    int gi = part * WARP + lane;
    for (; gi + step < groups; gi += 2 * step) {
        const int gj = gi + step;
        const size_t bi = (size_t)(gi / PER_BLOCK) * T_Q4_K::BB, bj = (size_t)(gj / PER_BLOCK) * T_Q4_K::BB;
        auto a0 = D::load(wa + bi, gi % PER_BLOCK), b0 = D::load(wb + bi, gi % PER_BLOCK);
        const auto a1 = D::load(wa + bj, gj % PER_BLOCK), b1 = D::load(wb + bj, gj % PER_BLOCK);
        D::pin(a0, a1);
        D::template dot_loaded_tok2<NT>(a0, b0, gi % PER_BLOCK, x + (size_t)gi * G, stride, nt, acca, accb);
        D::template dot_loaded_tok2<NT>(a1, b1, gj % PER_BLOCK, x + (size_t)gj * G, stride, nt, acca, accb);
    }
    if (gi < groups) {
        const size_t bi = (size_t)(gi / PER_BLOCK) * T_Q4_K::BB;
        const auto a0 = D::load(wa + bi, gi % PER_BLOCK), b0 = D::load(wb + bi, gi % PER_BLOCK);
        D::template dot_loaded_tok2<NT>(a0, b0, gi % PER_BLOCK, x + (size_t)gi * G, stride, nt, acca, accb);
    }
}
#endif

template <typename T>
__device__ __forceinline__ float row_dot(const u8* __restrict__ wr, const float* __restrict__ x, int cols, int lane) {
    return warp_sum(row_partial<T>(wr, x, cols, lane, 0, 1));
}

template <typename T>
__device__ __forceinline__ size_t row_bytes(int cols) {
    return (size_t)(cols / T::QK) * T::BB;
}

template <typename T>
__device__ __forceinline__ void matvec_body(const u8* __restrict__ w, const float* __restrict__ x,
                                            float* __restrict__ y, int rows, int cols) {
    const int warps = blockDim.x / WARP;
    const int row = blockIdx.x * warps + threadIdx.x / WARP;
    const int lane = threadIdx.x % WARP;
    const int t = blockIdx.y;
    if (row < rows && t == 0) prefetch_l2(w + (size_t)row * row_bytes<T>(cols), row_bytes<T>(cols), lane, WARP);
    stage_tables<T>();  // before any warp leaves
    pdl_enter();  // the weights are on their way; x comes from the kernel before
    if (row >= rows) return;  // whole warps leave together
    const float acc = row_dot<T>(w + (size_t)row * row_bytes<T>(cols), x + (size_t)t * cols, cols, lane);
    if (lane == 0) y[(size_t)t * rows + row] = acc;
}

// ----- Fused forms for the device-resident model (fewer launches per decode step) -----
// Block = MVF_WARPS warps (256 threads). The host's `split` argument is parts | rows << 8: each
// row is cut into `parts` slices (a power of two up to MVF_WARPS) and each group of `parts` warps
// takes `rows` consecutive rows (1 .. MVF_MAX_ROWS; 0 reads as 1), so a block covers
// MVF_WARPS / parts * rows rows. Warp p of a group computes slice p of each of its rows
// (row_partial): a lane walks few groups of a row and more loads are in flight at once; more rows
// per warp spread a block's prologue (staging x, the IQ tables) over more weights. The slices'
// sums are added in order in shared memory, so a row's value depends neither on `rows` nor on
// where the row falls.
#define MVF_WARPS 8
#define MVF_MAX_ROWS 4

struct MvfSplit {
    int parts, rows;
};

__device__ __forceinline__ MvfSplit mvf_split(int split) {
    MvfSplit s;
    s.parts = split & 255;
    s.rows = min(max(split >> 8, 1), MVF_MAX_ROWS);
    return s;
}

__device__ __forceinline__ int mvf_rows_per_block(MvfSplit s) { return MVF_WARPS / s.parts * s.rows; }

// The first of this warp's rows (its rows: first .. first + s.rows - 1, those < rows) and its slice.
__device__ __forceinline__ void mvf_first(int block, MvfSplit s, int& first, int& part) {
    const int w = threadIdx.x / WARP;
    first = (block * (MVF_WARPS / s.parts) + w / s.parts) * s.rows;
    part = w % s.parts;
}

// The products of the warp's rows (at most NR of them, zero past `rows`) into y: lane partials
// (every row's loads issued before the first row's arithmetic where the compiler can), each row's
// slices added in order in shared memory, then y[row] = scale * sum (add: y[row] += sum) by warp
// `part == 0`. Every thread reaches its barrier. NR = 1 is the one-row-per-warp form; callers
// take it when s.rows == 1 so that form pays for no unused rows; NR = 2 runs the two rows
// together (row_partial2) where the decoder allows.
template <typename T, int NR>
__device__ __forceinline__ void mvf_rows_dot(const u8* __restrict__ w, const float* __restrict__ x, int cols,
                                             int rows, int first, int part, MvfSplit s, float* __restrict__ y,
                                             float scale, bool add) {
    __shared__ float red[NR][MVF_WARPS];
    const int wi = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    float acc[NR];
    constexpr bool PAIRED = NR == 2 && GroupDot<T>::SPLIT && GroupDot<T>::G > 0 && GroupDot<T>::G <= T::QK;
    bool paired = false;
    if constexpr (PAIRED) {
        if (first + 1 < rows) {
            row_partial2<T>(w + (size_t)first * row_bytes<T>(cols), w + (size_t)(first + 1) * row_bytes<T>(cols),
                            x, cols, lane, part, s.parts, acc[0], acc[NR - 1]);
            paired = true;
        }
    }
    if (!paired) {
#pragma unroll
        for (int k = 0; k < NR; ++k) {
            const int row = first + k;
            acc[k] = (k < s.rows && row < rows)
                         ? row_partial<T>(w + (size_t)row * row_bytes<T>(cols), x, cols, lane, part, s.parts)
                         : 0.0f;
        }
    }
#pragma unroll
    for (int k = 0; k < NR; ++k) {
        const float v = warp_sum(acc[k]);
        if (lane == 0) red[k][wi] = v;
    }
    __syncthreads();
    if (part != 0 || lane != 0) return;
#pragma unroll
    for (int k = 0; k < NR; ++k) {
        const int row = first + k;
        if (k < s.rows && row < rows) {
            float sum = 0.0f;
            for (int p = 0; p < s.parts; ++p) sum += red[k][wi + p];
            if (add) {
                y[row] += sum;
            } else {
                y[row] = scale * sum;
            }
        }
    }
}

// PAIRS: compile the two-row form too (it takes registers from every path of the kernel: 64 → 80
// for Q4_K, so matvec_res, which runs one row per warp, leaves it out).
template <typename T, bool PAIRS>
__device__ __forceinline__ void mvf_rows(const u8* __restrict__ w, const float* __restrict__ x, int cols, int rows,
                                         int first, int part, MvfSplit s, float* __restrict__ y, float scale,
                                         bool add) {
    if (s.rows == 1) {
        mvf_rows_dot<T, 1>(w, x, cols, rows, first, part, s, y, scale, add);
    } else if (PAIRS && s.rows == 2) {
        mvf_rows_dot<T, 2>(w, x, cols, rows, first, part, s, y, scale, add);
    } else {
        mvf_rows_dot<T, MVF_MAX_ROWS>(w, x, cols, rows, first, part, s, y, scale, add);
    }
}

// Prefetch of the warp's rows into L2 (consecutive rows: one range).
template <typename T>
__device__ __forceinline__ void mvf_prefetch(const u8* w, int cols, int rows, int first, int part, MvfSplit s) {
    if (first >= rows) return;
    const int n = min(s.rows, rows - first);
    prefetch_l2(w + (size_t)first * row_bytes<T>(cols), (size_t)n * row_bytes<T>(cols),
                part * WARP + threadIdx.x % WARP, s.parts * WARP);
}

// The matrix of up to three (norm3 kernels: rows_m = 0 leaves m out) that block `block` works on,
// its output, its rows and the block's index within it (`rpb` rows per block).
struct MvfMatrix {
    const u8* w;
    float* y;
    int rows, block;
};

__device__ __forceinline__ MvfMatrix mvf_matrix(int block, int rpb, const u8* w0, float* y0, int r0, const u8* w1,
                                                float* y1, int r1, const u8* w2, float* y2, int r2) {
    const int nb0 = (r0 + rpb - 1) / rpb, nb1 = (r1 + rpb - 1) / rpb;
    if (block < nb0) return MvfMatrix{w0, y0, r0, block};
    block -= nb0;
    if (block < nb1) return MvfMatrix{w1, y1, r1, block};
    return MvfMatrix{w2, y2, r2, block - nb1};
}

// xs = x * nw (n values, into shared memory) and the block's sum of squares of x, in one pass;
// returns 1 / rms(x) (nw null: xs = x, returns 1). Ends with a barrier.
__device__ __forceinline__ float stage_normed(const float* __restrict__ x, const float* __restrict__ nw,
                                              float eps, int n, float* xs) {
    __shared__ float part_ss[MVF_WARPS];
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = x[i];
        ss += v * v;
        xs[i] = nw == nullptr ? v : v * nw[i];
    }
    ss = warp_sum(ss);
    if (threadIdx.x % WARP == 0) part_ss[threadIdx.x / WARP] = ss;
    __syncthreads();
    if (nw == nullptr) return 1.0f;
    float tot = 0.0f;
    for (int w = 0; w < MVF_WARPS; ++w) tot += part_ss[w];
    return 1.0f / sqrtf(tot / (float)n + eps);
}

#define MVF_MAX_TILE 4
// stage_normed for the nt (<= MVF_MAX_TILE) tokens of a tile at once: xs[t] = x[t] * nw and
// invs[t] = 1 / rms(x[t]) (nw null: 1), each token's squares summed in stage_normed's order (per
// thread, per warp, then the warps in order), so the same bits; every token's loads in flight
// together and one barrier for the tile instead of two a token. invs is written by threads
// 0 .. nt - 1 after the barrier: read it after a later one. Ends with a barrier (xs complete).
__device__ __forceinline__ void stage_normed_tile(const float* __restrict__ x, const float* __restrict__ nw, float eps,
                                                  int cols, int nt, float* xs, float* invs) {
    __shared__ float part_ss[MVF_MAX_TILE][MVF_WARPS];
    float ss[MVF_MAX_TILE];
#pragma unroll
    for (int t = 0; t < MVF_MAX_TILE; ++t) ss[t] = 0.0f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        const float wi = nw == nullptr ? 1.0f : nw[i];
#pragma unroll
        for (int t = 0; t < MVF_MAX_TILE; ++t) {
            if (t < nt) {
                const float v = x[(size_t)t * cols + i];
                ss[t] += v * v;
                xs[(size_t)t * cols + i] = nw == nullptr ? v : v * wi;
            }
        }
    }
#pragma unroll
    for (int t = 0; t < MVF_MAX_TILE; ++t) {
        const float v = warp_sum(ss[t]);
        if (threadIdx.x % WARP == 0) part_ss[t][threadIdx.x / WARP] = v;
    }
    __syncthreads();
    if (threadIdx.x < nt) {
        const int t = threadIdx.x;
        float tot = 0.0f;
        for (int w = 0; w < MVF_WARPS; ++w) tot += part_ss[t][w];
        invs[t] = nw == nullptr ? 1.0f : 1.0f / sqrtf(tot / (float)cols + eps);
    }
}

// matvec_norm3_<type>(x, nw, eps, cols, split, w0, y0, rows0, w1, y1, rows1, w2, y2, rows2): up to
// three matrices of one type and width that read the same normalised input, in one launch:
// y_m[t] = W_m . (rms_norm(x[t]) * nw), computed as rsqrt(mean(x^2) + eps) * (W_m . (x[t] * nw));
// nw null: W_m . x[t]. rows_m = 0 leaves matrix m out. Every block stages x[t] * nw in shared
// memory and sums the squares itself (the 2048-wide input is cheap beside its rows), so the norm
// costs no launch of its own. Launch: grid = (sum over m of ceil(rows_m / rows per block),
// n), block = 32 * MVF_WARPS, dynamic shared memory = 4 * cols bytes.
template <typename T>
__device__ __forceinline__ void matvec_norm3_body(const float* __restrict__ x, const float* __restrict__ nw,
                                                  float eps, int cols, int split, const u8* w0, float* y0,
                                                  int r0, const u8* w1, float* y1, int r1, const u8* w2,
                                                  float* y2, int r2) {
    extern __shared__ float4 mvf_x4[];  // float4: 16-byte aligned for the group decoders' loads
    float* mvf_x = (float*)mvf_x4;
    const MvfSplit s = mvf_split(split);
    const int rpb = mvf_rows_per_block(s);
    const MvfMatrix m = mvf_matrix(blockIdx.x, rpb, w0, y0, r0, w1, y1, r1, w2, y2, r2);
    const u8* w = m.w;
    float* y = m.y;
    const int rows = m.rows, b = m.block;
    const int t = blockIdx.y;
    int first, part;
    mvf_first(b, s, first, part);
    // The warps fetch their rows' lines while the block stages x.
    mvf_prefetch<T>(w, cols, rows, first, part, s);
    stage_tables<T>();
    pdl_enter();  // x comes from the kernel before
    const float inv = stage_normed(x + (size_t)t * cols, nw, eps, cols, mvf_x);
    mvf_rows<T, true>(w, mvf_x, cols, rows, first, part, s, y + (size_t)t * rows, inv, false);
}

// matvec3_x_f32(x, cols, split, w0, y0, rows0, w1, y1, rows1, w2, y2, rows2): matvec_norm3_f32
// without norm weights, x[t] read in place (no staging, no barrier before the rows): the router
// logits and the shared expert's gate logit of a decode step. The same lane partials in the same
// order as matvec_norm3_f32 on the staged x: its outputs bit for bit. Launch: as matvec_norm3,
// no dynamic shared memory.
__device__ __forceinline__ void matvec3_x_f32_body(const float* x, int cols, int split, const u8* w0, float* y0,
                                                   int r0, const u8* w1, float* y1, int r1, const u8* w2, float* y2,
                                                   int r2) {
    const MvfSplit s = mvf_split(split);
    const MvfMatrix m = mvf_matrix(blockIdx.x, mvf_rows_per_block(s), w0, y0, r0, w1, y1, r1, w2, y2, r2);
    const int t = blockIdx.y;
    int first, part;
    mvf_first(m.block, s, first, part);
    mvf_prefetch<T_F32>(m.w, cols, m.rows, first, part, s);
    pdl_enter();  // x comes from the kernel before
    mvf_rows<T_F32, true>(m.w, x + (size_t)t * cols, cols, m.rows, first, part, s, m.y + (size_t)t * m.rows, 1.0f,
                          false);
}

extern "C" __global__ __launch_bounds__(32 * MVF_WARPS) void matvec3_x_f32(const float* x, int cols, int split,
                                                                        const u8* w0, float* y0, int r0,
                                                                        const u8* w1, float* y1, int r1,
                                                                        const u8* w2, float* y2, int r2) {
    matvec3_x_f32_body(x, cols, split, w0, y0, r0, w1, y1, r1, w2, y2, r2);
}

// The token-tile products of the warp group's row `row` (one row per group; row >= rows: none)
// against the tile's nt inputs (token t at x + t * cols): row_partial_tok per lane (each weight
// decoded once for the tile), the warp sums, the slices added in order; then part 0's lane 0
// writes y[t0 + t][row] = scale[t] * sum (scale null: 1), or with ADD y[t0 + t][row] += sum.
// Every thread of the block calls it (one barrier).
template <typename T, bool ADD>
__device__ __forceinline__ void tok_rows_out(const u8* __restrict__ w, const float* x, int cols, int rows, int row,
                                             int part, MvfSplit s, float* __restrict__ y, int t0, int nt,
                                             const float* scale) {
    __shared__ float red[MVF_MAX_TILE][MVF_WARPS];
    const int wi = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    float acc[MVF_MAX_TILE];
    if (row < rows) {
        row_partial_tok<T, MVF_MAX_TILE>(w + (size_t)row * row_bytes<T>(cols), x, cols, cols, nt, lane, part,
                                         s.parts, acc);
    } else {
#pragma unroll
        for (int t = 0; t < MVF_MAX_TILE; ++t) acc[t] = 0.0f;
    }
#pragma unroll
    for (int t = 0; t < MVF_MAX_TILE; ++t) {
        const float v = warp_sum(acc[t]);
        if (lane == 0) red[t][wi] = v;
    }
    __syncthreads();
    if (row >= rows || part != 0 || lane != 0) return;
    for (int t = 0; t < nt; ++t) {
        float sum = 0.0f;
        for (int p = 0; p < s.parts; ++p) sum += red[t][wi + p];
        float* out = y + (size_t)(t0 + t) * rows + row;
        *out = ADD ? *out + sum : (scale == nullptr ? 1.0f : scale[t]) * sum;
    }
}

// matvec_norm3_tok_<type>(x, nw, eps, cols, split, n, w0, y0, rows0, ...): matvec_norm3 for n
// tokens with the weights read once per tile of `tile` tokens (split = parts | tile << 16, one row
// per warp): a block stages the normalised inputs of its tile's tokens (tile * cols floats) and
// each warp computes its row for all of them (row_partial_tok: SPLIT decoders decode each weight
// once). Every output is matvec_norm3's bit for bit. Launch: grid = (sum over m of
// ceil(rows_m / (MVF_WARPS / parts)), ceil(n / tile)), block = 32 * MVF_WARPS, dynamic shared
// memory = 4 * tile * cols bytes.
template <typename T>
__device__ __forceinline__ void matvec_norm3_tok_body(const float* __restrict__ x, const float* __restrict__ nw,
                                                      float eps, int cols, int split, int n, const u8* w0,
                                                      float* y0, int r0, const u8* w1, float* y1, int r1,
                                                      const u8* w2, float* y2, int r2) {
    extern __shared__ float4 mvf_x4[];
    float* xs = (float*)mvf_x4;  // [tile][cols]
    __shared__ float invs[MVF_MAX_TILE];
    MvfSplit s = mvf_split(split);
    s.rows = 1;
    const int tile = min(max((split >> 16) & 255, 1), MVF_MAX_TILE);
    const int rpb = mvf_rows_per_block(s);
    const MvfMatrix m = mvf_matrix(blockIdx.x, rpb, w0, y0, r0, w1, y1, r1, w2, y2, r2);
    const u8* w = m.w;
    float* y = m.y;
    const int rows = m.rows, b = m.block;
    const int t0 = blockIdx.y * tile, nt = min(tile, n - t0);
    int row, part;
    mvf_first(b, s, row, part);
    mvf_prefetch<T>(w, cols, rows, row, part, s);
    stage_tables<T>();
    pdl_enter();
    stage_normed_tile(x + (size_t)t0 * cols, nw, eps, cols, nt, xs, invs);
    tok_rows_out<T, false>(w, xs, cols, rows, row, part, s, y, t0, nt, invs);
}

// The token-tile rows with x read in place (row t at x + t * cols, no staging): for the tokens
// t0 .. t0 + nt - 1 of tile blockIdx.y (tile tokens a tile), y[t][row] = W_row . x[t] (ADD:
// y[t][row] += it), one row per warp group (s.rows is taken as 1), row_partial_tok per lane and
// the slices added in order: every output is the one-token kernel's (matvec3_x_f32, matvec_res
// without its norm) bit for bit, with the weights read and decoded once per tile. The speculative
// verify's router and output projections (matvec_norm3_tok staged every token of the tile in
// every block: a 512-row router took 30 µs for 8 tokens on the H200).
template <typename T, bool ADD>
__device__ __forceinline__ void mvf_tok_inplace_body(const u8* __restrict__ w, const float* __restrict__ x,
                                                float* __restrict__ y, int rows, int cols, MvfSplit s, int block,
                                                int tile, int n) {
    s.rows = 1;
    const int t0 = blockIdx.y * tile, nt = min(tile, n - t0);
    int row, part;
    mvf_first(block, s, row, part);
    if (blockIdx.y == 0) mvf_prefetch<T>(w, cols, rows, row, part, s);
    stage_tables<T>();
    pdl_enter();  // x (and y) come from the kernels before
    tok_rows_out<T, ADD>(w, x + (size_t)t0 * cols, cols, rows, row, part, s, y, t0, nt, nullptr);
}

#if Q4K_PAIR
// matvec_res_tok2_q4_k(w, x, y, rows, cols, split, n): matvec_res_tok_q4_k with two rows a warp
// group (the host's split says rows 2; the kernel takes 2 whatever it says): the rows' products by
// row_partial_tok2_q4k (each token's activations loaded once for both rows, L1 traffic halved),
// each row's slices added in order, y[t][row] += sum: matvec_res_tok's outputs bit for bit.
// Launch: grid = (ceil(rows / (2 * MVF_WARPS / parts)), ceil(n / tile)), block = 32 * MVF_WARPS.
extern "C" __global__ __launch_bounds__(32 * MVF_WARPS) void matvec_res_tok2_q4_k(const u8* w, const float* x,
                                                                                 float* y, int rows, int cols,
                                                                                 int split, int n) {
    __shared__ float red[2][MVF_MAX_TILE][MVF_WARPS];
    const int tile = min(max((split >> 16) & 255, 1), MVF_MAX_TILE);
    MvfSplit s = mvf_split(split);
    s.rows = 2;
    const int t0 = blockIdx.y * tile, nt = min(tile, n - t0);
    int row, part;
    mvf_first(blockIdx.x, s, row, part);
    if (blockIdx.y == 0) mvf_prefetch<T_Q4_K>(w, cols, rows, row, part, s);
    pdl_enter();  // x and y come from the kernels before
    const int wi = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const size_t rb = row_bytes<T_Q4_K>(cols);
    float acca[MVF_MAX_TILE], accb[MVF_MAX_TILE];
    if (row < rows) {
        const u8* wa = w + (size_t)row * rb;
        const u8* wb = row + 1 < rows ? wa + rb : wa;
        row_partial_tok2_q4k<MVF_MAX_TILE>(wa, wb, x + (size_t)t0 * cols, cols, cols, nt, lane, part, s.parts,
                                           acca, accb);
    } else {
#pragma unroll
        for (int t = 0; t < MVF_MAX_TILE; ++t) {
            acca[t] = 0.0f;
            accb[t] = 0.0f;
        }
    }
#pragma unroll
    for (int t = 0; t < MVF_MAX_TILE; ++t) {
        const float va = warp_sum(acca[t]), vb = warp_sum(accb[t]);
        if (lane == 0) {
            red[0][t][wi] = va;
            red[1][t][wi] = vb;
        }
    }
    __syncthreads();
    if (part != 0 || lane != 0) return;
    for (int k = 0; k < 2; ++k) {
        if (row + k >= rows) break;
        for (int t = 0; t < nt; ++t) {
            float sum = 0.0f;
            for (int p = 0; p < s.parts; ++p) sum += red[k][t][wi + p];
            float* out = y + (size_t)(t0 + t) * rows + row + k;
            *out = *out + sum;
        }
    }
}
#endif

// Tokens a block of the activations-in-registers kernels (matvec_res_xr_q4_k, matvec_q8x_xr_q6_k;
// the host's XR_TOKENS), four a warp.
#define XR_TOKENS 8
#if Q4K_PAIR
// matvec_res_xr_q4_k(w, x, y, rows, cols, split, n): the verify's output projections (Q4_K rows
// on f32 activations, y[t][row] += W_row . x[t]) with the activations held in registers:
// matvec_res_q4_k's one-token values bit for bit, for XR_TOKENS tokens and XR_ROWS rows a block.
// The token tiles (matvec_res_tok_q4_k) load each token's activations again for every row (a
// unit's 32 values, 128 bytes a token, against its 32 bytes of weights) in blocks of one row a
// warp group. Here warp w takes the token quad w % 2 (tokens 8 blockIdx.y + 4 (w % 2) ..), the
// slices (w / 2) % 2, + 2, ... (< parts) and the rows 4 (w / 4) .. + 3 of the block: lane L walks
// the units of its slice as the one-token kernel's lane L does (p * 32 + L, + parts * 32, ...);
// per unit it decodes the four rows' scales and words, then per step k loads each token's 8
// activations once for the four rows, so each weight is decoded once for four tokens and each
// activation loaded once for four rows. Each unit's value is dot_loaded's expression in its order
// (a fresh sum, then added to the row's lane partial in unit order: row_partial's), then warp_sum
// (lane L is lane L), the slices added in order from 0.0f, y[t][row] += sum. (Two tokens a warp
// and 8 rows, session 47's first form: 17.8 us a launch against this form's 14.4 in an 8-row pass.)
// Launch: grid = (ceil(rows / XR_ROWS), ceil(n / XR_TOKENS)), block = 32 * MVF_WARPS, no dynamic
// shared memory; the split's rows and tile are not read.
#define XR_ROWS 8
extern "C" __global__ __launch_bounds__(32 * MVF_WARPS, 2) void matvec_res_xr_q4_k(const u8* w, const float* x,
                                                                                  float* y, int rows, int cols,
                                                                                  int split, int n) {
    using D = GroupDot<T_Q4_K>;
    constexpr int G = D::G, PER_BLOCK = T_Q4_K::QK / G;
    __shared__ float red[XR_ROWS][XR_TOKENS][MVF_WARPS];
    const int parts = mvf_split(split).parts;
    const int wi = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int row0 = blockIdx.x * XR_ROWS, tb = blockIdx.y * XR_TOKENS;
    const size_t rb = row_bytes<T_Q4_K>(cols);
    const int nrows = min(XR_ROWS, rows - row0);
    if (blockIdx.y == 0) prefetch_l2(w + (size_t)row0 * rb, (size_t)nrows * rb, threadIdx.x, blockDim.x);
    pdl_enter();  // x and y come from the kernels before
    const int groups = cols / G;
    // Rows past the matrix (a last partial block) take its last row and tokens past n the quad's
    // first token: their sums are not written.
    static_assert(XR_ROWS == 8 && XR_TOKENS == 8 && MVF_WARPS == 8, "the quad form's warp map");
    const int quad = wi % 2, sgrp = (wi / 2) % 2, half = wi / 4;
    const int t0 = tb + 4 * quad, nt = min(max(n - t0, 0), 4);
    const float* xt[4];
#pragma unroll
    for (int t = 0; t < 4; ++t) xt[t] = x + (size_t)(t0 + (t < nt ? t : 0)) * cols;
    for (int p = sgrp; p < parts && nt > 0; p += 2) {
        float acc[4][4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
#pragma unroll
            for (int t = 0; t < 4; ++t) acc[r][t] = 0.0f;
        }
        for (int gi = p * WARP + lane; gi < groups; gi += parts * WARP) {
            const int g = gi % PER_BLOCK, c = g >> 1, h = g & 1;
            const size_t xo = (size_t)(gi - g) * G + 64 * c + 16 * h;
            const u8* wu = w + (size_t)row0 * rb + (size_t)(gi / PER_BLOCK) * T_Q4_K::BB;
            D::Raw raw[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) raw[r] = D::load(wu + (size_t)min(4 * half + r, nrows - 1) * rb, g);
            D::Unit un[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) un[r] = D::unit(raw[r], g);
            float pp[4][4];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
#pragma unroll
                for (int t = 0; t < 4; ++t) pp[r][t] = 0.0f;
            }
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const int kk = (k + c) & 3;
                float as[4][4], es[4][4];
#pragma unroll
                for (int t = 0; t < 4; ++t) {
                    const float4 a = ld_x4(xt[t] + xo + 4 * kk), e = ld_x4(xt[t] + xo + 32 + 4 * kk);
                    as[t][0] = a.x, as[t][1] = a.y, as[t][2] = a.z, as[t][3] = a.w;
                    es[t][0] = e.x, es[t][1] = e.y, es[t][2] = e.z, es[t][3] = e.w;
                }
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const u32 lo = un[r].v[k] & 0x0F0F0F0Fu, hi = (un[r].v[k] >> 4) & 0x0F0F0F0Fu;
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const float w0 = un[r].sc.x * byte_f32(lo, j) - un[r].sc.y;
                        const float w1 = un[r].sc.z * byte_f32(hi, j) - un[r].sc.w;
#pragma unroll
                        for (int t = 0; t < 4; ++t) {
                            pp[r][t] += w0 * as[t][j];
                            pp[r][t] += w1 * es[t][j];
                        }
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < 4; ++r) {
#pragma unroll
                for (int t = 0; t < 4; ++t) acc[r][t] += pp[r][t];
            }
        }
#pragma unroll
        for (int r = 0; r < 4; ++r) {
#pragma unroll
            for (int t = 0; t < 4; ++t) {
                const float v = warp_sum(acc[r][t]);
                if (lane == 0) red[4 * half + r][4 * quad + t][p] = v;
            }
        }
    }
    __syncthreads();
    static_assert(XR_ROWS * XR_TOKENS <= 32 * MVF_WARPS, "a thread an output");
    const int r = threadIdx.x / XR_TOKENS, t = threadIdx.x % XR_TOKENS;
    if (r >= nrows || tb + t >= n) return;
    float sum = 0.0f;
    for (int p = 0; p < parts; ++p) sum += red[r][t][p];
    float* out = y + (size_t)(tb + t) * rows + row0 + r;
    *out = *out + sum;
}
#endif

// matvec3_x_tok_f32(x, cols, split, n, w0, y0, rows0, ...): matvec3_x_f32 for n tokens in tiles of
// tile = split >> 16 (up to MVF_MAX_TILE), one row per warp group (mvf_tok_inplace_body): its outputs
// bit for bit. Launch: grid = (sum over m of ceil(rows_m / (MVF_WARPS / parts)), ceil(n / tile)),
// block = 32 * MVF_WARPS, no dynamic shared memory.
extern "C" __global__ __launch_bounds__(32 * MVF_WARPS) void matvec3_x_tok_f32(const float* x, int cols, int split,
                                                                            int n, const u8* w0, float* y0, int r0,
                                                                            const u8* w1, float* y1, int r1,
                                                                            const u8* w2, float* y2, int r2) {
    MvfSplit s = mvf_split(split);
    s.rows = 1;
    const int tile = min(max((split >> 16) & 255, 1), MVF_MAX_TILE);
    const MvfMatrix m = mvf_matrix(blockIdx.x, mvf_rows_per_block(s), w0, y0, r0, w1, y1, r1, w2, y2, r2);
    mvf_tok_inplace_body<T_F32, false>(m.w, x, m.y, m.rows, cols, s, m.block, tile, n);
}

// matvec_res_<type>(w, x, y, rows, cols, split, nw, yn, counter, eps): the residual in the output
// projection's epilogue, y[t] += W . x[t]; then, when nw is not null, the last block of token t to
// finish (counted in counter[t], which starts at 0 and is left at 0) writes
// yn[t] = rms_norm(y[t]) * nw (the next norm, in the order and rounding of rms_norm).
// Launch: grid = (ceil(rows / rows per block), n), block = 32 * MVF_WARPS (split: see MvfSplit).
// (Staging x[t] in shared memory here was tried: twice as slow, docs/perf-ledger.md.)
// Blocks per SM the register allocation of matvec_res_<type> must allow (4: at most 64 registers;
// the q8 epilogue inlined took it to 80 and 3 blocks per SM; as a call it stays out of the main
// loop's allocation: 64 registers, an 8-byte frame) and of matvec_q8x_q4_k.
#ifndef RES_MIN_BLOCKS
#define RES_MIN_BLOCKS 4
#endif
#ifndef Q8X_MIN_BLOCKS
#define Q8X_MIN_BLOCKS 3
#endif
__device__ __noinline__ void res_next_norm(float* __restrict__ y, int rows, const float* __restrict__ nw,
                                              float* __restrict__ yn, u32* __restrict__ counter, float eps,
                                              u8* __restrict__ xq);
// Bytes of one q8 row of `cols` values (staged in shared memory or written by a producer): the
// quants, an f32 scale per 32, an i32 sum per 16.
#define Q8_ROW_BYTES(cols) ((cols) + (cols) / 32 * 4 + (cols) / 16 * 4)

template <typename T>
__device__ __forceinline__ void matvec_res_body(const u8* __restrict__ w, const float* __restrict__ x,
                                                float* __restrict__ y, int rows, int cols, int split,
                                                const float* __restrict__ nw, float* __restrict__ yn,
                                                u32* __restrict__ counter, float eps, u8* __restrict__ xq) {
    const MvfSplit s = mvf_split(split);
    const int t = blockIdx.y;
    float* yt = y + (size_t)t * rows;
    int first, part;
    mvf_first(blockIdx.x, s, first, part);
    // All of the rows' lines requested at once (the loop would wait for each in turn).
    mvf_prefetch<T>(w, cols, rows, first, part, s);
    stage_tables<T>();
    pdl_enter();  // x and y come from the kernels before
    mvf_rows<T, false>(w, x + (size_t)t * cols, cols, rows, first, part, s, yt, 1.0f, true);
    res_next_norm(y, rows, nw, yn, counter, eps, xq);
}

// matvec_res's epilogue: when nw is not null, the last block of token t = blockIdx.y to finish
// (counted in counter[t], left at 0) writes yn[t] = rms_norm(y[t]) * nw, and with xq not null also
// yn[t] as a q8 row at xq + t * Q8_ROW_BYTES(rows) (q8_block32: the quants the consumers of xn
// would stage from it, bit for bit). Every thread calls it; rows a multiple of 32 when xq is set.
__device__ __forceinline__ void q8_block32(float u, int lane, i8* __restrict__ q, float* __restrict__ d,
                                           int* __restrict__ s16);
// q8_block32 into block b of a q8 row of `cols` values at `row` (its quants, then an f32 scale per
// 32, then an i32 sum per 16: Q8_ROW_BYTES). Every lane of the warp calls it.
__device__ __forceinline__ void q8_row_block32(float u, int lane, u8* __restrict__ row, int cols, int b) {
    q8_block32(u, lane, (i8*)row + 32 * b, (float*)(row + cols) + b, (int*)(row + cols + cols / 32 * 4) + 2 * b);
}
template <bool STAGE, bool WRITE = true>
__device__ __noinline__ float res_norm_write_t(const float* __restrict__ y, int rows, const float* __restrict__ nw,
                                               float* __restrict__ yn, float eps, u8* __restrict__ xq, int slice,
                                               int slices, float* xs);
__device__ __forceinline__ void res_norm_write(const float* __restrict__ y, int rows, const float* __restrict__ nw,
                                               float* __restrict__ yn, float eps, u8* __restrict__ xq, int slice,
                                               int slices) {
    res_norm_write_t<false>(y, rows, nw, yn, eps, xq, slice, slices, nullptr);
}
__device__ __noinline__ void res_next_norm(float* __restrict__ y, int rows, const float* __restrict__ nw,
                                              float* __restrict__ yn, u32* __restrict__ counter, float eps,
                                              u8* __restrict__ xq) {
    __shared__ int is_last;
    const int t = blockIdx.y;
    if (nw == nullptr) return;
    __threadfence();  // this block's rows are visible before it is counted
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(&counter[t], 1u) == gridDim.x - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    res_norm_write(y, rows, nw, yn, eps, xq, 0, 1);
    if (threadIdx.x == 0) counter[t] = 0;
}

// res_next_norm's write by a block of token t = blockIdx.y: yn[t] = rms_norm(y[t]) * nw and,
// with xq not null, its q8 row (rows a multiple of 32 then): the values i with (i / blockDim.x) %
// slices == slice (every block sums all the squares itself, in the same order: the same 1 / rms
// whatever the slices). Every thread of the block calls it. STAGE: every value of yn[t] also into
// xs (shared memory, `rows` floats; a slice >= slices then writes no yn or xq), read after a barrier.
// !WRITE: only the 1 / rms, returned (every form returns it).
template <bool STAGE, bool WRITE>
__device__ __noinline__ float res_norm_write_t(const float* __restrict__ y, int rows, const float* __restrict__ nw,
                                               float* __restrict__ yn, float eps, u8* __restrict__ xq, int slice,
                                               int slices, float* xs) {
    __shared__ float scratch[WARP];
    const int t = blockIdx.y;
    const float* yt = y + (size_t)t * rows;
    // The first RN_REG values of each thread stay in registers between the two passes (all their
    // loads in flight at once; 2048 rows of 256 threads: 8), the rest are read again.
    constexpr int RN_REG = 8;
    float v[RN_REG];
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < RN_REG; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        v[k] = i < rows ? ld_cg(yt + i) : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < RN_REG; ++k) ss += v[k] * v[k];
    for (int i = threadIdx.x + RN_REG * blockDim.x; i < rows; i += blockDim.x) {
        const float w = ld_cg(yt + i);
        ss += w * w;
    }
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)rows + eps);
    if (!WRITE) return inv;
    // Value i sits in lane i % 32 of a warp that holds 32 consecutive values (blockDim.x is a
    // multiple of 32): with xq, that warp quantises them as one q8 block (rows a multiple of 32,
    // so the condition is the same for the whole warp).
    const int lane = threadIdx.x % WARP;
    u8* base = xq == nullptr ? nullptr : xq + (size_t)t * Q8_ROW_BYTES(rows);
    auto out = [&](int i, float val, bool mine) {
        const float o = val * inv * nw[i];
        if (STAGE) xs[i] = o;
        if (!mine) return;
        yn[(size_t)t * rows + i] = o;
        if (base != nullptr) q8_row_block32(o, lane, base, rows, i / 32);
    };
#pragma unroll
    for (int k = 0; k < RN_REG; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < rows && (STAGE || k % slices == slice)) out(i, v[k], k % slices == slice);
    }
    for (int k = RN_REG, i = threadIdx.x + RN_REG * blockDim.x; i < rows; ++k, i += blockDim.x) {
        if (STAGE || k % slices == slice) out(i, ld_cg(yt + i), k % slices == slice);
    }
    return inv;
}

// res_norm_q8(y, rows, nw, yn, eps, xq): matvec_res's next norm as a kernel of its own (matvec_res
// launched with nw null), the same function as its last block (so the same bits): yn[t] =
// rms_norm(y[t]) * nw and its q8 row at xq + t * Q8_ROW_BYTES(rows) (xq null: none), the row cut
// into gridDim.x slices of whole warps' values, a block each (each sums all the squares).
// Launch: grid = (slices, tokens), block = 32 * MVF_WARPS (as matvec_res's blocks).
extern "C" __global__ __launch_bounds__(32 * MVF_WARPS) void res_norm_q8(const float* y, int rows, const float* nw,
                                                                      float* yn, float eps, u8* xq) {
    prefetch_l1_block(nw, (size_t)rows * 4);  // read after the sum of squares
    pdl_enter();
    res_norm_write(y, rows, nw, yn, eps, xq, blockIdx.x, gridDim.x);
}

// res_norm_router(y, rows, nw, yn, eps, xq, slices, split, early, w0, y0, r0, w1, y1, r1, w2, y2, r2):
// res_norm_q8 and the router's matvec3_x_f32 on its output in one launch (REDLITE_CUDA_NORM_ROUTER,
// one-token MoE layers: the router logits and the shared expert's gate logit are ready when the
// gate/up kernel with the top-k starts, without the fused route kernel's rows and grid barrier).
// Block b is block b of matvec3_x_f32's grid at `split` (its rows and lane partials; an F32 row's
// value does not depend on the rows a warp group takes); it also sums the squares of y[t]
// (res_norm_q8's order, so the same 1 / rms), stages yn[t] whole in shared memory and, for
// b < slices, writes res_norm_q8's slice b of yn and the q8 row. Its rows then read the staged yn:
// matvec3_x_f32's outputs on res_norm_q8's yn, bit for bit. early (with one row a warp group and at
// most RNR_EARLY groups of 4 a lane): the lane's weights loaded into registers before the wait (as
// the fused route kernel's ROUTE_W_EARLY), the same groups in row_partial's order (session 42,
// H100: decode +2.4 % with it, -0.2 % without, four rows a warp group -3.9 %). early = 2 (the
// decode step's default) adds the direct form: the grid's last `slices` blocks write the norm's
// slices and nothing else, and each other block loads its lanes' groups of y and of nw beside its
// sum of squares and forms yn there ((y · inv) · nw, res_norm_q8's expression), without staging
// yn or a barrier before its rows (+5.7 % over early = 1).
// Launch: grid = (matvec3_x_f32's blocks at `split` (early = 2: plus `slices`), tokens) with at
// least `slices` blocks, block = 32 * MVF_WARPS, dynamic shared memory = 4 * rows bytes.
#define RNR_EARLY 4
// res_norm_router's end on preloaded rows: the lanes' partials `acc` of the warp group's row
// `first` summed as mvf_rows_dot sums them (the warp sum, then the slices in order) and stored.
// Every thread of the block calls it (one barrier).
__device__ __forceinline__ void rnr_row_out(float acc, float* red, const MvfSplit& s, int first, int part,
                                            const MvfMatrix& m, int t) {
    const int lane = threadIdx.x % WARP, wi = threadIdx.x / WARP;
    const float v = warp_sum(acc);
    if (lane == 0) red[wi] = v;
    __syncthreads();
    if (part != 0 || lane != 0 || first >= m.rows) return;
    float sum = 0.0f;
    for (int p = 0; p < s.parts; ++p) sum += red[wi + p];
    m.y[(size_t)t * m.rows + first] = 1.0f * sum;
}

extern "C" __global__ __launch_bounds__(32 * MVF_WARPS) void res_norm_router(
    const float* y, int rows, const float* nw, float* yn, float eps, u8* xq, int slices, int split, int early,
    const u8* w0, float* y0, int r0, const u8* w1, float* y1, int r1, const u8* w2, float* y2, int r2) {
    extern __shared__ float4 rnr_x4[];
    __shared__ float red[MVF_WARPS];
    float* xs = (float*)rnr_x4;
    const MvfSplit s = mvf_split(split);
    const MvfMatrix m = mvf_matrix(blockIdx.x, mvf_rows_per_block(s), w0, y0, r0, w1, y1, r1, w2, y2, r2);
    const int t = blockIdx.y, lane = threadIdx.x % WARP;
    int first, part;
    mvf_first(m.block, s, first, part);
    using D = GroupDot<T_F32>;
    const int groups = rows / D::G, g0 = part * WARP + lane, gs = s.parts * WARP;
    // Block-uniform (every warp of the block takes the same path through its barriers).
    const bool pre = early != 0 && s.rows == 1 && rows % D::G == 0 && RNR_EARLY * gs >= groups;
    if (early == 2 && pre && blockIdx.x >= gridDim.x - slices) {
        // Direct form: the last `slices` blocks write res_norm_q8's slices, the others only rows.
        prefetch_l1_block(nw, (size_t)rows * 4);
        pdl_enter();
        res_norm_write(y, rows, nw, yn, eps, xq, blockIdx.x - (gridDim.x - slices), slices);
        return;
    }
    float4 wr[RNR_EARLY];
    if (pre) {
#pragma unroll
        for (int it = 0; it < RNR_EARLY; ++it) {
            const int gi = g0 + it * gs;
            wr[it] = first < m.rows && gi < groups
                         ? D::load4(m.w + (size_t)first * row_bytes<T_F32>(rows) + (size_t)gi * D::G * T_F32::BB)
                         : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    } else {
        mvf_prefetch<T_F32>(m.w, rows, m.rows, first, part, s);
    }
    if (early == 2 && pre) {
        // Direct form (early = 2, the host launches `slices` more blocks): the lane's norm weights
        // and its groups of y beside the block's sum of squares, yn at its groups as res_norm_q8
        // computes it ((y · inv) · nw), no staging and no barrier before the rows.
        float4 nwv[RNR_EARLY], yv[RNR_EARLY];
#pragma unroll
        for (int it = 0; it < RNR_EARLY; ++it) {
            const int gi = g0 + it * gs;
            nwv[it] = gi < groups ? D::load4((const u8*)(nw + (size_t)gi * D::G)) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
        pdl_enter();  // y comes from the kernel before
#pragma unroll
        for (int it = 0; it < RNR_EARLY; ++it) {
            const int gi = g0 + it * gs;
            const float* yg = y + (size_t)t * rows + (size_t)gi * D::G;
            yv[it] = gi >= groups ? make_float4(0.0f, 0.0f, 0.0f, 0.0f)
                     : ((size_t)yg & 15) == 0 ? __ldcg((const float4*)yg)
                                              : make_float4(ld_cg(yg), ld_cg(yg + 1), ld_cg(yg + 2), ld_cg(yg + 3));
        }
        const float inv = res_norm_write_t<false, false>(y, rows, nw, yn, eps, xq, 0, 1, nullptr);
        float acc = 0.0f;
#pragma unroll
        for (int it = 0; it < RNR_EARLY; ++it) {
            const int gi = g0 + it * gs;
            const float4 u = make_float4(yv[it].x * inv * nwv[it].x, yv[it].y * inv * nwv[it].y,
                                         yv[it].z * inv * nwv[it].z, yv[it].w * inv * nwv[it].w);
            if (gi < groups) acc += D::dot4(wr[it], u);
        }
        rnr_row_out(acc, red, s, first, part, m, t);
        return;
    }
    prefetch_l1_block(nw, (size_t)rows * 4);
    pdl_enter();  // y comes from the kernel before
    res_norm_write_t<true>(y, rows, nw, yn, eps, xq, blockIdx.x, slices, xs);
    __syncthreads();
    if (!pre) {
        mvf_rows<T_F32, true>(m.w, xs, rows, m.rows, first, part, s, m.y + (size_t)t * m.rows, 1.0f, false);
        return;
    }
    // mvf_rows_dot<T_F32, 1> on the preloaded weights: row_partial's groups and expression, the
    // warp sum, the slices added in order.
    float acc = 0.0f;
#pragma unroll
    for (int it = 0; it < RNR_EARLY; ++it) {
        const int gi = g0 + it * gs;
        if (gi < groups) acc += D::dot4(wr[it], D::load4((const u8*)(xs + (size_t)gi * D::G)));
    }
    rnr_row_out(acc, red, s, first, part, m, t);
}

// ----- 8-bit activations for the Q4_K decode matvecs (REDLITE_CUDA_Q8) -----
// The block stages its input row as in matvec_norm3 (x * nw, the 1 / rms scale applied to the
// sums), but quantised per 32 values to int8 with one f32 scale: d = max|v| / 127, q = rint(v / d)
// (d = 0: all q = 0), plus the sum of each 16 quants. A Q4_K unit (32 weights: 16 quant bytes,
// low nibbles of sub-block 2c, high nibbles of 2c + 1) then costs 8 dp4a instead of 64 FMAs, and
// its value is d8_lo (ds0 Σ q4 q8 - dm0 Σ q8) + d8_hi (ds1 Σ q4 q8 - dm1 Σ q8): the integer sums
// are exact, so a unit's value does not depend on the order of its products, and the unit
// values are added in a fixed order per lane. The token-tile form decodes each unit once and
// repeats exactly these operations per token: its outputs equal the one-token kernel's bit for bit.

struct Q8Row {
    const i8* q;
    const float* d;
    const int* s16;
};

__device__ __forceinline__ Q8Row q8_row(u8* base, int cols) {
    return Q8Row{(const i8*)base, (const float*)(base + cols), (const int*)(base + cols + cols / 32 * 4)};
}

// stage_normed_q8 with up to 8 of a warp's blocks loaded before their quantisation (1) or one
// block at a time (0); the same values either way.
#ifndef STAGE_ILP
#define STAGE_ILP 1
#endif

// One block of 32 values quantised by a warp (lane l holds value l): d = max|u| / 127, q = rint(u / d)
// (d = 0: q = 0), the sum of each 16 quants; q[l], d[0] and s16[0..2) written (any memory space).
__device__ __forceinline__ void q8_block32(float u, int lane, i8* __restrict__ q, float* __restrict__ d,
                                           int* __restrict__ s16) {
    const float db = warp_max(fabsf(u)) / 127.0f;
    const float id = db > 0.0f ? 1.0f / db : 0.0f;
    const int qi = __float2int_rn(__fmul_rn(u, id));
    q[lane] = (i8)qi;
    int sum = qi;
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) *d = db;
    if ((lane & 15) == 0) s16[lane / 16] = sum;
}

// Stages x * nw (nw null: x) of n values (a multiple of 32) as a q8 row at `base`; returns
// 1 / rms(x) (nw null: 1). Warp w quantises the 32-value blocks w, w + 8, ...; ends with a barrier.
// With slices > 1 only the q8 blocks b with (b / warps) % slices == slice are written (the sum of
// squares, and so the returned 1 / rms, is the whole row's in every case).
__device__ __forceinline__ float stage_normed_q8(const float* __restrict__ x, const float* __restrict__ nw,
                                                 float eps, int n, u8* base, int slice = 0, int slices = 1) {
    __shared__ float part_ss[MVF_WARPS];
    i8* q = (i8*)base;
    float* d = (float*)(base + n);
    int* s16 = (int*)(base + n + n / 32 * 4);
    const int lane = threadIdx.x % WARP, wi = threadIdx.x / WARP, nwarps = blockDim.x / WARP;
    float ss = 0.0f;
#if STAGE_ILP
    // Up to 8 of the warp's blocks at a time: their loads in flight together, then the
    // quantisations (independent shuffle chains); ss in block order as one block at a time.
    for (int b0 = wi; b0 < n / 32; b0 += 8 * nwarps) {
        float v[8], u[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int b = b0 + j * nwarps;
            v[j] = b < n / 32 ? x[32 * b + lane] : 0.0f;
            u[j] = b < n / 32 && nw != nullptr ? nw[32 * b + lane] : 1.0f;
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int b = b0 + j * nwarps;
            if (b < n / 32) {
                ss = __fmaf_rn(v[j], v[j], ss);
                const float w = nw == nullptr ? v[j] : __fmul_rn(v[j], u[j]);
                if ((b / nwarps) % slices == slice) q8_block32(w, lane, q + 32 * b, d + b, s16 + 2 * b);
            }
        }
    }
#else
    for (int b = wi; b < n / 32; b += nwarps) {
        const float v = x[32 * b + lane];
        ss = __fmaf_rn(v, v, ss);
        const float u = nw == nullptr ? v : __fmul_rn(v, nw[32 * b + lane]);
        if ((b / nwarps) % slices == slice) q8_block32(u, lane, q + 32 * b, d + b, s16 + 2 * b);
    }
#endif
    ss = warp_sum(ss);
    if (lane == 0) part_ss[wi] = ss;
    __syncthreads();
    if (nw == nullptr) return 1.0f;
    float tot = 0.0f;
    for (int w = 0; w < MVF_WARPS; ++w) tot += part_ss[w];
    return 1.0f / sqrtf(tot / (float)n + eps);
}

__device__ __forceinline__ int dp4a(u32 a, int b, int c) {
    int r;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

// One Q4_K unit (g = 0..7 of its block: c = g / 2, h = g % 2) decoded: the two sub-blocks' scale
// and min, the nibbles as bytes.
struct Q4kUnit {
    float ds0, dm0, ds1, dm1;
    u32 lo[4], hi[4];
    int at;  // the unit's low values start at value `at` of the block (its high ones at + 32)
};

__device__ __forceinline__ Q4kUnit q4k_unit(const uint4 hd, const uint4 qv, int g) {
    const int c = g >> 1, h = g & 1;
    const u32 sc_w = c < 2 ? (hd.y & 0x3F3F3F3Fu) : ((hd.w & 0x0F0F0F0Fu) | ((hd.y >> 2) & 0x30303030u));
    const u32 m_w = c < 2 ? (hd.z & 0x3F3F3F3Fu) : (((hd.w >> 4) & 0x0F0F0F0Fu) | ((hd.z >> 2) & 0x30303030u));
    const int b0 = (2 * c) & 3;
    const float d = f16_to_f32((u16)(hd.x & 0xffff)), dmin = f16_to_f32((u16)(hd.x >> 16));
    Q4kUnit u;
    u.ds0 = d * byte_f32(sc_w, b0);
    u.dm0 = dmin * byte_f32(m_w, b0);
    u.ds1 = d * byte_f32(sc_w, b0 + 1);
    u.dm1 = dmin * byte_f32(m_w, b0 + 1);
    const u32 v[4] = {qv.x, qv.y, qv.z, qv.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        u.lo[k] = v[k] & 0x0F0F0F0Fu;
        u.hi[k] = (v[k] >> 4) & 0x0F0F0F0Fu;
    }
    u.at = 64 * c + 16 * h;
    return u;
}

// A q8 row's values under a unit of block `ib` (the same for every row at that column): its low
// and high 16 quants, their sums of 16 and the two blocks' scales.
struct Q8UnitX {
    int4 a, e;
    float s_lo, s_hi, d_lo, d_hi;
};

__device__ __forceinline__ Q8UnitX q8_unit_x(const Q8Row& x, int ib, int at) {
    const int lo = 256 * ib + at, hi = lo + 32;
    Q8UnitX v;
    v.a = *(const int4*)(x.q + lo);
    v.e = *(const int4*)(x.q + hi);
    v.s_lo = (float)x.s16[lo / 16];
    v.s_hi = (float)x.s16[hi / 16];
    v.d_lo = x.d[lo / 32];
    v.d_hi = x.d[hi / 32];
    return v;
}

// The unit's two sums of 16 quant products (low nibbles against a, high against e).
__device__ __forceinline__ int2 q4k_unit_dots(const Q4kUnit& u, const int4 a, const int4 e) {
    int sl = dp4a(u.lo[0], a.x, 0), sh = dp4a(u.hi[0], e.x, 0);
    sl = dp4a(u.lo[1], a.y, sl);
    sh = dp4a(u.hi[1], e.y, sh);
    sl = dp4a(u.lo[2], a.z, sl);
    sh = dp4a(u.hi[2], e.z, sh);
    sl = dp4a(u.lo[3], a.w, sl);
    sh = dp4a(u.hi[3], e.w, sh);
    return make_int2(sl, sh);
}

// A unit's value from its two integer sums (q4k_unit_q8v's operations after its dp4a).
__device__ __forceinline__ float q4k_sums_value(const Q4kUnit& u, int sx, int sy, const Q8UnitX& v) {
    const float vl = __fsub_rn(__fmul_rn(u.ds0, (float)sx), __fmul_rn(u.dm0, v.s_lo));
    const float vh = __fsub_rn(__fmul_rn(u.ds1, (float)sy), __fmul_rn(u.dm1, v.s_hi));
    return __fadd_rn(__fmul_rn(v.d_lo, vl), __fmul_rn(v.d_hi, vh));
}

// The unit's dot with loaded q8 values (q4k_unit_q8's operations in its order).
__device__ __forceinline__ float q4k_unit_q8v(const Q4kUnit& u, const Q8UnitX& v) {
    const int2 s = q4k_unit_dots(u, v.a, v.e);
    return q4k_sums_value(u, s.x, s.y, v);
}

// The unit's dot with block `ib` of a staged q8 row.
__device__ __forceinline__ float q4k_unit_q8(const Q4kUnit& u, const Q8Row& x, int ib) {
    const int lo = 256 * ib + u.at, hi = lo + 32;
    const int4 a = *(const int4*)(x.q + lo), e = *(const int4*)(x.q + hi);
    const int2 s = q4k_unit_dots(u, a, e);
    // Rounded operations spelled out (no contraction left to the compiler): every kernel that
    // inlines this computes the same value.
    const float vl = __fsub_rn(__fmul_rn(u.ds0, (float)s.x), __fmul_rn(u.dm0, (float)x.s16[lo / 16]));
    const float vh = __fsub_rn(__fmul_rn(u.ds1, (float)s.y), __fmul_rn(u.dm1, (float)x.s16[hi / 16]));
    return __fadd_rn(__fmul_rn(x.d[lo / 32], vl), __fmul_rn(x.d[hi / 32], vh));
}

// The start of the q8 row kernels: token t's q8 row at base + t * stride bytes, the partials 0.
template <int NR, int NT>
__device__ __forceinline__ void q8_rows_begin(u8* base, int stride, int cols, Q8Row (&xr)[NT],
                                              float (&acc)[NR][NT]) {
#pragma unroll
    for (int t = 0; t < NT; ++t) xr[t] = q8_row(base + (size_t)t * stride, cols);
#pragma unroll
    for (int r = 0; r < NR; ++r) {
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[r][t] = 0.0f;
    }
}

// The lane's partials of NR Q4_K rows (wr[r]; null: a row past the matrix, partial 0) for nt
// (<= NT) staged q8 rows (token t's at base + t * stride bytes): units part * 32 + lane,
// + parts * 32, ... in that order, Q8_UNITS per row loaded (every row's) before their arithmetic;
// each unit decoded once for all tokens. A row's partial does not depend on NR.
#ifndef Q8_UNITS
#define Q8_UNITS 2
#endif
template <int NR, int NT>
__device__ __forceinline__ void q4k_rows_q8(const u8* const (&wr)[NR], u8* base, int stride, int nt, int cols,
                                            int lane, int part, int parts, float (&acc)[NR][NT]) {
    Q8Row xr[NT];
    q8_rows_begin<NR, NT>(base, stride, cols, xr, acc);
    const int units = cols / 32, step = parts * WARP;
    int gi = part * WARP + lane;
    for (; gi + (Q8_UNITS - 1) * step < units; gi += Q8_UNITS * step) {
        uint4 hd[NR][Q8_UNITS], qv[NR][Q8_UNITS];
#pragma unroll
        for (int r = 0; r < NR; ++r) {
#pragma unroll
            for (int k = 0; k < Q8_UNITS; ++k) {
                const int g = gi + k * step;
                if (wr[r] != nullptr) {
                    const u8* b = wr[r] + (size_t)(g >> 3) * 144;
                    hd[r][k] = *(const uint4*)b;
                    qv[r][k] = *(const uint4*)(b + 16 + 16 * (g & 7));
                }
            }
        }
        if constexpr (NR > 1 && NT > 1) {
            // Each token's q8 values loaded once for the NR rows (the same column positions);
            // every row's partial in the order below (unit by unit, token by token).
#pragma unroll
            for (int k = 0; k < Q8_UNITS; ++k) {
                const int g = gi + k * step;
                Q4kUnit u[NR];
#pragma unroll
                for (int r = 0; r < NR; ++r) u[r] = q4k_unit(hd[r][k], qv[r][k], g & 7);
#pragma unroll
                for (int t = 0; t < NT; ++t) {
                    if (t >= nt) continue;
                    const Q8UnitX v = q8_unit_x(xr[t], g >> 3, u[0].at);
#pragma unroll
                    for (int r = 0; r < NR; ++r) {
                        if (wr[r] != nullptr) acc[r][t] = __fadd_rn(acc[r][t], q4k_unit_q8v(u[r], v));
                    }
                }
            }
        } else {
#pragma unroll
            for (int r = 0; r < NR; ++r) {
                if (wr[r] == nullptr) continue;
#pragma unroll
                for (int k = 0; k < Q8_UNITS; ++k) {
                    const int g = gi + k * step;
                    const Q4kUnit u = q4k_unit(hd[r][k], qv[r][k], g & 7);
#pragma unroll
                    for (int t = 0; t < NT; ++t) {
                        if (t < nt) acc[r][t] = __fadd_rn(acc[r][t], q4k_unit_q8(u, xr[t], g >> 3));
                    }
                }
            }
        }
    }
    for (; gi < units; gi += step) {
#pragma unroll
        for (int r = 0; r < NR; ++r) {
            if (wr[r] == nullptr) continue;
            const u8* b = wr[r] + (size_t)(gi >> 3) * 144;
            const Q4kUnit u = q4k_unit(*(const uint4*)b, *(const uint4*)(b + 16 + 16 * (gi & 7)), gi & 7);
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                if (t < nt) acc[r][t] = __fadd_rn(acc[r][t], q4k_unit_q8(u, xr[t], gi >> 3));
            }
        }
    }
}

// Q8X_PRE_X (compile-time, default 1; 0: a row's q8 values loaded with the row, session 30's
// kernels): the one-token q8 kernels (matvec_q8x_q4_k: decode's in-projections and the shared
// expert; matvec_q8x_q6_k: the head, see q6k_pre_x) load the lane's values of the q8 row once for
// all the warp's rows (q4k_pre_x, q4k_rows_q8_pre) instead of once a row, where every lane's units
// fit in Q8_UNITS (cols <= Q8_UNITS · 32 · parts: the 2,048-wide in-projections at one part). The
// x loads were 6 of a unit's 8 loads (L1 wavefronts, not DRAM); a row's partial is the same bits
// (its units in the same order, q4k_unit_q8v being q4k_unit_q8's operations). H200, session 31
// run 2: decode +1.6 % (404.9 against 398.4 tok/s), position 32,768 +1.6 %, full-size logits
// bit-identical; bench kernel Q4_K 12288x2048 7.37 -> 6.67 µs (45.9 -> 50.7 % of the read
// limit), 151936x2048 60.9 -> 69.1 %, Q6_K 151936x2048 60.8 -> 66.2 %. NVRTC 13.0:
// matvec_q8x_q4_k 80 registers (as before), matvec_q8x_q6_k 78 (75), no stack.
#ifndef Q8X_PRE_X
#define Q8X_PRE_X 1
#endif
__device__ __forceinline__ int q4k_unit_at(int g) { return 64 * ((g & 7) >> 1) + 16 * (g & 1); }
// The lane's units g = gi, gi + step, ... (< units, at most Q8_UNITS) of a q8 row.
__device__ __forceinline__ void q4k_pre_x(const Q8Row& xr, int units, int gi, int step, Q8UnitX (&xv)[Q8_UNITS]) {
#pragma unroll
    for (int k = 0; k < Q8_UNITS; ++k) {
        const int g = gi + k * step;
        if (g < units) xv[k] = q8_unit_x(xr, g >> 3, q4k_unit_at(g));
    }
}
// The lane's units g = gi, gi + step, ... (< units, at most Q8_UNITS) of the rows wr (null: left
// out) into hd, qv.
template <int NR>
__device__ __forceinline__ void q4k_rows_load(const u8* const (&wr)[NR], int units, int gi, int step,
                                              uint4 (&hd)[NR][Q8_UNITS], uint4 (&qv)[NR][Q8_UNITS]) {
#pragma unroll
    for (int r = 0; r < NR; ++r) {
#pragma unroll
        for (int k = 0; k < Q8_UNITS; ++k) {
            const int g = gi + k * step;
            if (wr[r] != nullptr && g < units) {
                const u8* b = wr[r] + (size_t)(g >> 3) * 144;
                hd[r][k] = *(const uint4*)b;
                qv[r][k] = *(const uint4*)(b + 16 + 16 * (g & 7));
            }
        }
    }
}
// q4k_rows_q8<NR, 1>'s partials of those units (q4k_rows_load) against x's (q4k_pre_x, same gi,
// step): each row's units in order.
template <int NR>
__device__ __forceinline__ void q4k_rows_sum(const u8* const (&wr)[NR], const uint4 (&hd)[NR][Q8_UNITS],
                                             const uint4 (&qv)[NR][Q8_UNITS], const Q8UnitX (&xv)[Q8_UNITS],
                                             int units, int gi, int step, float (&acc)[NR][1]) {
#pragma unroll
    for (int r = 0; r < NR; ++r) {
        acc[r][0] = 0.0f;
        if (wr[r] == nullptr) continue;
#pragma unroll
        for (int k = 0; k < Q8_UNITS; ++k) {
            const int g = gi + k * step;
            if (g < units) acc[r][0] = __fadd_rn(acc[r][0], q4k_unit_q8v(q4k_unit(hd[r][k], qv[r][k], g & 7), xv[k]));
        }
    }
}
// q4k_rows_q8<NR, 1>'s partials with the lane's units of x preloaded (q4k_pre_x, same gi, step).
template <int NR>
__device__ __forceinline__ void q4k_rows_q8_pre(const u8* const (&wr)[NR], const Q8UnitX (&xv)[Q8_UNITS], int units,
                                                int gi, int step, float (&acc)[NR][1]) {
    uint4 hd[NR][Q8_UNITS], qv[NR][Q8_UNITS];
    q4k_rows_load<NR>(wr, units, gi, step, hd, qv);
    q4k_rows_sum<NR>(wr, hd, qv, xv, units, gi, step, acc);
}
// Q8X_W_EARLY (compile-time, default 1 since session 37; 0: the first pair after the wait):
// matvec_q8x_q4_k (decode's in-projections and the shared expert's gate/up) loads the lane's
// units of its warp's first row pair into registers before it waits for the kernel ahead (the
// weights depend on nothing that kernel writes), and after the wait only x's units, in one batch,
// then the first pair's sums; the later pairs as q4k_rows_q8_pre. The same operations in the same
// order: the same bits. As ROUTE_W_EARLY (session 34: the router rows 3.22 -> 1.82 µs a layer).
// H200, session 37 run 2: decode +1.3 % (432.32 / 432.55 / 432.27 against 426.78 / 426.51 /
// 426.88 tok/s, every round above), position 32,768 +0.8 %, full-size logits bit-identical,
// self-test 496/496 and parity unchanged. NVRTC 13.0: 80 registers, a 16-byte stack (8 spill
// instructions; 0 without it).
#ifndef Q8X_W_EARLY
#define Q8X_W_EARLY 1
#endif
template <typename T>
struct Q8xPre {
    enum { V = 0 };
};
template <>
struct Q8xPre<T_Q4_K> {
    enum { V = Q8X_PRE_X };
};
template <>
struct Q8xPre<T_Q6_K> {
    enum { V = Q8X_PRE_X };
};

// 16 bytes at a 2-byte aligned address p as four words (aligned 4-byte loads and funnel shifts:
// Q6_K blocks are 210 bytes, so every other block of a row starts 2 bytes off a word).
__device__ __forceinline__ void ld16_a2(const u8* p, u32 (&out)[4]) {
    const size_t a = (size_t)p;
    const u32* w = (const u32*)(a & ~(size_t)3);
    const u32 sh = (u32)(a & 2) * 8;
    u32 v[5];
#pragma unroll
    for (int k = 0; k < 5; ++k) v[k] = w[k];
#pragma unroll
    for (int k = 0; k < 4; ++k) out[k] = __funnelshift_r(v[k], v[k + 1], sh);
}

// 8 bytes at a 2-byte aligned address p as two words, ld16_a2's way, except that the bytes past
// the 8 are never read: where p is 2 bytes off a word the last two come by a 2-byte load (an
// IQ2_XXS sub-block may end its tensor).
__device__ __forceinline__ void ld8_a2(const u8* p, u32& lo, u32& hi) {
    const u32 off = (u32)(size_t)p & 2u;  // 0 or 2 bytes past a word
    const u32* w = (const u32*)(p - off);
    const u32 w0 = w[0], w1 = w[1];
    const u32 w2 = off != 0 ? (u32)ld_u16(p + 6) : 0u;  // bytes 6..7 where w1 stops short
    lo = __funnelshift_r(w0, w1, 8 * off);
    hi = __funnelshift_r(w1, w2, 8 * off);
}

// A lane's part of Q6_K block `b` (its sixteenth c, h, i and scale s0, as q6k_rows_q8 says): the
// 16 low-bit bytes, the 16 high-bit bytes and the two scales d · sc.
__device__ __forceinline__ void q6k_lane_load(const u8* b, int c, int h, int i, int s0, u32 (&ql)[4], u32 (&qh)[4],
                                              float& dlo, float& dhi) {
    ld16_a2(b + 64 * c + 32 * h + 16 * i, ql);
    ld16_a2(b + 128 + 32 * c + 16 * i, qh);
    const float d = ld_f16(b + 208);
    dlo = __fmul_rn(d, (float)(i8)b[192 + s0]);
    dhi = __fmul_rn(d, (float)(i8)b[192 + s0 + 4]);
}
// Its 6-bit quants (+ 32) as bytes: the 16 low values and the 16 high ones.
__device__ __forceinline__ void q6k_lane_quants(const u32 (&ql)[4], const u32 (&qh)[4], int h, u32 (&lo)[4],
                                                u32 (&hi)[4]) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        lo[k] = (ql[k] & 0x0F0F0F0Fu) | (((qh[k] >> (2 * h)) & 0x03030303u) << 4);
        hi[k] = ((ql[k] >> 4) & 0x0F0F0F0Fu) | (((qh[k] >> (2 * h + 4)) & 0x03030303u) << 4);
    }
}
// Its value against q8 values xl, xh (sums of 16 slo, shi; scales dxlo, dxhi), the rounded
// operations spelled out.
__device__ __forceinline__ float q6k_lane_value(const u32 (&lo)[4], const u32 (&hi)[4], float dlo, float dhi,
                                                const int4 xl, const int4 xh, int slo, int shi, float dxlo,
                                                float dxhi) {
    int sl = dp4a(lo[0], xl.x, 0), sh = dp4a(hi[0], xh.x, 0);
    sl = dp4a(lo[1], xl.y, sl);
    sh = dp4a(hi[1], xh.y, sh);
    sl = dp4a(lo[2], xl.z, sl);
    sh = dp4a(hi[2], xh.z, sh);
    sl = dp4a(lo[3], xl.w, sl);
    sh = dp4a(hi[3], xh.w, sh);
    const int ilo = sl - 32 * slo, ihi = sh - 32 * shi;
    return __fadd_rn(__fmul_rn(__fmul_rn(dlo, dxlo), (float)ilo), __fmul_rn(__fmul_rn(dhi, dxhi), (float)ihi));
}

// The lane's partials of NR Q6_K rows against nt staged q8 rows, as q4k_rows_q8 (same contract).
// A warp takes four blocks per iteration (blocks 4 part + l / 8, + 4 parts, ...), lane l's eighth
// s = l % 8 of a block being 32 values: the 16 values v0 .. v0 + 15 (low nibbles of ql bytes
// 64c + 32h + 16i .., scale 8c + 2h + i, c = s / 4, h = s / 2 % 2, i = s % 2, v0 = 128c + 32h + 16i)
// and v0 + 64 .. v0 + 79 (their high nibbles, scale + 4), the two high bits from qh bytes
// 32c + 16i .. (bits 2h, 2h + 4). Σ (q - 32) x8 = Σ q x8 - 32 Σ x8 exactly, Σ x8 of each 16 from
// the q8 row's sums; then d8_lo (d sc_lo) i_lo + d8_hi (d sc_hi) i_hi with the rounded operations
// spelled out. Sixteen values a scale per lane: 13 loads per 32 values (session 10's layout, a
// lane's 8 values of a block by 2-byte loads, took 28; the lm_head ran at 1,189 against 1,990 GB/s).
template <int NR, int NT>
__device__ __forceinline__ void q6k_rows_q8(const u8* const (&wr)[NR], u8* base, int stride, int nt, int cols,
                                            int lane, int part, int parts, float (&acc)[NR][NT]) {
    Q8Row xr[NT];
    q8_rows_begin<NR, NT>(base, stride, cols, xr, acc);
    const int sub = lane & 7, bo = lane >> 3;
    const int c = sub >> 2, h = (sub >> 1) & 1, i = sub & 1;
    const int s0 = 8 * c + 2 * h + i, v0 = 128 * c + 32 * h + 16 * i;
    const int nb = cols / 256;
    for (int ib = 4 * part + bo; ib < nb; ib += 4 * parts) {
        u32 ql[NR][4], qh[NR][4];
        float dlo[NR], dhi[NR];
#pragma unroll
        for (int r = 0; r < NR; ++r) {
            if (wr[r] != nullptr) q6k_lane_load(wr[r] + (size_t)ib * 210, c, h, i, s0, ql[r], qh[r], dlo[r], dhi[r]);
        }
#pragma unroll
        for (int r = 0; r < NR; ++r) {
            if (wr[r] == nullptr) continue;
            u32 lo[4], hi[4];
            q6k_lane_quants(ql[r], qh[r], h, lo, hi);
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                if (t >= nt) continue;
                const int at = 256 * ib + v0;
                const int4 xl = *(const int4*)(xr[t].q + at), xh = *(const int4*)(xr[t].q + at + 64);
                const float v = q6k_lane_value(lo, hi, dlo[r], dhi[r], xl, xh, xr[t].s16[at / 16],
                                               xr[t].s16[(at + 64) / 16], xr[t].d[at / 32], xr[t].d[(at + 64) / 32]);
                acc[r][t] = __fadd_rn(acc[r][t], v);
            }
        }
    }
}

// Q8X_PRE_X for Q6_K (the lm_head): a lane's q8 values of each block it takes (q6k_rows_q8's
// xl, xh, the two sums of 16 and the two scales), loaded once for all the warp's rows where a
// row's blocks take at most Q6_PRE_IT iterations (cols <= Q6_PRE_IT · 1,024 · parts).
#define Q6_PRE_IT 2
struct Q6kX {
    int4 xl, xh;
    int slo, shi;
    float dlo, dhi;
};
__device__ __forceinline__ void q6k_pre_x(const Q8Row& xr, int nb, int lane, int part, int parts,
                                          Q6kX (&xv)[Q6_PRE_IT]) {
    const int sub = lane & 7, bo = lane >> 3;
    const int v0 = 128 * (sub >> 2) + 32 * ((sub >> 1) & 1) + 16 * (sub & 1);
#pragma unroll
    for (int k = 0; k < Q6_PRE_IT; ++k) {
        const int ib = 4 * part + bo + k * 4 * parts;
        if (ib < nb) {
            const int at = 256 * ib + v0;
            xv[k].xl = *(const int4*)(xr.q + at);
            xv[k].xh = *(const int4*)(xr.q + at + 64);
            xv[k].slo = xr.s16[at / 16];
            xv[k].shi = xr.s16[(at + 64) / 16];
            xv[k].dlo = xr.d[at / 32];
            xv[k].dhi = xr.d[(at + 64) / 32];
        }
    }
}
// q6k_rows_q8<NR, 1>'s partials with the lane's q8 values preloaded (q6k_pre_x): the same
// operations in the same order.
template <int NR>
__device__ __forceinline__ void q6k_rows_q8_pre(const u8* const (&wr)[NR], const Q6kX (&xv)[Q6_PRE_IT], int nb,
                                                int lane, int part, int parts, float (&acc)[NR][1]) {
    const int sub = lane & 7, bo = lane >> 3;
    const int c = sub >> 2, h = (sub >> 1) & 1, i = sub & 1;
    const int s0 = 8 * c + 2 * h + i;
#pragma unroll
    for (int r = 0; r < NR; ++r) acc[r][0] = 0.0f;
#pragma unroll
    for (int k = 0; k < Q6_PRE_IT; ++k) {
        const int ib = 4 * part + bo + k * 4 * parts;
        if (ib >= nb) break;
        u32 ql[NR][4], qh[NR][4];
        float dlo[NR], dhi[NR];
#pragma unroll
        for (int r = 0; r < NR; ++r) {
            if (wr[r] != nullptr) q6k_lane_load(wr[r] + (size_t)ib * 210, c, h, i, s0, ql[r], qh[r], dlo[r], dhi[r]);
        }
#pragma unroll
        for (int r = 0; r < NR; ++r) {
            if (wr[r] == nullptr) continue;
            u32 lo[4], hi[4];
            q6k_lane_quants(ql[r], qh[r], h, lo, hi);
            const Q6kX& x = xv[k];
            const float v = q6k_lane_value(lo, hi, dlo[r], dhi[r], x.xl, x.xh, x.slo, x.shi, x.dlo, x.dhi);
            acc[r][0] = __fadd_rn(acc[r][0], v);
        }
    }
}

// The q8 rows function of weight type T (Q4_K or Q6_K).
template <typename T>
struct IsQ6k {
    static constexpr bool value = false;
};
template <>
struct IsQ6k<T_Q6_K> {
    static constexpr bool value = true;
};
template <typename T, int NR, int NT>
__device__ __forceinline__ void rows_q8(const u8* const (&wr)[NR], u8* base, int stride, int nt, int cols, int lane,
                                        int part, int parts, float (&acc)[NR][NT]) {
    if constexpr (IsQ6k<T>::value) {
        q6k_rows_q8<NR, NT>(wr, base, stride, nt, cols, lane, part, parts, acc);
    } else {
        q4k_rows_q8<NR, NT>(wr, base, stride, nt, cols, lane, part, parts, acc);
    }
}

// matvec_norm3_q8_q4_k(x, nw, eps, cols, split, w0, y0, rows0, w1, y1, rows1, w2, y2, rows2):
// matvec_norm3_q4_k through the q8 row (one row per group of `parts` warps). Launch: as
// matvec_norm3 with one row per warp group, dynamic shared memory = Q8_ROW_BYTES(cols).
// matvec_norm3_tok_q8_q4_k(..., split, n, ...): the same for n tokens, `tile` (split >> 16) per
// block, dynamic shared memory = tile * Q8_ROW_BYTES(cols); every output is the one-token
// kernel's bit for bit.
// The warp group's rows (first .. first + s.rows - 1, those < rows) against the staged q8 rows of
// tokens t0 .. t0 + nt - 1, NR rows at a time (2 for one token): y[t][row] = invs[t] * dot, or
// with ADD y[t][row] += dot (invs unused). Every thread of the block calls it (barriers when
// s.parts > 1).
// Q8X_TOK_NR (default 2, session 28): rows a warp walks together in the token-tile kernels
// (NT > 1), each token's q8 values loaded once for them (the same positions); a row's partial
// does not depend on it. H200, full-size verify: 8 rows 8.49 against 8.82 ms with 1 (-3.7 %).
#ifndef Q8X_TOK_NR
#define Q8X_TOK_NR 2
#endif
// Q8X_TOK_NR_Q6K (default 1, session 30): the same for Q6_K (the verify's lm_head, 151,936 rows):
// NVRTC 13.0 gives matvec_q8x_tok_q6_k 113 registers at 1 (two 256-thread blocks an SM), 172 at
// 2 (one). H200, full-size verify 2 / 4 / 8 / 16 rows: −3.3 / −2.8 / −1.5 / −2.2 % against 2.
#ifndef Q8X_TOK_NR_Q6K
#define Q8X_TOK_NR_Q6K 1
#endif
template <typename T>
struct Q8xTokNr {
    enum { V = Q8X_TOK_NR };
};
template <>
struct Q8xTokNr<T_Q6_K> {
    enum { V = Q8X_TOK_NR_Q6K };
};
// q8_rows_out's walk over the warp group's rows, NR at a time, with `partials(wr, acc)` filling
// the lane's partials of those rows (acc[NR][NT]).
template <typename T, int NT, bool ADD, int NR, typename Partials>
__device__ __forceinline__ void q8_rows_walk(float* __restrict__ y, int rows, MvfSplit s, int first, int part,
                                             const u8* __restrict__ w, int cols, int t0, int nt, const float* invs,
                                             Partials partials) {
    __shared__ float red[NR][NT][MVF_WARPS];
    const int wi = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const size_t rb = row_bytes<T>(cols);
    for (int r = 0; r < s.rows; r += NR) {
        const u8* wr[NR];
#pragma unroll
        for (int k = 0; k < NR; ++k) {
            const int row = first + r + k;
            wr[k] = (r + k < s.rows && row < rows) ? w + (size_t)row * rb : nullptr;
        }
        float acc[NR][NT];
        partials(wr, acc);
        if (s.parts == 1) {
            // The warp holds whole rows.
#pragma unroll
            for (int k = 0; k < NR; ++k) {
#pragma unroll
                for (int t = 0; t < NT; ++t) {
                    const float v = warp_sum(acc[k][t]);
                    if (lane == 0 && wr[k] != nullptr && t < nt) {
                        float* out = y + (size_t)(t0 + t) * rows + first + r + k;
                        *out = ADD ? *out + v : invs[t] * v;
                    }
                }
            }
            continue;
        }
#pragma unroll
        for (int k = 0; k < NR; ++k) {
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                const float v = warp_sum(acc[k][t]);
                if (lane == 0) red[k][t][wi] = v;
            }
        }
        __syncthreads();
        if (part == 0 && lane == 0) {
#pragma unroll
            for (int k = 0; k < NR; ++k) {
                if (wr[k] == nullptr) continue;
                for (int t = 0; t < nt; ++t) {
                    float sum = 0.0f;
                    for (int p = 0; p < s.parts; ++p) sum += red[k][t][wi + p];
                    float* out = y + (size_t)(t0 + t) * rows + first + r + k;
                    *out = ADD ? *out + sum : invs[t] * sum;
                }
            }
        }
        __syncthreads();  // red is reused by the next rows
    }
}

template <typename T, int NT, bool ADD>
__device__ __forceinline__ void q8_rows_out(const u8* __restrict__ w, float* __restrict__ y, int rows, int cols,
                                            MvfSplit s, int first, int part, u8* base, int stride, int t0, int nt,
                                            const float* invs) {
    const int lane = threadIdx.x % WARP;
    // Rows a warp walks together: two for one token (four loads a lane in flight), Q8xTokNr for a
    // token tile.
    constexpr int NR = NT == 1 ? 2 : Q8xTokNr<T>::V;
    if constexpr (NT == 1 && Q8xPre<T>::V != 0 && IsQ6k<T>::value) {
        // Q8X_PRE_X (Q6_K): the lane's q8 values of its blocks loaded once for all the rows.
        const int nb = cols / 256;
        if (nb <= Q6_PRE_IT * 4 * s.parts) {
            Q6kX xv[Q6_PRE_IT];
            q6k_pre_x(q8_row(base, cols), nb, lane, part, s.parts, xv);
            q8_rows_walk<T, NT, ADD, NR>(y, rows, s, first, part, w, cols, t0, nt, invs,
                                         [&](const u8* const(&wr)[NR], float(&acc)[NR][NT]) {
                                             q6k_rows_q8_pre<NR>(wr, xv, nb, lane, part, s.parts, acc);
                                         });
            return;
        }
    } else if constexpr (NT == 1 && Q8xPre<T>::V != 0) {
        // Q8X_PRE_X: the lane's units of the one q8 row loaded once for all the rows.
        const int units = cols / 32, step = s.parts * WARP, gi = part * WARP + lane;
        if (units <= Q8_UNITS * step) {
            Q8UnitX xv[Q8_UNITS];
            q4k_pre_x(q8_row(base, cols), units, gi, step, xv);
            q8_rows_walk<T, NT, ADD, NR>(y, rows, s, first, part, w, cols, t0, nt, invs,
                                         [&](const u8* const(&wr)[NR], float(&acc)[NR][NT]) {
                                             q4k_rows_q8_pre<NR>(wr, xv, units, gi, step, acc);
                                         });
            return;
        }
    }
    q8_rows_walk<T, NT, ADD, NR>(y, rows, s, first, part, w, cols, t0, nt, invs,
                                 [&](const u8* const(&wr)[NR], float(&acc)[NR][NT]) {
                                     rows_q8<T, NR, NT>(wr, base, stride, nt, cols, lane, part, s.parts, acc);
                                 });
}

// Rows per warp group: split >> 8 (1 .. Q8_MAX_ROWS), walked two at a time by the one-token
// kernel (four loads per lane in flight) and one at a time by the token-tile kernel. Many rows per
// block spread the staging of x over more weights, and with few enough blocks to be resident at
// once every block prefetches all its rows into L2 before it waits for the kernel ahead.
#define Q8_MAX_ROWS 16
// The split of the 8-bit kernels: parts = split & 255, rows per warp group (split >> 8) & 255,
// clamped to 1 .. Q8_MAX_ROWS.
__device__ __forceinline__ MvfSplit q8_split(int split) {
    MvfSplit s;
    s.parts = split & 255;
    s.rows = min(max((split >> 8) & 255, 1), Q8_MAX_ROWS);
    return s;
}
template <typename T, int NT>
__device__ __forceinline__ void matvec_norm3_q8_body(const float* __restrict__ x, const float* __restrict__ nw,
                                                     float eps, int cols, int split, int n, const u8* w0,
                                                     float* y0, int r0, const u8* w1, float* y1, int r1,
                                                     const u8* w2, float* y2, int r2) {
    extern __shared__ float4 mvf_x4[];
    u8* base = (u8*)mvf_x4;
    __shared__ float invs[NT];
    const MvfSplit s = q8_split(split);
    const int tile = NT == 1 ? 1 : min(max((split >> 16) & 255, 1), NT);
    const MvfMatrix m = mvf_matrix(blockIdx.x, mvf_rows_per_block(s), w0, y0, r0, w1, y1, r1, w2, y2, r2);
    const int rows = m.rows;
    const int t0 = blockIdx.y * tile, nt = min(tile, n - t0);
    const int stride = Q8_ROW_BYTES(cols);
    int first, part;
    mvf_first(m.block, s, first, part);
    if (blockIdx.y == 0) mvf_prefetch<T>(m.w, cols, rows, first, part, s);
    pdl_enter();  // x comes from the kernel before
    for (int t = 0; t < nt; ++t) {
        const float inv = stage_normed_q8(x + (size_t)(t0 + t) * cols, nw, eps, cols, base + (size_t)t * stride);
        if (threadIdx.x == 0) invs[t] = inv;
        __syncthreads();  // part_ss is reused by the next token
    }
    q8_rows_out<T, NT, false>(m.w, m.y, rows, cols, s, first, part, base, stride, t0, nt, invs);
}

extern "C" __global__ __launch_bounds__(32 * MVF_WARPS) void matvec_norm3_q8_q4_k(
    const float* x, const float* nw, float eps, int cols, int split, const u8* w0, float* y0, int r0, const u8* w1,
    float* y1, int r1, const u8* w2, float* y2, int r2) {
    matvec_norm3_q8_body<T_Q4_K, 1>(x, nw, eps, cols, split, gridDim.y, w0, y0, r0, w1, y1, r1, w2, y2, r2);
}

extern "C" __global__ __launch_bounds__(32 * MVF_WARPS) void matvec_norm3_tok_q8_q4_k(
    const float* x, const float* nw, float eps, int cols, int split, int n, const u8* w0, float* y0, int r0,
    const u8* w1, float* y1, int r1, const u8* w2, float* y2, int r2) {
    matvec_norm3_q8_body<T_Q4_K, MVF_MAX_TILE>(x, nw, eps, cols, split, n, w0, y0, r0, w1, y1, r1, w2, y2, r2);
}

// The same two for Q6_K matrices (q6k_rows_q8; REDLITE_CUDA_Q8_Q6K).
extern "C" __global__ __launch_bounds__(32 * MVF_WARPS) void matvec_norm3_q8_q6_k(
    const float* x, const float* nw, float eps, int cols, int split, const u8* w0, float* y0, int r0, const u8* w1,
    float* y1, int r1, const u8* w2, float* y2, int r2) {
    matvec_norm3_q8_body<T_Q6_K, 1>(x, nw, eps, cols, split, gridDim.y, w0, y0, r0, w1, y1, r1, w2, y2, r2);
}

extern "C" __global__ __launch_bounds__(32 * MVF_WARPS) void matvec_norm3_tok_q8_q6_k(
    const float* x, const float* nw, float eps, int cols, int split, int n, const u8* w0, float* y0, int r0,
    const u8* w1, float* y1, int r1, const u8* w2, float* y2, int r2) {
    matvec_norm3_q8_body<T_Q6_K, MVF_MAX_TILE>(x, nw, eps, cols, split, n, w0, y0, r0, w1, y1, r1, w2, y2, r2);
}

// matvec_q8x_q4_k(xq, invs, cols, split, w0, y0, rows0, w1, y1, rows1, w2, y2, rows2):
// matvec_norm3_q8_q4_k on a q8 row a producer wrote (token t's at xq + t * Q8_ROW_BYTES(cols), read
// in place: no staging, no barrier before the rows): y_m[t] = invs[t] * (W_m . xq[t]) (invs null:
// 1), the same values as matvec_norm3_q8_q4_k (and its token tiles) on the f32 row those quants
// (and that 1 / rms) came from.
// Launch: as matvec_norm3_q8_q4_k (grid.y = tokens), no dynamic shared memory.
template <typename T>
__device__ __forceinline__ void matvec_q8x_body(const u8* xq, const float* invs, int cols, int split, const u8* w0,
                                                float* y0, int r0, const u8* w1, float* y1, int r1, const u8* w2,
                                                float* y2, int r2) {
    long long tt = trace_start(9);
    const MvfSplit s = q8_split(split);
    const MvfMatrix m = mvf_matrix(blockIdx.x, mvf_rows_per_block(s), w0, y0, r0, w1, y1, r1, w2, y2, r2);
    const int t = blockIdx.y;
    int first, part;
    mvf_first(m.block, s, first, part);
    if (t == 0) mvf_prefetch<T>(m.w, cols, m.rows, first, part, s);
#if Q8X_W_EARLY
    if constexpr (Q8xPre<T>::V != 0 && !IsQ6k<T>::value) {
        const int lane = threadIdx.x % WARP;
        const int units = cols / 32, step = s.parts * WARP, gi = part * WARP + lane;
        if (units <= Q8_UNITS * step) {
            // The first row pair's units before the wait (the walk's first rows: first, first + 1).
            constexpr int NR = 2;
            const size_t rb = row_bytes<T>(cols);
            const u8* w0r[NR];
#pragma unroll
            for (int k = 0; k < NR; ++k) {
                const int row = first + k;
                w0r[k] = (k < s.rows && row < m.rows) ? m.w + (size_t)row * rb : nullptr;
            }
            uint4 hd0[NR][Q8_UNITS], qv0[NR][Q8_UNITS];
            q4k_rows_load<NR>(w0r, units, gi, step, hd0, qv0);
            pdl_enter();  // xq comes from the kernel before
            tt = trace_phase(10, tt);
            const float inv[1] = {invs == nullptr ? 1.0f : invs[t]};
            Q8UnitX xv[Q8_UNITS];
            q4k_pre_x(q8_row((u8*)xq + (size_t)t * Q8_ROW_BYTES(cols), cols), units, gi, step, xv);
            bool early = true;
            q8_rows_walk<T, 1, false, NR>(m.y, m.rows, s, first, part, m.w, cols, t, 1, inv,
                                          [&](const u8* const(&wr)[NR], float(&acc)[NR][1]) {
                                              if (early) {
                                                  early = false;
                                                  q4k_rows_sum<NR>(wr, hd0, qv0, xv, units, gi, step, acc);
                                              } else {
                                                  q4k_rows_q8_pre<NR>(wr, xv, units, gi, step, acc);
                                              }
                                          });
            trace_phase(11, tt);
            return;
        }
    }
#endif
    pdl_enter();  // xq comes from the kernel before
    tt = trace_phase(10, tt);
    const float inv[1] = {invs == nullptr ? 1.0f : invs[t]};
    q8_rows_out<T, 1, false>(m.w, m.y, m.rows, cols, s, first, part, (u8*)xq + (size_t)t * Q8_ROW_BYTES(cols), 0,
                             t, 1, inv);
    trace_phase(11, tt);
}

extern "C" __global__ __launch_bounds__(32 * MVF_WARPS, Q8X_MIN_BLOCKS) void matvec_q8x_q4_k(
    const u8* xq, const float* invs, int cols, int split, const u8* w0, float* y0, int r0, const u8* w1, float* y1,
    int r1, const u8* w2, float* y2, int r2) {
    matvec_q8x_body<T_Q4_K>(xq, invs, cols, split, w0, y0, r0, w1, y1, r1, w2, y2, r2);
}

// matvec_q8x_q6_k: the same for Q6_K matrices (REDLITE_CUDA_Q8_Q6K; the lm_head).
extern "C" __global__ __launch_bounds__(32 * MVF_WARPS, Q8X_MIN_BLOCKS) void matvec_q8x_q6_k(
    const u8* xq, const float* invs, int cols, int split, const u8* w0, float* y0, int r0, const u8* w1, float* y1,
    int r1, const u8* w2, float* y2, int r2) {
    matvec_q8x_body<T_Q6_K>(xq, invs, cols, split, w0, y0, r0, w1, y1, r1, w2, y2, r2);
}

// matvec_q8x_tok_<type>(xq, invs, cols, split, n, w0, y0, rows0, ...): matvec_q8x for n tokens with
// the weights read and decoded once per tile of tile = split >> 16 tokens (up to Q8X_MAX_TILE), the
// q8 rows read in place as matvec_q8x reads them (no staging, no shared memory): each warp walks
// its rows one at a time and applies every decoded unit to each token of the tile with the
// one-token kernel's operations in its order, so every output is matvec_q8x's bit for bit (the
// speculative verify rows; the token-tile matvec_norm3_tok_q8 staged the tile's norms in every
// block instead). Launch: grid = (as matvec_q8x, ceil(n / tile)), no dynamic shared memory.
#define Q8X_MAX_TILE 8
template <typename T>
__device__ __forceinline__ void matvec_q8x_tok_body(const u8* xq, const float* invs, int cols, int split, int n,
                                                    const u8* w0, float* y0, int r0, const u8* w1, float* y1,
                                                    int r1, const u8* w2, float* y2, int r2) {
    const MvfSplit s = q8_split(split);
    const int tile = min(max((split >> 16) & 255, 1), Q8X_MAX_TILE);
    const MvfMatrix m = mvf_matrix(blockIdx.x, mvf_rows_per_block(s), w0, y0, r0, w1, y1, r1, w2, y2, r2);
    const int t0 = blockIdx.y * tile, nt = min(tile, n - t0);
    int first, part;
    mvf_first(m.block, s, first, part);
    if (blockIdx.y == 0) mvf_prefetch<T>(m.w, cols, m.rows, first, part, s);
    pdl_enter();  // xq comes from the kernel before
    float inv[Q8X_MAX_TILE];
#pragma unroll
    for (int t = 0; t < Q8X_MAX_TILE; ++t) inv[t] = (invs == nullptr || t >= nt) ? 1.0f : invs[t0 + t];
    const int stride = Q8_ROW_BYTES(cols);
    q8_rows_out<T, Q8X_MAX_TILE, false>(m.w, m.y, m.rows, cols, s, first, part, (u8*)xq + (size_t)t0 * stride,
                                        stride, t0, nt, inv);
}

// matvec_q8x_xr_q6_k(xq, invs, cols, split, n, w0, y0, rows0, ...): matvec_q8x_tok_q6_k (the
// verify's lm_head) for rows cut in one slice (parts = 1; the host takes the token tiles
// otherwise) with each token's q8 values in registers: 16 rows × 8 tokens a block, warp w the
// token quad w % 2 and the rows 4 (w / 2) .. + 3. Per block iteration a lane loads its q8 values
// of the iteration's block for its four tokens once (q6k_rows_q8's xl, xh, sums and scales) and
// takes the four rows' sixteenths of that block with them; each (row, token) sum is q6k_rows_q8's
// (the same lane values, added from 0.0f in block order), then warp_sum and y[t][row] = invs[t] *
// sum: the one-token kernel's outputs bit for bit. The token tiles load a token's q8 values again
// for every row. Launch: grid = (sum over m of ceil(rows_m / 16), ceil(n / 8)), block =
// 32 * MVF_WARPS, no dynamic shared memory.
#define XQ_ROWS 4
extern "C" __global__ __launch_bounds__(32 * MVF_WARPS, 2) void matvec_q8x_xr_q6_k(
    const u8* xq, const float* invs, int cols, int split, int n, const u8* w0, float* y0, int r0, const u8* w1,
    float* y1, int r1, const u8* w2, float* y2, int r2) {
    (void)split;
    constexpr int RPB = MVF_WARPS / 2 * XQ_ROWS;
    const MvfMatrix m = mvf_matrix(blockIdx.x, RPB, w0, y0, r0, w1, y1, r1, w2, y2, r2);
    const int wi = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int quad = wi % 2, first = m.block * RPB + (wi / 2) * XQ_ROWS;
    const size_t rb = row_bytes<T_Q6_K>(cols);
    static_assert(XR_TOKENS == 8 && MVF_WARPS == 8, "two token quads, four row groups");
    const int t0 = blockIdx.y * XR_TOKENS + 4 * quad, nt = min(max(n - t0, 0), 4);
    if (blockIdx.y == 0 && first < m.rows) {
        prefetch_l2(m.w + (size_t)first * rb, (size_t)min(XQ_ROWS, m.rows - first) * rb, lane, WARP);
    }
    pdl_enter();  // xq comes from the kernel before
    if (first >= m.rows || nt == 0) return;  // whole warps leave together; no barrier follows
    const int stride = Q8_ROW_BYTES(cols);
    // Tokens past n take the quad's first token's row, rows past the matrix its last row: their
    // sums are not written.
    Q8Row xr[4];
#pragma unroll
    for (int t = 0; t < 4; ++t) xr[t] = q8_row((u8*)xq + (size_t)(t0 + (t < nt ? t : 0)) * stride, cols);
    const u8* wr[XQ_ROWS];
#pragma unroll
    for (int r = 0; r < XQ_ROWS; ++r) wr[r] = m.w + (size_t)min(first + r, m.rows - 1) * rb;
    const int sub = lane & 7, bo = lane >> 3;
    const int c = sub >> 2, h = (sub >> 1) & 1, i = sub & 1;
    const int s0 = 8 * c + 2 * h + i, v0 = 128 * c + 32 * h + 16 * i;
    const int nb = cols / 256;
    float acc[XQ_ROWS][4];
#pragma unroll
    for (int r = 0; r < XQ_ROWS; ++r) {
#pragma unroll
        for (int t = 0; t < 4; ++t) acc[r][t] = 0.0f;
    }
    for (int ib = bo; ib < nb; ib += 4) {
        const int at = 256 * ib + v0;
        int4 xl[4], xh[4];
        int slo[4], shi[4];
        float dxl[4], dxh[4];
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            xl[t] = *(const int4*)(xr[t].q + at);
            xh[t] = *(const int4*)(xr[t].q + at + 64);
            slo[t] = xr[t].s16[at / 16];
            shi[t] = xr[t].s16[(at + 64) / 16];
            dxl[t] = xr[t].d[at / 32];
            dxh[t] = xr[t].d[(at + 64) / 32];
        }
#pragma unroll
        for (int r = 0; r < XQ_ROWS; ++r) {
            u32 ql[4], qh[4], lo[4], hi[4];
            float dlo, dhi;
            q6k_lane_load(wr[r] + (size_t)ib * 210, c, h, i, s0, ql, qh, dlo, dhi);
            q6k_lane_quants(ql, qh, h, lo, hi);
#pragma unroll
            for (int t = 0; t < 4; ++t) {
                const float v = q6k_lane_value(lo, hi, dlo, dhi, xl[t], xh[t], slo[t], shi[t], dxl[t], dxh[t]);
                acc[r][t] = __fadd_rn(acc[r][t], v);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < XQ_ROWS; ++r) {
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const float v = warp_sum(acc[r][t]);
            if (lane == 0 && first + r < m.rows && t < nt) {
                m.y[(size_t)(t0 + t) * m.rows + first + r] = (invs == nullptr ? 1.0f : invs[t0 + t]) * v;
            }
        }
    }
}

extern "C" __global__ __launch_bounds__(32 * MVF_WARPS) void matvec_q8x_tok_q4_k(
    const u8* xq, const float* invs, int cols, int split, int n, const u8* w0, float* y0, int r0, const u8* w1,
    float* y1, int r1, const u8* w2, float* y2, int r2) {
    matvec_q8x_tok_body<T_Q4_K>(xq, invs, cols, split, n, w0, y0, r0, w1, y1, r1, w2, y2, r2);
}

extern "C" __global__ __launch_bounds__(32 * MVF_WARPS) void matvec_q8x_tok_q6_k(
    const u8* xq, const float* invs, int cols, int split, int n, const u8* w0, float* y0, int r0, const u8* w1,
    float* y1, int r1, const u8* w2, float* y2, int r2) {
    matvec_q8x_tok_body<T_Q6_K>(xq, invs, cols, split, n, w0, y0, r0, w1, y1, r1, w2, y2, r2);
}

// ----- matvec_q8x_mma_q4_k: the token tiles' integer sums on the tensor cores -----
// A Q4_K unit's value (q4k_unit_q8v) takes two exact integer sums of 16 products each (its low
// nibbles against 16 quants, its high nibbles against 16 more), then a fixed sequence of rounded
// f32 operations. mma.m16n8k16 (s8 × s8 → s32) gives one such sum for 16 rows × 8 tokens at
// once, exactly (the sums are at most 16 · 15 · 128), so a block takes 16 rows of one matrix for
// the tile's 8 tokens and computes every (row, token, unit) value with q4k_unit_q8v's operations.
// What the one-token kernel adds in a fixed order, this kernel adds in the same order: lane L of
// slice p of a row sums its units p·32 + L, + parts·32, … (from 0.0f, in that order), warp_sum's
// butterfly adds the 32 lane sums (v_L + v_{L^o} for o = 16, 8, …, 1: a balanced tree over the
// lanes taken in bit-reversed order), and the slices are added in order from 0.0f (one slice: the
// warp sum itself); then y = invs[t] · sum. Here the 32 leaves of that tree, walked in
// bit-reversed order, are cut into 8 runs of 4 consecutive leaves, each a subtree, one warp
// each; a binary counter of partial sums (q8x_mma_push) adds each run's leaves in the tree's
// order and warp 0 adds the runs' roots the same way. So every output is matvec_q8x_q4_k's (and
// matvec_q8x_tok_q4_k's) bit for bit.
// Before the wait (the weights depend on nothing the kernel ahead writes) the block copies its 16
// rows into shared memory (cp.async, rows padded by 16 bytes against bank conflicts) and decodes
// each row's sub-block scales and mins once (q4k_unit's values, four floats a row, block and
// sub-block pair); after it, the tile's q8 rows (rows padded by 16 bytes), so that a lane's unit
// is two shared words of weights, two scale quads, two words of its B token's quants and its D
// tokens' q8 scales and sums, all from shared memory.
// Launch: grid = (sum over m of ceil(rows_m / 16), ceil(n / 8)), block = 32 * MVF_WARPS, dynamic
// shared memory = q8x_mma_smem(cols) bytes (over 48 KiB: the host opts the kernel in); split =
// parts as the one-token kernel's.
#define Q8X_MMA_LEAVES (WARP / MVF_WARPS)
// The two binary counters' depths below (2 levels for a warp's 4 leaves, 3 for the 8 warps' roots)
// hold for 8 warps of 32 lanes only.
static_assert(WARP == 32 && MVF_WARPS == 8, "matvec_q8x_mma_q4_k: 8 runs of 4 leaves");
// Blocks an SM the register allocation must allow (3: NVRTC 13.0 gives 80 registers, no stack;
// 103 without a bound; 4 gave 64 and a 24-byte stack and lost 1.6 % at 8 and 16 verify rows).
#ifndef Q8X_MMA_MIN_BLOCKS
#define Q8X_MMA_MIN_BLOCKS 3
#endif
// Bytes of a staged row (padded) and float4s of a row's scale quads (one a block and sub-block
// pair, plus one of padding).
__device__ __forceinline__ int q8x_mma_row_stride(int cols) { return cols / 256 * 144 + 16; }
__device__ __forceinline__ int q8x_mma_scale_stride(int cols) { return cols / 64 + 1; }

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    const u32 sa = (u32)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sa), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// D = A · B (A: 16 × 16 s8 rows, B: 16 × 8 s8 columns, D: 16 × 8 s32), the fragments of PTX's
// m16n8k16 layout: lane l holds a0 = A[l / 4][4 (l % 4) ..], a1 = A[l / 4 + 8][same],
// b = B[4 (l % 4) ..][l / 4], d = D[l / 4][2 (l % 4) + {0, 1}], D[l / 4 + 8][same].
__device__ __forceinline__ void mma_s8_16816(int (&d)[4], u32 a0, u32 a1, u32 b) {
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%7, %7, %7, %7};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a0), "r"(a1), "r"(b), "r"(0));
}

// Leaf i (0-based, in bit-reversed lane order) of a subtree into the binary counter stk: the
// partial sums of completed left subtrees per level, added left + right as warp_sum adds
// v_L + v_{L^o} (L the lower lane). After the subtree's last leaf, v holds its root.
template <int LEVELS>
__device__ __forceinline__ void q8x_mma_push(float (&stk)[LEVELS][4], float (&v)[4], int i) {
    bool open = true;
#pragma unroll
    for (int b = 0; b < LEVELS; ++b) {
        if (!open) continue;
        if ((i >> b) & 1) {
#pragma unroll
            for (int k = 0; k < 4; ++k) v[k] = __fadd_rn(stk[b][k], v[k]);
        } else {
#pragma unroll
            for (int k = 0; k < 4; ++k) stk[b][k] = v[k];
            open = false;
        }
    }
}

extern "C" __global__ __launch_bounds__(32 * MVF_WARPS, Q8X_MMA_MIN_BLOCKS) void matvec_q8x_mma_q4_k(
    const u8* xq, const float* invs, int cols, int split, int n, const u8* w0, float* y0, int r0, const u8* w1,
    float* y1, int r1, const u8* w2, float* y2, int r2) {
    extern __shared__ uint4 q8x_mma_smem[];
    __shared__ float roots[MVF_WARPS][4][WARP];
    const int parts = max(split & 255, 1);
    const int run = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const MvfMatrix m = mvf_matrix(blockIdx.x, 16, w0, y0, r0, w1, y1, r1, w2, y2, r2);
    const int row0 = m.block * 16, nrows = min(16, m.rows - row0);
    const int rb = cols / 256 * 144, rs = q8x_mma_row_stride(cols), ss = q8x_mma_scale_stride(cols);
    const int stride = Q8_ROW_BYTES(cols), xs = stride + 16;
    u8* sw = (u8*)q8x_mma_smem;                    // [16][rs] bytes
    float4* ssc = (float4*)(sw + 16 * rs);         // [16][ss]: (ds0, dm0, ds1, dm1) of block ib, pair c
    u8* sx = (u8*)(ssc + 16 * ss);                 // [8][xs]: the tile's q8 rows
    // The rows into shared memory and their scales, before the wait.
    const int chunks = rb / 16;
    for (int k = threadIdx.x; k < nrows * chunks; k += blockDim.x) {
        const int r = k / chunks, j = k - r * chunks;
        cp_async16(sw + r * rs + 16 * j, m.w + (size_t)(row0 + r) * rb + 16 * j);
    }
    cp_async_wait_all();
    __syncthreads();
    const uint4 zero4 = make_uint4(0u, 0u, 0u, 0u);
    for (int k = threadIdx.x; k < 16 * (cols / 64); k += blockDim.x) {
        const int r = k / (cols / 64), q = k - r * (cols / 64);
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (r < nrows) {
            const Q4kUnit u = q4k_unit(*(const uint4*)(sw + r * rs + (q >> 2) * 144), zero4, 2 * (q & 3));
            v = make_float4(u.ds0, u.dm0, u.ds1, u.dm1);
        }
        ssc[r * ss + q] = v;
    }
    __syncthreads();
    pdl_enter();  // xq comes from the kernel before
    const int t0 = blockIdx.y * 8, nt = min(8, n - t0);
    const u8* xbase = xq + (size_t)t0 * stride;
    for (int k = threadIdx.x; k < nt * (stride / 16); k += blockDim.x) {
        const int t = k / (stride / 16), j = k - t * (stride / 16);
        cp_async16(sx + t * xs + 16 * j, xbase + (size_t)t * stride + 16 * j);
    }
    cp_async_wait_all();
    __syncthreads();
    const int gq = lane >> 2, tq = lane & 3;
    // The lane's A rows (gq, gq + 8), B token (gq) and D tokens (2 tq, 2 tq + 1).
    const bool bv = gq < nt, dv0 = 2 * tq < nt, dv1 = 2 * tq + 1 < nt;
    const Q8Row xB = q8_row(sx + (bv ? gq : 0) * xs, cols);
    const Q8Row xd0 = q8_row(sx + (dv0 ? 2 * tq : 0) * xs, cols);
    const Q8Row xd1 = q8_row(sx + (dv1 ? 2 * tq + 1 : 0) * xs, cols);
    const u8* swa = sw + gq * rs;
    const u8* swb = sw + (gq + 8) * rs;
    const float4* sca = ssc + gq * ss;
    const float4* scb = ssc + (gq + 8) * ss;
    const int units = cols / 32, step = parts * WARP;
    float total[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int p = 0; p < parts; ++p) {
        constexpr int LEVELS = 2;  // log2(Q8X_MMA_LEAVES)
        float stk[LEVELS][4];
#pragma unroll
        for (int i = 0; i < Q8X_MMA_LEAVES; ++i) {
            const int leaf = (int)(__brev((u32)(run * Q8X_MMA_LEAVES + i)) >> 27);
            float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 2
            for (int gi = p * WARP + leaf; gi < units; gi += step) {
                const int ib = gi >> 3, g = gi & 7;
                const int qo = ib * 144 + 16 + 16 * g + 4 * tq;
                const u32 qa = *(const u32*)(swa + qo), qb = *(const u32*)(swb + qo);
                const int at = 256 * ib + q4k_unit_at(g);
                const u32 blo = bv ? *(const u32*)(xB.q + at + 4 * tq) : 0u;
                const u32 bhi = bv ? *(const u32*)(xB.q + at + 32 + 4 * tq) : 0u;
                int sl[4], sh[4];
                mma_s8_16816(sl, qa & 0x0F0F0F0Fu, qb & 0x0F0F0F0Fu, blo);
                mma_s8_16816(sh, (qa >> 4) & 0x0F0F0F0Fu, (qb >> 4) & 0x0F0F0F0Fu, bhi);
                const float4 fa = sca[4 * ib + (g >> 1)], fb = scb[4 * ib + (g >> 1)];
                Q4kUnit ua, ub;
                ua.ds0 = fa.x, ua.dm0 = fa.y, ua.ds1 = fa.z, ua.dm1 = fa.w;
                ub.ds0 = fb.x, ub.dm0 = fb.y, ub.ds1 = fb.z, ub.dm1 = fb.w;
                Q8UnitX x0, x1;
                x0.s_lo = dv0 ? (float)xd0.s16[at / 16] : 0.0f;
                x0.s_hi = dv0 ? (float)xd0.s16[(at + 32) / 16] : 0.0f;
                x0.d_lo = dv0 ? xd0.d[at / 32] : 0.0f;
                x0.d_hi = dv0 ? xd0.d[(at + 32) / 32] : 0.0f;
                x1.s_lo = dv1 ? (float)xd1.s16[at / 16] : 0.0f;
                x1.s_hi = dv1 ? (float)xd1.s16[(at + 32) / 16] : 0.0f;
                x1.d_lo = dv1 ? xd1.d[at / 32] : 0.0f;
                x1.d_hi = dv1 ? xd1.d[(at + 32) / 32] : 0.0f;
                v[0] = __fadd_rn(v[0], q4k_sums_value(ua, sl[0], sh[0], x0));
                v[1] = __fadd_rn(v[1], q4k_sums_value(ua, sl[1], sh[1], x1));
                v[2] = __fadd_rn(v[2], q4k_sums_value(ub, sl[2], sh[2], x0));
                v[3] = __fadd_rn(v[3], q4k_sums_value(ub, sl[3], sh[3], x1));
            }
            q8x_mma_push<LEVELS>(stk, v, i);  // after the last leaf, v is the run's root
            if (i == Q8X_MMA_LEAVES - 1) {
#pragma unroll
                for (int k = 0; k < 4; ++k) roots[run][k][lane] = v[k];
            }
        }
        // The runs' roots, added in the tree's order by warp 0.
        __syncthreads();
        if (run == 0) {
            float rs3[3][4], r[4];
#pragma unroll
            for (int j = 0; j < MVF_WARPS; ++j) {
#pragma unroll
                for (int k = 0; k < 4; ++k) r[k] = roots[j][k][lane];
                q8x_mma_push<3>(rs3, r, j);  // log2(MVF_WARPS) levels
            }
#pragma unroll
            for (int k = 0; k < 4; ++k) total[k] = parts == 1 ? r[k] : total[k] + r[k];
        }
        __syncthreads();  // roots is reused by the next slice
    }
    if (run != 0 || nrows <= 0) return;
    const float inv0 = invs == nullptr || !dv0 ? 1.0f : invs[t0 + 2 * tq];
    const float inv1 = invs == nullptr || !dv1 ? 1.0f : invs[t0 + 2 * tq + 1];
    const int ra = row0 + gq, rbw = row0 + gq + 8;
    if (gq < nrows) {
        if (dv0) m.y[(size_t)(t0 + 2 * tq) * m.rows + ra] = inv0 * total[0];
        if (dv1) m.y[(size_t)(t0 + 2 * tq + 1) * m.rows + ra] = inv1 * total[1];
    }
    if (gq + 8 < nrows) {
        if (dv0) m.y[(size_t)(t0 + 2 * tq) * m.rows + rbw] = inv0 * total[2];
        if (dv1) m.y[(size_t)(t0 + 2 * tq + 1) * m.rows + rbw] = inv1 * total[3];
    }
}

// rms_norm_q8(x, nw, eps, cols, xq, invs): token t = blockIdx.y's input as matvec_norm3_q8_q4_k
// stages it (stage_normed_q8: the same 8 warps, so the same bits): the q8 row of x[t] * nw at
// xq + t * Q8_ROW_BYTES(cols) and invs[t] = 1 / rms(x[t]), for matvec_q8x_q4_k. Once per token
// instead of once per block of the matvec; the q8 blocks cut into gridDim.x slices, a block each
// (each sums all the squares). Launch: grid = (slices, tokens), block = 32 * MVF_WARPS.
extern "C" __global__ __launch_bounds__(32 * MVF_WARPS) void rms_norm_q8(const float* x, const float* nw, float eps,
                                                                      int cols, u8* xq, float* invs) {
    prefetch_l1_block(nw, (size_t)cols * 4);
    pdl_enter();
    const int t = blockIdx.y;
    const float inv = stage_normed_q8(x + (size_t)t * cols, nw, eps, cols, xq + (size_t)t * Q8_ROW_BYTES(cols),
                                      blockIdx.x, gridDim.x);
    if (threadIdx.x == 0 && blockIdx.x == 0) invs[t] = inv;
}

// swiglu_q8(gate, up, out, xq, n): swiglu's out[t] = silu(gate[t]) * up[t] for token t = blockIdx.y
// (n values per token, a multiple of 32), and the same values as a q8 row at xq + t *
// Q8_ROW_BYTES(n) (q8_block32) for matvec_q8x_q4_k. Launch: grid = (ceil(n / 256), tokens), block = 256.
extern "C" __global__ void swiglu_q8(const float* __restrict__ gate, const float* __restrict__ up,
                                     float* __restrict__ out, u8* __restrict__ xq, int n) {
    pdl_enter();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;  // whole warps (n a multiple of 32)
    const size_t at = (size_t)blockIdx.y * n + i;
    const float v = siluf_(gate[at]) * up[at];
    out[at] = v;
    q8_row_block32(v, threadIdx.x % WARP, xq + (size_t)blockIdx.y * Q8_ROW_BYTES(n), n, i / 32);
}

// matvec_res_q8_q4_k(w, x, y, rows, cols, split, nw, yn, counter, eps): matvec_res_q4_k through a
// staged q8 row of x[t] (no norm), rows per warp group as matvec_norm3_q8: y[t] += W . x[t], then
// the next norm by the last block. Launch: as matvec_res, dynamic shared memory = Q8_ROW_BYTES(cols).
extern "C" __global__ __launch_bounds__(32 * MVF_WARPS) void matvec_res_q8_q4_k(const u8* w, const float* x, float* y,
                                                                              int rows, int cols, int split,
                                                                              const float* nw, float* yn,
                                                                              u32* counter, float eps, u8* xq) {
    extern __shared__ float4 q8_res_smem[];  // (a name of its own: an extern "C" kernel)
    u8* base = (u8*)q8_res_smem;
    const MvfSplit s = q8_split(split);
    const int t = blockIdx.y;
    int first, part;
    mvf_first(blockIdx.x, s, first, part);
    if (t == 0) mvf_prefetch<T_Q4_K>(w, cols, rows, first, part, s);
    pdl_enter();  // x and y come from the kernels before
    stage_normed_q8(x + (size_t)t * cols, nullptr, 0.0f, cols, base);
    q8_rows_out<T_Q4_K, 1, true>(w, y, rows, cols, s, first, part, base, 0, t, 1, nullptr);
    res_next_norm(y, rows, nw, yn, counter, eps, xq);
}

// embed_<type>(table, ids, out, cols): out[t] = dequantized row ids[t] of the table.
// Launch: grid = n ids, block = any multiple of 32.
template <typename T>
__device__ __forceinline__ void embed_body(const u8* __restrict__ table, const int* __restrict__ ids,
                                           float* __restrict__ out, int cols) {
    const int t = blockIdx.x;
    const u8* row = table + (size_t)ids[t] * row_bytes<T>(cols);
    for (int k = threadIdx.x; k < cols; k += blockDim.x) {
        out[(size_t)t * cols + k] = T::dq(row + (size_t)(k / T::QK) * T::BB, k % T::QK);
    }
}

// embed_cat2_<type>(table, ids, b, wa, wb, wpre, y, n, eps): the MTP block's input from the token
// ids and hidden rows b: y[r] = [rms_norm(embedding(ids[r])) * wa | rms_norm(b'[r]) * wb] with
// b' = b, or with wpre (a chained draft step: b is the last step's output) b' = rms_norm(b) *
// wpre, its shared-head norm. The embedding, the shared-head norm and both input norms in one
// launch, each norm with rms_norm's loop and sums (the same values as the separate kernels).
// Launch: grid = (rows, 2), blockIdx.y picks the half, block = 256 (rms_norm's).
template <typename T>
__device__ __forceinline__ void embed_cat2_body(const u8* __restrict__ table, const int* __restrict__ ids,
                                                const float* __restrict__ b, const float* __restrict__ wa,
                                                const float* __restrict__ wb, const float* __restrict__ wpre,
                                                float* __restrict__ y, int n, float eps) {
    __shared__ float scratch[WARP];
    const bool second = blockIdx.y == 1;
    const u8* row = table + (size_t)ids[blockIdx.x] * row_bytes<T>(n);
    const float* br = b + (size_t)blockIdx.x * n;
    const float* w = second ? wb : wa;
    float* yr = y + (size_t)blockIdx.x * 2 * n + (second ? n : 0);
    float ss = 0.0f;
    if (second && wpre != nullptr) {
        // b' into yr (each thread reads back only its own values), then its norm below.
        for (int i = threadIdx.x; i < n; i += blockDim.x) ss += br[i] * br[i];
        ss = block_sum(ss, scratch);
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
        ss = 0.0f;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const float v = br[i] * inv * wpre[i];
            yr[i] = v;
            ss += v * v;
        }
        br = yr;
    } else {
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const float v = second ? br[i] : T::dq(row + (size_t)(i / T::QK) * T::BB, i % T::QK);
            ss += v * v;
        }
    }
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = second ? br[i] : T::dq(row + (size_t)(i / T::QK) * T::BB, i % T::QK);
        yr[i] = v * inv * w[i];
    }
}

#define MATVEC_KERNELS(name, T)                                                                      \
    extern "C" __global__ void matvec_##name(const u8* w, const float* x, float* y, int rows, int cols) { \
        matvec_body<T>(w, x, y, rows, cols);                                                         \
    }                                                                                                \
    extern "C" __global__ void embed_##name(const u8* table, const int* ids, float* out, int cols) { \
        pdl_enter();                                                                                 \
        embed_body<T>(table, ids, out, cols);                                                        \
    }                                                                                                \
    extern "C" __global__ void embed_cat2_##name(const u8* table, const int* ids, const float* b,     \
                                                 const float* wa, const float* wb, const float* wpre, \
                                                 float* y, int n, float eps) {                        \
        pdl_enter();                                                                                 \
        embed_cat2_body<T>(table, ids, b, wa, wb, wpre, y, n, eps);                                  \
    }                                                                                                \
    extern "C" __global__ void __launch_bounds__(32 * MVF_WARPS) matvec_norm3_##name(                \
        const float* x, const float* nw, float eps, int cols, int split, const u8* w0, float* y0,    \
        int r0, const u8* w1, float* y1, int r1, const u8* w2, float* y2, int r2) {                  \
        matvec_norm3_body<T>(x, nw, eps, cols, split, w0, y0, r0, w1, y1, r1, w2, y2, r2);           \
    }                                                                                                \
    extern "C" __global__ void __launch_bounds__(32 * MVF_WARPS) matvec_norm3_tok_##name(            \
        const float* x, const float* nw, float eps, int cols, int split, int n, const u8* w0,        \
        float* y0, int r0, const u8* w1, float* y1, int r1, const u8* w2, float* y2, int r2) {       \
        matvec_norm3_tok_body<T>(x, nw, eps, cols, split, n, w0, y0, r0, w1, y1, r1, w2, y2, r2);    \
    }                                                                                                \
    extern "C" __global__ void __launch_bounds__(32 * MVF_WARPS, RES_MIN_BLOCKS) matvec_res_##name(  \
        const u8* w, const float* x, float* y, int rows, int cols, int split, const float* nw,       \
        float* yn, u32* counter, float eps, u8* xq) {                                                \
        matvec_res_body<T>(w, x, y, rows, cols, split, nw, yn, counter, eps, xq);                    \
    }                                                                                                \
    /* matvec_res_tok: y[t] += W . x[t] for n tokens in tiles (split >> 16), no norm (as        */   \
    /* matvec_res with nw null, bit for bit). Launch: grid = (ceil(rows / (MVF_WARPS / parts)), */   \
    /* ceil(n / tile)), block = 32 * MVF_WARPS.                                                 */   \
    extern "C" __global__ void __launch_bounds__(32 * MVF_WARPS) matvec_res_tok_##name(              \
        const u8* w, const float* x, float* y, int rows, int cols, int split, int n) {               \
        const int tile = min(max((split >> 16) & 255, 1), MVF_MAX_TILE);                             \
        mvf_tok_inplace_body<T, true>(w, x, y, rows, cols, mvf_split(split), blockIdx.x, tile, n);        \
    }

FOR_EACH_TYPE(MATVEC_KERNELS)

// read_sum(p, n4, out): the device's read bandwidth for `bench kernel`: every float4 of p[0 .. n4)
// read once (grid-stride, 16-byte loads), each block's sum written to out[blockIdx.x] so the
// loads cannot be dropped. Launch: any grid, block = 256 threads.
extern "C" __global__ void read_sum(const float4* __restrict__ p, unsigned long long n4, float* __restrict__ out) {
    pdl_enter();
    __shared__ float scratch[WARP];
    float acc = 0.0f;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n4;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        const float4 v = p[i];
        acc += (v.x + v.y) + (v.z + v.w);
    }
    acc = block_sum(acc, scratch);
    if (threadIdx.x == 0) out[blockIdx.x] = acc;
}

// The read kernels' end: their eight partial sums added in order, then over the block into
// out[blockIdx.x] (so that no load can be dropped).
__device__ __forceinline__ void sum8_out(const float (&acc)[8], float* scratch, float* out) {
    float a = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) a += acc[k];
    a = block_sum(a, scratch);
    if (threadIdx.x == 0) out[blockIdx.x] = a;
}

// read_sum8(p, n4, out): read_sum unrolled by 8 (8 sums, added at the end) for a grid of 8
// blocks an SM: more bytes in flight than read_sum's 4 blocks an SM. (ptxas keeps only about two
// of the eight loads in flight a thread, at 34 registers, whatever the source says; the
// occupancy, 7 blocks an SM, brings the rest.) Launch: any grid, block = 256 threads.
extern "C" __global__ void read_sum8(const float4* __restrict__ p, unsigned long long n4, float* __restrict__ out) {
    pdl_enter();
    __shared__ float scratch[WARP];
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 7 * stride < n4; i += 8 * stride) {
        float4 v[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = __ldg(p + i + k * stride);
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[k] += (v[k].x + v[k].y) + (v[k].z + v[k].w);
    }
    for (; i < n4; i += stride) {
        const float4 v = __ldg(p + i);
        acc[0] += (v.x + v.y) + (v.z + v.w);
    }
    sum8_out(acc, scratch, out);
}

// read_rows(p, rows, piece16, heads, out): the decode attention's walk over its KV cache without
// the arithmetic, for `bench kernel`'s layout probe. The buffer is [rows][heads][piece16 float4s]
// (the cache's [position][KV head][head_dim]; piece16 a multiple of 32: 512-byte sub-rows); block
// b takes head g = b % heads and the rows of chunk b / heads (gridDim.x / heads chunks of equal
// length); a warp reads a 512-byte sub-row a load (16 bytes a lane), eight sub-rows in flight, the
// block's warps on consecutive sub-rows. heads = 1: every block one contiguous stretch (a
// head-major cache). Launch: grid = heads · chunks, block = 256 threads.
extern "C" __global__ void read_rows(const float4* __restrict__ p, unsigned long long rows, int piece16, int heads,
                                     float* __restrict__ out) {
    pdl_enter();
    __shared__ float scratch[WARP];
    const int g = blockIdx.x % heads, lane = threadIdx.x % WARP, w = threadIdx.x / WARP, nw = blockDim.x / WARP;
    const unsigned long long chunks = gridDim.x / heads, c = blockIdx.x / heads;
    const unsigned long long per = (rows + chunks - 1) / chunks, r0 = c * per;
    const unsigned long long r1 = r0 + per < rows ? r0 + per : rows;
    const int ks = __ffs(piece16 / WARP) - 1;  // log2(sub-rows a row)
    const int subs = r1 > r0 ? (int)((r1 - r0) << ks) : 0;
    auto at = [&](int sr) {
        return p + ((r0 + (sr >> ks)) * heads + g) * piece16 + (sr & ((1 << ks) - 1)) * WARP + lane;
    };
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    int sr = w;
    for (; sr + 7 * nw < subs; sr += 8 * nw) {
        float4 v[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = __ldg(at(sr + k * nw));
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[k] += (v[k].x + v[k].y) + (v[k].z + v[k].w);
    }
    for (; sr < subs; sr += nw) {
        const float4 v = __ldg(at(sr));
        acc[0] += (v.x + v.y) + (v.z + v.w);
    }
    sum8_out(acc, scratch, out);
}
