// Quantized matrix-vector products and the embedding lookup, one kernel per type.
//
// matvec_<type>(w, x, y, rows, cols): y[t][r] = W[r] . x[t] for t < gridDim.y (the batch);
// W is `rows` rows of `cols / QK` blocks in the file's layout, x and y are f32 row-major.
// One warp per output row, f32 accumulation, the warp sums at the end. For the types with a
// group decoder (GroupDot below: Q4_K, Q6_K, Q8_0, IQ2_XXS, the full-size layout's types) lane i
// takes groups i, i + 32, ... of G consecutive values, decoding each group's scales once and its
// quants with 16- or 32-bit loads; every other type takes single values (lane i: values i, i + 32,
// ...) through its dq(). Either way each weight is the value dq() gives, bit for bit.
// Launch: block = 32 * warps threads, grid = (ceil(rows / warps), n).

// Group decoders: dot(block, g, x) = sum over the G values of group g of the block of w * x[j].
template <typename T>
struct GroupDot {
    enum { G = 0 };  // no group decoder: per-value path
};

// Four activations in one 16-byte load: a group's x starts at a multiple of its G (4, 8 or 16)
// values in a row of whole blocks, so it is 16-byte aligned in an aligned buffer.
__device__ __forceinline__ float4 ld_x4(const float* p) { return *(const float4*)p; }

// Two 16-bit loads (blocks of even size keep quants 2-byte aligned).
__device__ __forceinline__ u32 ld_u32_a2(const u8* p) {
    const u16* h = (const u16*)p;
    return (u32)h[0] | ((u32)h[1] << 16);
}

// Q4_K: 8 sub-blocks of 32 with 6-bit scale and min; group = half a sub-block (16 values). The
// 144-byte blocks are 16-byte aligned in an aligned buffer (every weight buffer here is), so the
// header and the 16 quant bytes are one 16-byte load each.
template <>
struct GroupDot<T_Q4_K> {
    enum { G = 16 };
    static __device__ __forceinline__ float dot(const u8* __restrict__ b, int g, const float* __restrict__ x) {
        const int sub = g >> 1;
        // d, dmin and the 12 scale bytes in one 16-byte load, decoded in registers.
        const uint4 hd = *(const uint4*)b;
        const u32 sw[3] = {hd.y, hd.z, hd.w};  // scale bytes 0..11
#define Q4K_SB(k) ((int)((((k) < 4 ? sw[0] : (k) < 8 ? sw[1] : sw[2]) >> (8 * ((k) & 3))) & 255))
        int sc, m;
        if (sub < 4) {
            sc = Q4K_SB(sub) & 63;
            m = Q4K_SB(sub + 4) & 63;
        } else {
            sc = (Q4K_SB(sub + 4) & 15) | ((Q4K_SB(sub - 4) >> 6) << 4);
            m = (Q4K_SB(sub + 4) >> 4) | ((Q4K_SB(sub) >> 6) << 4);
        }
#undef Q4K_SB
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

// Q6_K: 16 scales per block, one per 16 values; group = those 16 values.
template <>
struct GroupDot<T_Q6_K> {
    enum { G = 16 };
    static __device__ __forceinline__ float dot(const u8* __restrict__ b, int g, const float* __restrict__ x) {
        const int c = g >> 3, k = (g >> 1) & 3, l0 = 16 * (g & 1);
        const u8* lo = b + 64 * c + 32 * (k & 1) + l0;
        const u8* hi = b + 128 + 32 * c + l0;
        const int shl = 4 * (k >> 1), shh = 2 * k;
        const float d = ld_f16(b + 208) * (float)(i8)b[192 + g];
        float acc = 0.0f;
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            const u32 vl = ld_u32_a2(lo + 4 * w), vh = ld_u32_a2(hi + 4 * w);
            const float4 xv = ld_x4(x + 4 * w);
            const float xs[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int q = ((vl >> (8 * j + shl)) & 15) | (((vh >> (8 * j + shh)) & 3) << 4);
                acc += (d * (float)(q - 32)) * xs[j];
            }
        }
        return acc;
    }
};

// Q8_0: one scale per block of 32; group = half a block.
template <>
struct GroupDot<T_Q8_0> {
    enum { G = 16 };
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

// IQ2_XXS: 8 sub-blocks of 32 (4 grid indices, then a u32 of 7-bit sign codes and the scale);
// group = one grid entry (8 values).
template <>
struct GroupDot<T_IQ2_XXS> {
    enum { G = 8 };
    static __device__ __forceinline__ float dot(const u8* __restrict__ b, int g, const float* __restrict__ x) {
        const int ib = g >> 2, l = g & 3;
        const u8* at = b + 2 + 8 * ib;
        const u32 aux = ld_u32_a2(at + 4);
        const float db = ld_f16(b) * (0.5f + (float)(aux >> 28)) * 0.25f;
        const u64 row = g_iq2xxs_grid[at[l]];
        const u8 signs = g_ksigns_iq2xs[(aux >> (7 * l)) & 127];
        const float4 x0 = ld_x4(x), x1 = ld_x4(x + 4);
        const float xs[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) acc += (db * (float)((row >> (8 * j)) & 255) * sign_of(signs, j)) * xs[j];
        return acc;
    }
};

// F32 (blocks of one value): group = 4 values, one 16-byte load when aligned.
template <>
struct GroupDot<T_F32> {
    enum { G = 4 };
    static __device__ __forceinline__ float dot(const u8* __restrict__ b, int, const float* __restrict__ x) {
        float4 v;
        if (((size_t)b & 15) == 0) {
            v = *(const float4*)b;
        } else {
            const float* f = (const float*)b;
            v = make_float4(f[0], f[1], f[2], f[3]);
        }
        return v.x * x[0] + v.y * x[1] + v.z * x[2] + v.w * x[3];
    }
};

template <typename T>
__device__ __forceinline__ float row_dot(const u8* __restrict__ wr, const float* __restrict__ x, int cols, int lane) {
    float acc = 0.0f;
    constexpr int G = GroupDot<T>::G;
    if constexpr (G > 0 && G <= T::QK) {
        // Groups inside a block.
        constexpr int PER_BLOCK = T::QK / G;
        const int groups = cols / G;
        for (int gi = lane; gi < groups; gi += WARP) {
            acc += GroupDot<T>::dot(wr + (size_t)(gi / PER_BLOCK) * T::BB, gi % PER_BLOCK, x + (size_t)gi * G);
        }
    } else if constexpr (G > 0) {
        // Groups of several one-value blocks (F32); a tail shorter than a group goes value by value.
        const int groups = cols / G;
        for (int gi = lane; gi < groups; gi += WARP) {
            acc += GroupDot<T>::dot(wr + (size_t)gi * G * T::BB, 0, x + (size_t)gi * G);
        }
        for (int k = groups * G + lane; k < cols; k += WARP) acc += T::dq(wr + (size_t)k * T::BB, 0) * x[k];
    } else {
        for (int k = lane; k < cols; k += WARP) {
            acc += T::dq(wr + (size_t)(k / T::QK) * T::BB, k % T::QK) * x[k];
        }
    }
    return warp_sum(acc);
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
    if (row >= rows) return;  // whole warps leave together
    const float acc = row_dot<T>(w + (size_t)row * row_bytes<T>(cols), x + (size_t)t * cols, cols, lane);
    if (lane == 0) y[(size_t)t * rows + row] = acc;
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

#define MATVEC_KERNELS(name, T)                                                                      \
    extern "C" __global__ void matvec_##name(const u8* w, const float* x, float* y, int rows, int cols) { \
        matvec_body<T>(w, x, y, rows, cols);                                                         \
    }                                                                                                \
    extern "C" __global__ void embed_##name(const u8* table, const int* ids, float* out, int cols) { \
        embed_body<T>(table, ids, out, cols);                                                        \
    }

FOR_EACH_TYPE(MATVEC_KERNELS)
