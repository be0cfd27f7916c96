// Prompt ingestion on the tensor cores: Y = X · Wᵀ for many tokens at once.
//
// A block owns GEMM_BM weight rows and up to GEMM_BN tokens. Per step of GEMM_BK columns it
// decodes its weight tile from the quantized blocks (through the type's dq, the same decoder the
// matvecs use) into shared memory as f16, converts the tokens' f32 activations to f16 beside it,
// and multiplies the two with `mma.sync.m16n8k16` (f16 inputs, f32 accumulation). Every weight
// is decoded once per block and used by all its tokens: a prompt of n tokens costs one pass over
// the weights per GEMM_BN tokens instead of one per token (the matvecs).
//
// Numerics: inputs rounded to f16 (11-bit significand), products summed in f32 by the tensor
// cores in their own order. This is the precision llama.cpp's prompt path uses too; decode and
// speculative verify keep the f32 matvecs (their rows stay bit-identical to each other).
//
// Layout: W is row-major with `row_bytes` bytes per row (the GGUF blocks of one row), X is
// row-major f32 with `cols` per token, Y[t][r] at y + yrow(t) * y_stride + r.
//
// Warps: 4 per block as 2 (rows) × 2 (tokens); a warp computes 32 rows × 32 tokens as
// 2 × 4 tiles of m16n8, i.e. 8 mma per 16 columns.

#define GEMM_BM 64
#define GEMM_BN 64
#define GEMM_BK 32
#define GEMM_THREADS 128
// Halves per shared row: 32 + 8 of padding, so the fragment loads (8 rows × 4 words) hit 32
// different banks.
#define GEMM_PITCH 40

// 16 Q4_K weights of one sub-block from its 16 quant bytes (nibble `shift / 4` of each), scale d
// and min dm, as 8 f16x2 words.
__device__ __forceinline__ void q4k_pack16(const uint4 q, int shift, float d, float dm, u32* out) {
    const u32 w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const u32 v = w[i] >> shift;
        out[2 * i] = pack_f16x2(d * (float)(v & 15) - dm, d * (float)((v >> 8) & 15) - dm);
        out[2 * i + 1] = pack_f16x2(d * (float)((v >> 16) & 15) - dm, d * (float)((v >> 24) & 15) - dm);
    }
}

// One IQ2_XXS group: the 8 grid bytes of `row8` with their sign bits, times db, as 4 f16x2 words.
__device__ __forceinline__ void iq2xxs_pack8(u64 row8, u8 signs, float db, u32* out) {
#pragma unroll
    for (int j = 0; j < 8; j += 2) {
        const float a = db * (float)((row8 >> (8 * j)) & 255) * sign_of(signs, j);
        const float c = db * (float)((row8 >> (8 * j + 8)) & 255) * sign_of(signs, j + 1);
        out[j / 2] = pack_f16x2(a, c);
    }
}

// 16 consecutive weights of one row from column k (k a multiple of 16), as 8 f16x2 words.
// Generic form: one dq per element. Types whose 16 elements share their block's scales decode
// them once below.
template <typename T>
struct Dq16 {
    static __device__ __forceinline__ void run(const u8* row, int k, u32* out) {
#pragma unroll
        for (int j = 0; j < 16; j += 2) {
            const int e0 = k + j, e1 = k + j + 1;
            const float a = T::dq(row + (size_t)(e0 / T::QK) * T::BB, e0 % T::QK);
            const float b = T::dq(row + (size_t)(e1 / T::QK) * T::BB, e1 % T::QK);
            out[j / 2] = pack_f16x2(a, b);
        }
    }
};

// Q4_K: 16 elements of one 32-element sub-block: one scale/min pair, 16 nibbles from 16 bytes.
template <>
struct Dq16<T_Q4_K> {
    static __device__ __forceinline__ void run(const u8* row, int k, u32* out) {
        const u8* b = row + (size_t)(k >> 8) * T_Q4_K::BB;
        const int e = k & 255, sub = e >> 5, l0 = e & 31;
        int sc, m;
        scale_min_k4(b + 4, sub, &sc, &m);
        const float d = ld_f16(b) * (float)sc, dm = ld_f16(b + 2) * (float)m;
        const uint4 q = *(const uint4*)(b + 16 + 32 * (sub >> 1) + l0);
        q4k_pack16(q, 4 * (sub & 1), d, dm, out);
    }
};

// IQ2_XXS: 16 elements = two 8-element grid groups of one 32-element sub-block (one scale).
template <>
struct Dq16<T_IQ2_XXS> {
    static __device__ __forceinline__ void run(const u8* row, int k, u32* out) {
        const u8* b = row + (size_t)(k >> 8) * T_IQ2_XXS::BB;
        const int e = k & 255, ib = e >> 5, l0 = (e >> 3) & 3;
        const u8* at = b + 2 + 8 * ib;
        const u32 aux = ld_u32(at + 4);
        const float db = ld_f16(b) * (0.5f + (float)(aux >> 28)) * 0.25f;
#pragma unroll
        for (int g = 0; g < 2; ++g) {
            const int l = l0 + g;
            const u64 row8 = g_iq2xxs_grid[at[l]];
            const u8 signs = g_ksigns_iq2xs[(aux >> (7 * l)) & 127];
            iq2xxs_pack8(row8, signs, db, out + 4 * g);
        }
    }
};

// GEMM_SPLIT_FETCH=1 (experiment, off until measured on a GPU): the next step's global loads
// are issued alone before this step's mma (`Fetch16::fetch` into registers) and decoded after it
// (`Fetch16::decode`), so their latency is covered by the mma instead of stalling the decoder
// right after the load (the default form decodes as soon as it loads). Same values either way.
#ifndef GEMM_SPLIT_FETCH
#define GEMM_SPLIT_FETCH 0
#endif

// Generic: nothing to fetch ahead; decode reads the block (Dq16).
template <typename T>
struct Fetch16 {
    struct Raw {
        const u8* row;
        int k;
    };
    static __device__ __forceinline__ void fetch(const u8* row, int k, Raw& r) {
        r.row = row;
        r.k = k;
    }
    static __device__ __forceinline__ void decode(const Raw& r, u32* out) { Dq16<T>::run(r.row, r.k, out); }
};

// Q4_K: the 16 quant bytes, d | dmin and the 12 scale bytes as words; Dq16<T_Q4_K>'s arithmetic.
template <>
struct Fetch16<T_Q4_K> {
    struct Raw {
        uint4 q;
        u32 dm, s[3];
        int sub;
    };
    static __device__ __forceinline__ void fetch(const u8* row, int k, Raw& r) {
        const u8* b = row + (size_t)(k >> 8) * T_Q4_K::BB;
        const int e = k & 255;
        r.sub = e >> 5;
        r.q = *(const uint4*)(b + 16 + 32 * (r.sub >> 1) + (e & 31));
        r.dm = *(const u32*)b;
        r.s[0] = *(const u32*)(b + 4);
        r.s[1] = *(const u32*)(b + 8);
        r.s[2] = *(const u32*)(b + 12);
    }
    static __device__ __forceinline__ void decode(const Raw& r, u32* out) {
        int sc, m;
        q4k_scale_min(r.s, r.sub, sc, m);  // matvec.cu's, on the scale words
        const float d = f16_to_f32((u16)(r.dm & 0xffff)) * (float)sc;
        const float dm = f16_to_f32((u16)(r.dm >> 16)) * (float)m;
        q4k_pack16(r.q, 4 * (r.sub & 1), d, dm, out);
    }
};

// IQ2_XXS: the sub-block's 4 grid indices and its aux word, and d; Dq16<T_IQ2_XXS>'s arithmetic.
template <>
struct Fetch16<T_IQ2_XXS> {
    struct Raw {
        u32 idx, aux;
        u16 d;
        int l0;
    };
    static __device__ __forceinline__ void fetch(const u8* row, int k, Raw& r) {
        const u8* b = row + (size_t)(k >> 8) * T_IQ2_XXS::BB;
        const int e = k & 255;
        const u8* at = b + 2 + 8 * (e >> 5);
        r.l0 = (e >> 3) & 3;
        r.idx = ld_u32(at);
        r.aux = ld_u32(at + 4);
        r.d = ld_u16(b);
    }
    static __device__ __forceinline__ void decode(const Raw& r, u32* out) {
        const float db = f16_to_f32(r.d) * (0.5f + (float)(r.aux >> 28)) * 0.25f;
#pragma unroll
        for (int g = 0; g < 2; ++g) {
            const int l = r.l0 + g;
            const u64 row8 = g_iq2xxs_grid[(r.idx >> (8 * l)) & 255];
            const u8 signs = g_ksigns_iq2xs[(r.aux >> (7 * l)) & 127];
            iq2xxs_pack8(row8, signs, db, out + 4 * g);
        }
    }
};

// The block's tile: rows [0, rows_valid) of `w`, tokens [0, nt) whose activation rows are
// x_at(t) and whose outputs go to y + y_at(t) * y_stride. Tokens map through `map` (a list of
// row indices, divided by `map_div` for the input row) or, without one, are t0 + t.
template <typename T>
__device__ __forceinline__ void gemm_tile(const u8* __restrict__ w, size_t row_bytes, int rows_valid,
                                          int cols, const float* __restrict__ x, const int* __restrict__ map,
                                          int map_div, int t0, int nt, float* __restrict__ y, int y_stride,
                                          int accumulate) {
    __shared__ __align__(16) u16 ws[GEMM_BM * GEMM_PITCH];
    __shared__ __align__(16) u16 xs[GEMM_BN * GEMM_PITCH];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp & 1, wn = warp >> 1, g = lane >> 2, c = lane & 3;

    // Loader roles: weight row (and token) tid / 2, 16 columns from 16 * (tid % 2).
    const int lr = tid >> 1, lh = tid & 1;
    const u8* wrow = lr < rows_valid ? w + (size_t)lr * row_bytes : nullptr;
    const float* xrow = nullptr;
    if (lr < nt) {
        const int xr = map ? map[t0 + lr] / map_div : t0 + lr;
        xrow = x + (size_t)xr * cols;
    }

    float acc[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int v = 0; v < 4; ++v) acc[i][j][v] = 0.0f;

    u32 wv[8], xv[8];
    auto load = [&](int k0) {
        const int k = k0 + 16 * lh;
        if (wrow) {
            Dq16<T>::run(wrow, k, wv);
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) wv[i] = 0;
        }
        if (xrow) {
            const float4* p = (const float4*)(xrow + k);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float4 v = p[i];
                xv[2 * i] = pack_f16x2(v.x, v.y);
                xv[2 * i + 1] = pack_f16x2(v.z, v.w);
            }
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) xv[i] = 0;
        }
    };

#if GEMM_SPLIT_FETCH
    typename Fetch16<T>::Raw raw;
    float4 xr[4];
    auto fetch = [&](int k0) {
        const int k = k0 + 16 * lh;
        if (wrow) Fetch16<T>::fetch(wrow, k, raw);
        if (xrow) {
            const float4* p = (const float4*)(xrow + k);
#pragma unroll
            for (int i = 0; i < 4; ++i) xr[i] = p[i];
        }
    };
    auto decode = [&]() {
        if (wrow) {
            Fetch16<T>::decode(raw, wv);
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) wv[i] = 0;
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            xv[2 * i] = xrow ? pack_f16x2(xr[i].x, xr[i].y) : 0u;
            xv[2 * i + 1] = xrow ? pack_f16x2(xr[i].z, xr[i].w) : 0u;
        }
    };
    fetch(0);
#else
    load(0);
#endif
    for (int k0 = 0; k0 < cols; k0 += GEMM_BK) {
#if GEMM_SPLIT_FETCH
        decode();
#endif
        __syncthreads();  // the previous step's fragments are read
        uint4* wd = (uint4*)(ws + lr * GEMM_PITCH + 16 * lh);
        uint4* xd = (uint4*)(xs + lr * GEMM_PITCH + 16 * lh);
        wd[0] = make_uint4(wv[0], wv[1], wv[2], wv[3]);
        wd[1] = make_uint4(wv[4], wv[5], wv[6], wv[7]);
        xd[0] = make_uint4(xv[0], xv[1], xv[2], xv[3]);
        xd[1] = make_uint4(xv[4], xv[5], xv[6], xv[7]);
        __syncthreads();
#if GEMM_SPLIT_FETCH
        if (k0 + GEMM_BK < cols) fetch(k0 + GEMM_BK);  // loads only: decoded after the mma
#else
        if (k0 + GEMM_BK < cols) load(k0 + GEMM_BK);  // next step's loads overlap this step's mma
#endif
#pragma unroll
        for (int ks = 0; ks < GEMM_BK; ks += 16) {
            u32 a[2][4], bf[4][2];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                const u16* p = ws + (wm * 32 + mt * 16 + g) * GEMM_PITCH + ks + 2 * c;
                a[mt][0] = *(const u32*)p;
                a[mt][1] = *(const u32*)(p + 8 * GEMM_PITCH);
                a[mt][2] = *(const u32*)(p + 8);
                a[mt][3] = *(const u32*)(p + 8 * GEMM_PITCH + 8);
            }
#pragma unroll
            for (int n8 = 0; n8 < 4; ++n8) {
                const u16* p = xs + (wn * 32 + n8 * 8 + g) * GEMM_PITCH + ks + 2 * c;
                bf[n8][0] = *(const u32*)p;
                bf[n8][1] = *(const u32*)(p + 8);
            }
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int n8 = 0; n8 < 4; ++n8) mma_16816(acc[mt][n8], a[mt], bf[n8]);
        }
    }

    // c0, c1: row g, tokens 2c and 2c + 1; c2, c3: row g + 8.
#pragma unroll
    for (int n8 = 0; n8 < 4; ++n8) {
#pragma unroll
        for (int v = 0; v < 4; ++v) {
            const int t = wn * 32 + n8 * 8 + 2 * c + (v & 1);
            if (t >= nt) continue;
            const int yr = map ? map[t0 + t] : t0 + t;
            float* yt = y + (size_t)yr * y_stride;
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                const int r = wm * 32 + mt * 16 + g + 8 * (v >> 1);
                if (r >= rows_valid) continue;
                const float s = acc[mt][n8][v];
                yt[r] = accumulate ? yt[r] + s : s;
            }
        }
    }
}

// gemm_<type>(w, x, y, rows, cols, n, accumulate): y[t][r] (+)= Σ_k w[r][k] x[t][k] for n
// tokens. cols a multiple of GEMM_BK. Launch: grid = (ceil(rows / 64), ceil(n / 64)),
// block = GEMM_THREADS.
template <typename T>
__device__ __forceinline__ void gemm_body(const u8* w, const float* x, float* y, int rows, int cols, int n,
                                          int accumulate) {
    const int r0 = blockIdx.x * GEMM_BM, t0 = blockIdx.y * GEMM_BN;
    const size_t rb = row_bytes<T>(cols);
    gemm_tile<T>(w + (size_t)r0 * rb, rb, min(GEMM_BM, rows - r0), cols, x, nullptr, 1, t0,
                 min(GEMM_BN, n - t0), y + r0, rows, accumulate);
}

// moe_gemm_<type>(tab, part0, parts, off, pairs, x, x_div, y, rows, cols, y_stride): the routed
// experts of a prompt, grouped by expert. (token, choice) pairs p = t · k + j sorted by expert
// (`moe_group`): expert e's are pairs[off[e] .. off[e + 1]). Expert e = blockIdx.y multiplies
// its pairs' activation rows x[p / x_div] with `parts` consecutive parts from part0 of its table
// entry (tab[3 e + part]; 0 gate, 1 up, 2 down), each `rows` rows of `cols`, and writes part i's
// rows to y[p][i · rows ..] (y_stride floats per pair). Launch: grid = (parts · rows / 64,
// n_expert), block = GEMM_THREADS.
template <typename T>
__device__ __forceinline__ void moe_gemm_body(const u64* __restrict__ tab, int part0, int parts,
                                              const int* __restrict__ off, const int* __restrict__ pairs,
                                              const float* x, int x_div, float* y, int rows, int cols,
                                              int y_stride) {
    const int e = blockIdx.y;
    const int begin = off[e], count = off[e + 1] - begin;
    if (count == 0) return;
    const int tiles = (rows + GEMM_BM - 1) / GEMM_BM;
    const int part = blockIdx.x / tiles, r0 = (blockIdx.x % tiles) * GEMM_BM;
    if (part >= parts) return;
    const size_t rb = row_bytes<T>(cols);
    const u8* w = (const u8*)tab[3 * (size_t)e + part0 + part] + (size_t)r0 * rb;
    for (int t0 = 0; t0 < count; t0 += GEMM_BN) {
        gemm_tile<T>(w, rb, min(GEMM_BM, rows - r0), cols, x, pairs + begin, x_div, t0,
                     min(GEMM_BN, count - t0), y + part * rows + r0, y_stride, 0);
    }
}

#define GEMM_KERNELS(name, T)                                                                        \
    extern "C" __global__ void __launch_bounds__(GEMM_THREADS)                                       \
        gemm_##name(const u8* w, const float* x, float* y, int rows, int cols, int n, int accumulate) { \
        pdl_enter();                                                                                 \
        gemm_body<T>(w, x, y, rows, cols, n, accumulate);                                            \
    }                                                                                                \
    extern "C" __global__ void __launch_bounds__(GEMM_THREADS)                                       \
        moe_gemm_##name(const u64* tab, int part0, int parts, const int* off, const int* pairs,      \
                        const float* x, int x_div, float* y, int rows, int cols, int y_stride) {     \
        pdl_enter();                                                                                 \
        moe_gemm_body<T>(tab, part0, parts, off, pairs, x, x_div, y, rows, cols, y_stride);          \
    }

FOR_EACH_TYPE(GEMM_KERNELS)

// ----- Prompt GEMMs through cuBLAS (`model/launch.rs`, `gemm_blas`) -----
//
// Long prompts can run a product as one library GEMM instead of `gemm_<type>`: the weight matrix
// decoded whole into f16 (`dequant_f16_<type>`), the tokens' activations rounded to f16
// (`f32_to_f16`), then cublasGemmEx (f16 × f16, f32 accumulation and output). The f16 values are
// the ones `gemm_<type>` puts in shared memory (the same Dq16 decoders, the same rounding), so
// the two forms differ only in the order of the f32 sums.

// dequant_f16_<type>(w, out, rows, cols): out[r][k] = f16(W[r][k]), row-major, cols a multiple
// of 32. One thread per 16 consecutive weights of a row.
template <typename T>
__device__ __forceinline__ void dequant_f16_body(const u8* __restrict__ w, u32* __restrict__ out, int rows,
                                                 int cols) {
    const int groups = cols / 16;
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)rows * groups) return;
    const int r = (int)(i / groups), k = (int)(i % groups) * 16;
    u32 v[8];
    Dq16<T>::run(w + (size_t)r * row_bytes<T>(cols), k, v);
    uint4* o = (uint4*)(out + ((size_t)r * cols + k) / 2);
    o[0] = make_uint4(v[0], v[1], v[2], v[3]);
    o[1] = make_uint4(v[4], v[5], v[6], v[7]);
}

#define DEQUANT_F16_KERNEL(name, T)                                                                  \
    extern "C" __global__ void __launch_bounds__(256)                                                \
        dequant_f16_##name(const u8* w, u32* out, int rows, int cols) {                              \
        pdl_enter();                                                                                 \
        dequant_f16_body<T>(w, out, rows, cols);                                                     \
    }

FOR_EACH_TYPE(DEQUANT_F16_KERNEL)

// f32_to_f16(x, out, len4): out[i] = f16(x[i]) for i < 4 · len4 (rounded to nearest, as the GEMMs).
extern "C" __global__ __launch_bounds__(256) void f32_to_f16(const float4* __restrict__ x, uint2* __restrict__ out,
                                                            int len4) {
    pdl_enter();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= len4) return;
    const float4 v = x[i];
    out[i] = make_uint2(pack_f16x2(v.x, v.y), pack_f16x2(v.z, v.w));
}

// moe_group(ids, pairs_n, n_expert, off, pairs): the (token, choice) pairs p < pairs_n grouped by
// their expert ids[p]: off[e] = pairs of experts below e (off[n_expert] = pairs_n), and pairs[off[e]
// ..] the pairs of expert e (in no particular order: each pair's result does not depend on
// where it sits). n_expert <= 1024. Launch: grid = 1, block = 1024.
extern "C" __global__ void moe_group(const int* __restrict__ ids, int pairs_n, int n_expert,
                                     int* __restrict__ off, int* __restrict__ pairs) {
    pdl_enter();
    __shared__ int count[1024];
    __shared__ int base[1024];
    __shared__ int warp_total[32];
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
    count[tid] = 0;
    __syncthreads();
    for (int p = tid; p < pairs_n; p += blockDim.x) atomicAdd(&count[ids[p]], 1);
    __syncthreads();
    // Exclusive scan of count: within warps by shuffles, then over the warp totals.
    const int mine = count[tid];
    int incl = mine;
    for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += v;
    }
    if (lane == 31) warp_total[wid] = incl;
    __syncthreads();
    if (wid == 0) {
        int t = warp_total[lane];
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(0xffffffffu, t, o);
            if (lane >= o) t += v;
        }
        warp_total[lane] = t - warp_total[lane];  // exclusive
    }
    __syncthreads();
    const int start = warp_total[wid] + incl - mine;
    base[tid] = start;
    if (tid < n_expert) off[tid] = start;
    if (tid == n_expert - 1) off[n_expert] = start + mine;
    count[tid] = 0;
    __syncthreads();
    for (int p = tid; p < pairs_n; p += blockDim.x) {
        const int e = ids[p];
        pairs[base[e] + atomicAdd(&count[e], 1)] = p;
    }
}

// swiglu_pairs(gu, act, ff, len): act[p][j] = silu(gu[p][j]) · gu[p][ff + j] for the rows of
// moe_gemm's gate/up output (gate then up per pair). Launch: grid = ceil(len / 256), block = 256.
extern "C" __global__ void swiglu_pairs(const float* __restrict__ gu, float* __restrict__ act, int ff, int len) {
    pdl_enter();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= len) return;
    const int p = i / ff, j = i - p * ff;
    const float* row = gu + (size_t)p * 2 * ff;
    act[i] = siluf_(row[j]) * row[ff + j];
}

// moe_combine_pairs(x, down, weight, shared, gate_logit, hidden, k): the MoE block's residual of
// token t = blockIdx.y from the routed experts' per-pair outputs: x[t] += Σ_j weight[t k + j] ·
// down[t k + j] (in choice order) + sigmoid(gate_logit[t]) · shared[t].
// Launch: grid = (ceil(hidden / 256), tokens), block = 256.
extern "C" __global__ void moe_combine_pairs(float* __restrict__ x, const float* __restrict__ down,
                                             const float* __restrict__ weight, const float* __restrict__ shared,
                                             const float* __restrict__ gate_logit, int hidden, int k) {
    pdl_enter();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= hidden) return;
    const int t = blockIdx.y;
    float s = 0.0f;
    for (int j = 0; j < k; ++j) s += weight[t * k + j] * down[((size_t)t * k + j) * hidden + i];
    const size_t at = (size_t)t * hidden + i;
    x[at] += s + sigmoidf_(gate_logit[t]) * shared[at];
}

// gemm_f32_simt(w, x, y, rows, cols, n, accumulate): gemm_<type> for f32 weights (the MoE router)
// in plain f32 on the CUDA cores: the router's logits choose the experts, so they keep f32 inputs
// (only the summation order differs from the matvec). 64 rows × 64 tokens per block of 256
// threads, each thread 4 rows × 4 tokens; tiles of 16 columns staged k-major in shared memory.
// cols a multiple of 16. Launch: grid = (ceil(rows / 64), ceil(n / 64)), block = 256.
#define SIMT_BK 16
extern "C" __global__ __launch_bounds__(256) void gemm_f32_simt(const float* __restrict__ w,
                                                                const float* __restrict__ x,
                                                                float* __restrict__ y, int rows, int cols,
                                                                int n, int accumulate) {
    pdl_enter();
    __shared__ __align__(16) float ws[SIMT_BK][64 + 4];
    __shared__ __align__(16) float xs[SIMT_BK][64 + 4];
    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    const int r0 = blockIdx.x * 64, t0 = blockIdx.y * 64;
    // Loader: row (token) tid / 4 of the tile, columns 4 (tid % 4) .. + 3.
    const int lr = tid >> 2, lc = 4 * (tid & 3);
    const float* wp = r0 + lr < rows ? w + (size_t)(r0 + lr) * cols + lc : nullptr;
    const float* xp = t0 + lr < n ? x + (size_t)(t0 + lr) * cols + lc : nullptr;
    float acc[4][4] = {};
    for (int k0 = 0; k0 < cols; k0 += SIMT_BK) {
        const float4 a = wp ? *(const float4*)(wp + k0) : make_float4(0.f, 0.f, 0.f, 0.f);
        const float4 b = xp ? *(const float4*)(xp + k0) : make_float4(0.f, 0.f, 0.f, 0.f);
        __syncthreads();
        ws[lc][lr] = a.x, ws[lc + 1][lr] = a.y, ws[lc + 2][lr] = a.z, ws[lc + 3][lr] = a.w;
        xs[lc][lr] = b.x, xs[lc + 1][lr] = b.y, xs[lc + 2][lr] = b.z, xs[lc + 3][lr] = b.w;
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < SIMT_BK; ++kk) {
            const float4 wv = *(const float4*)&ws[kk][4 * ty];
            const float4 xv = *(const float4*)&xs[kk][4 * tx];
            const float wr[4] = {wv.x, wv.y, wv.z, wv.w}, xr[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(wr[i], xr[j], acc[i][j]);
        }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int t = t0 + 4 * tx + j;
        if (t >= n) continue;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int r = r0 + 4 * ty + i;
            if (r >= rows) continue;
            float* p = y + (size_t)t * rows + r;
            *p = accumulate ? *p + acc[i][j] : acc[i][j];
        }
    }
}
