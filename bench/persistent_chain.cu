// persistent_chain.cu: does a persistent decode kernel pay on this GPU? (#6, the structural lever;
// session 57's results are in docs/cuda.md and docs/perf-ledger.md)
//
// A synthetic decode step: L layers of dependent Q4_K matrix-vector stages whose row counts copy a
// Gated DeltaNet layer's bytes on the full-size layout (in-projections 12,352 rows, out-projection
// 4.7 MB, F32 router 4.2 MB, ten experts' gate/up 5.4 MB and down 2.7 MB, each as Q4_K rows of 2,048
// columns). Stage s reads samples spread over all of stage s − 1's output (x_index), so every stage
// waits for the whole one before it, as the model's stages do. The same row function runs in every
// form:
//
//   A  one launch a stage, captured in a CUDA graph with programmatic dependent launch: each block
//      starts its rows' lines into L2 before `griddepcontrol.wait` (redlite's launch chain today);
//   A3 the launch chain with B3's tagged data instead of the wait, every launch triggering the next at
//      once (only with PC_A3 set: slow);
//   B  one persistent kernel, one block an SM, the stages separated by a grid barrier (an arrival
//      counter); each block streams its rows of the next two stages into shared memory with bulk
//      copies (`cp.async.bulk`, mbarrier completion) while it waits and computes;
//   B0 the same persistent kernel reading its rows from global memory, starting the next stage's
//      lines into L2 before the barrier (the barrier alone, without the shared-memory stream);
//   B2 the persistent kernel with a byte ring (224,000 bytes an SM) instead of two stage buffers:
//      the next stages' rows stream in as far ahead as the ring allows, whatever their sizes;
//   B3 B's two-buffer stream without a barrier: outputs are (tag, value) 8-byte stores, and a
//      stage's blocks read their inputs until every value carries the stage before's tag;
//   B4 B3 reading its rows from global memory (L2 prefetch), B5 B3 with a ring of 8-row chunks.
// A, B2, B3, B4, B5 run again with the routed experts' stages fetched only after the router's (their
// rows depend on its top-k, as in the model).
//
// Layer patterns: the five matrix stages above (default); `tiny`, five stages of one row a block
// (a dependent stage's floor); `dn8`, a DeltaNet layer's eight stages as redlite runs them (norm,
// in-projections, a recurrence with a serial chain, out-projection, router, top-k, experts); `dn7`,
// dn8 with the norm folded into the in-projections; `dn7l`, dn7 with the head-local and
// expert-local hand-overs read as such by B3 / B4 (session 58).
//
// Two row functions: kind 0, Q4_K against f32 activations (block-wise dequantisation and FMAs,
// arithmetic like a plain kernel's), and kind 1, the row's bytes against int8 activations held in
// registers (dp4a: nearly free arithmetic, so a stage costs its memory and synchronisation alone).
//
// Every form's outputs are compared bit for bit (the same row function on the same inputs), and a
// few rows of the first stage against a reference on the host. Prints time a step, the stages' bytes
// over that time, and the read bandwidth measured in the same run. PC_EVICT_FIRST=1 marks the bulk
// copies L2 evict-first.
//
// Build (nvcc 12.4+ or 13): nvcc -O3 -arch=sm_90a -o persistent_chain bench/persistent_chain.cu
// Run: ./persistent_chain [layers=48] [reps=20] [tiny | dn8 | dn7 | dn7l]
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <vector>

#define CK(x)                                                                                      \
    do {                                                                                           \
        cudaError_t e_ = (x);                                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));    \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

constexpr int COLS = 2048;          // every stage's input width
constexpr int QK = 256;             // Q4_K block
constexpr int BB = 144;             // Q4_K block bytes
constexpr int RB = COLS / QK * BB;  // row bytes: 1,152
constexpr int WARP = 32;

struct Stage {
    const uint8_t* w;  // rows × RB bytes
    float* y;          // rows outputs
    const float* x;    // the input (the stage before's y, or x0)
    int rows;
    int in_rows;  // the stage before's rows (x_index samples them)
    int dep;      // its rows' addresses known only once stage `dep` is done (routed experts), or -1
    int delay;    // clock cycles every block spins once its input is in (a serial chain: the recurrence)
    unsigned long long* yl;        // mode B3: the outputs as (tag << 32 | value bits)
    const unsigned long long* xl;  // mode B3: the input (the stage before's yl), null for stage 0
    int group;  // modes B3 / B4 (`dn7l`): > 0, the input is only the stage before's rows of this block's
                // group of `group` consecutive blocks (a head's or an expert's own rows); 0 all of them
    int norm;   // modes B3 / B4 (`dn7`, `dn7l`): the block also sums its input's squares (the RMS norm
                // folded into the stage that reads it)
};

// ---------------------------------------------------------------------------------------------
// The row function: y = f(W_row · x), f(v) = v / (1 + |v|) (bounded over many stages). The warp
// walks the row's 8 Q4_K blocks; in each, lane l takes 4 bytes of qs, qs[32j + 4i .. + 4) with
// j = l / 8, i = l % 8: the low nibbles are weights 64j + 4i .. + 3 (sub-block 2j), the high ones
// 64j + 32 + 4i .. + 3 (sub-block 2j + 1), so a warp's x loads are 16 consecutive bytes a lane
// (no bank conflicts beyond the four chunks). `row` may point into global or shared memory.
__device__ __forceinline__ void scale_min(int k, uint32_t s0, uint32_t s1, uint32_t s2, float& sc, float& m) {
    auto byte = [&](int i) -> uint32_t {
        const uint32_t w = i < 4 ? s0 : (i < 8 ? s1 : s2);
        return (w >> (8 * (i & 3))) & 0xFF;
    };
    if (k < 4) {
        sc = (float)(byte(k) & 63);
        m = (float)(byte(k + 4) & 63);
    } else {
        sc = (float)((byte(k + 4) & 0xF) | ((byte(k - 4) >> 6) << 4));
        m = (float)((byte(k + 4) >> 4) | ((byte(k) >> 6) << 4));
    }
}

__device__ __forceinline__ float row_dot(const uint8_t* row, const float* xs, int lane) {
    const int j = lane >> 3, i0 = 4 * (lane & 7);
    float acc = 0.f;
#pragma unroll
    for (int b = 0; b < COLS / QK; ++b) {
        const uint8_t* blk = row + b * BB;
        const uint32_t dm = *(const uint32_t*)blk;
        const uint32_t s0 = *(const uint32_t*)(blk + 4), s1 = *(const uint32_t*)(blk + 8),
                       s2 = *(const uint32_t*)(blk + 12);
        const uint32_t q = *(const uint32_t*)(blk + 16 + 32 * j + i0);
        const float4 xa = *(const float4*)(xs + b * QK + 64 * j + i0);
        const float4 xb = *(const float4*)(xs + b * QK + 64 * j + 32 + i0);
        const float d = __half2float(__ushort_as_half((unsigned short)(dm & 0xFFFF)));
        const float dmin = __half2float(__ushort_as_half((unsigned short)(dm >> 16)));
        float sc0, m0, sc1, m1;
        scale_min(2 * j, s0, s1, s2, sc0, m0);
        scale_min(2 * j + 1, s0, s1, s2, sc1, m1);
        float slo = (float)(q & 0xF) * xa.x;
        slo = fmaf((float)((q >> 8) & 0xF), xa.y, slo);
        slo = fmaf((float)((q >> 16) & 0xF), xa.z, slo);
        slo = fmaf((float)((q >> 24) & 0xF), xa.w, slo);
        float shi = (float)((q >> 4) & 0xF) * xb.x;
        shi = fmaf((float)((q >> 12) & 0xF), xb.y, shi);
        shi = fmaf((float)((q >> 20) & 0xF), xb.z, shi);
        shi = fmaf((float)((q >> 28) & 0xF), xb.w, shi);
        const float xlo = (xa.x + xa.y) + (xa.z + xa.w), xhi = (xb.x + xb.y) + (xb.z + xb.w);
        acc += d * sc0 * slo - dmin * m0 * xlo + d * sc1 * shi - dmin * m1 * xhi;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    return acc / (1.0f + fabsf(acc));
}

constexpr int B_WARPS = 16;  // the persistent kernels' block: 16 warps, one block an SM
constexpr int B_THREADS = B_WARPS * WARP;

// The cheap row (kind 1): the row's 1,152 bytes as 72 16-byte words against 1,152 int8 activations
// (dp4a), lane l taking words l, l + 32, l + 64. The activations a lane needs are the same for every
// row, so they stay in registers: what a stage costs when its row arithmetic is nearly free (the
// memory and the synchronisation alone).
constexpr int RW = RB / 16;  // 72 words a row
struct XRegs {
    uint4 w[3];
};
__device__ __forceinline__ XRegs load_xregs(const void* xs, int lane) {
    XRegs r;
#pragma unroll
    for (int k = 0; k < 3; ++k) {
        const int i = lane + 32 * k;
        r.w[k] = i < RW ? ((const uint4*)xs)[i] : make_uint4(0, 0, 0, 0);
    }
    return r;
}
__device__ __forceinline__ float row_dot_q8(const uint8_t* row, const XRegs& x, int lane) {
    int acc = 0;
#pragma unroll
    for (int k = 0; k < 3; ++k) {
        const int i = lane + 32 * k;
        if (i < RW) {
            const uint4 w = ((const uint4*)row)[i];
            acc = __dp4a((int)w.x, (int)x.w[k].x, acc);
            acc = __dp4a((int)w.y, (int)x.w[k].y, acc);
            acc = __dp4a((int)w.z, (int)x.w[k].z, acc);
            acc = __dp4a((int)w.w, (int)x.w[k].w, acc);
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    const float v = (float)acc * (1.0f / 65536.0f);
    return v / (1.0f + fabsf(v));
}

// The stage's input in shared memory: kind 0 2,048 floats, kind 1 1,152 int8 values. Input i of n
// reads output i · in_rows / n of the stage before (or i % in_rows when it has fewer): samples
// spread over every block's rows, so each stage waits for the whole stage before it, as the
// model's (a matrix-vector product needs the whole vector).
__host__ __device__ __forceinline__ int x_index(int i, int n, int in_rows) {
    return in_rows >= n ? (int)((long long)i * in_rows / n) : i % in_rows;
}
template <int KIND>
__device__ __forceinline__ void put_x(float* xs, int i, float v) {
    if (KIND == 0)
        xs[i] = v;
    else
        ((int8_t*)xs)[i] = (int8_t)(int)(v * 127.f);
}
template <int KIND>
__device__ __forceinline__ void stage_x(float* xs, const float* x, int in_rows) {
    constexpr int N = KIND == 0 ? COLS : RB;
    for (int i = threadIdx.x; i < N; i += blockDim.x) put_x<KIND>(xs, i, x[x_index(i, N, in_rows)]);
}
// Mode B3's input: each value carries the tag of the stage that wrote it, so reading the data is
// the wait (no barrier, no flag before it): every thread loads its values, then loads again those
// whose tag is not `tag` yet.
template <int KIND, int THREADS>
__device__ __forceinline__ void stage_x_tagged_n(float* xs, const unsigned long long* xl, int in_rows,
                                                 unsigned tag, int* err) {
    constexpr int N = KIND == 0 ? COLS : RB;
    constexpr int B_THREADS = THREADS;
    constexpr int PER = (N + B_THREADS - 1) / B_THREADS;
    unsigned long long v[PER];
    bool ok[PER];
#pragma unroll
    for (int k = 0; k < PER; ++k) ok[k] = threadIdx.x + k * B_THREADS >= N;
    long long spins = 0;
    bool all;
    do {
#pragma unroll
        for (int k = 0; k < PER; ++k)
            if (!ok[k])
                asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];"
                             : "=l"(v[k])
                             : "l"(xl + x_index(threadIdx.x + k * B_THREADS, N, in_rows))
                             : "memory");
        all = true;
#pragma unroll
        for (int k = 0; k < PER; ++k) {
            if (!ok[k]) ok[k] = (unsigned)(v[k] >> 32) == tag;
            all = all && ok[k];
        }
        if (++spins > (1ll << 26)) {
            atomicExch(err, 2);
            break;
        }
    } while (!all);
#pragma unroll
    for (int k = 0; k < PER; ++k) {
        const int i = threadIdx.x + k * B_THREADS;
        if (i < N) put_x<KIND>(xs, i, __uint_as_float((unsigned)v[k]));
    }
}
template <int KIND>
__device__ __forceinline__ void stage_x_tagged(float* xs, const unsigned long long* xl, int in_rows, unsigned tag,
                                               int* err) {
    stage_x_tagged_n<KIND, B_THREADS>(xs, xl, in_rows, tag, err);
}
template <int KIND>
__device__ __forceinline__ float row_value(const uint8_t* row, const float* xs, const XRegs& xr, int lane) {
    if (KIND == 0) return row_dot(row, xs, lane);
    return row_dot_q8(row, xr, lane);
}

// A stage's own serial latency (the DeltaNet recurrence's chain), spun by every block after its input.
__device__ __forceinline__ void spin_cycles(int cycles) {
    if (cycles <= 0) return;
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {
    }
}

__device__ __forceinline__ void prefetch_rows_l2(const uint8_t* w, size_t bytes) {
    for (size_t o = (size_t)threadIdx.x * 128; o < bytes; o += (size_t)blockDim.x * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(w + o));
}

// ---------------------------------------------------------------------------------------------
// Mode A: one launch a stage (PDL). Block = 8 warps, 2 rows a warp.
constexpr int A_WARPS = 8, A_ROWS_PER_WARP = 2, A_ROWS = A_WARPS * A_ROWS_PER_WARP;

template <int KIND>
__global__ void __launch_bounds__(A_WARPS * WARP) stage_kernel(Stage st) {
    __shared__ float xs[COLS];
    const int r0 = blockIdx.x * A_ROWS;
    const int nr = min(A_ROWS, st.rows - r0);
    if (st.dep < 0) prefetch_rows_l2(st.w + (size_t)r0 * RB, (size_t)nr * RB);
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
    stage_x<KIND>(xs, st.x, st.in_rows);
    __syncthreads();
    spin_cycles(st.delay);
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const XRegs xr = load_xregs(xs, lane);
    for (int r = warp; r < nr; r += A_WARPS) {
        const float v = row_value<KIND>(st.w + (size_t)(r0 + r) * RB, xs, xr, lane);
        if (lane == 0) st.y[r0 + r] = v;
    }
}

// Mode A3: the launch chain with B3's tagged data instead of `griddepcontrol.wait`: each launch
// lets the next one start at once (`launch_dependents` first), starts its rows into L2, then reads
// its input until every value carries the stage before's tag. Tags: 2^31 | *epoch · 4096 + stage, the
// epoch bumped by the graph's first node every replay. (No deadlock: a launch starts only once every
// block of the one before has started, and those wait only on blocks that have started.)
__global__ void bump_epoch(unsigned* epoch) { *epoch += 1; }

template <int KIND>
__global__ void __launch_bounds__(A_WARPS * WARP) stage_kernel_tagged(Stage st, int s, const unsigned* epoch, int* err) {
    __shared__ float xs[COLS];
    asm volatile("griddepcontrol.launch_dependents;");
    const int r0 = blockIdx.x * A_ROWS;
    const int nr = min(A_ROWS, st.rows - r0);
    if (st.dep < 0) prefetch_rows_l2(st.w + (size_t)r0 * RB, (size_t)nr * RB);
    const unsigned e = 0x80000000u | *(volatile const unsigned*)epoch * 4096u;
    if (s == 0)
        stage_x<KIND>(xs, st.x, st.in_rows);
    else
        stage_x_tagged_n<KIND, A_WARPS * WARP>(xs, st.xl, st.in_rows, e + s - 1, err);
    __syncthreads();
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    spin_cycles(st.delay);
        const XRegs xr = load_xregs(xs, lane);
    for (int r = warp; r < nr; r += A_WARPS) {
        const float v = row_value<KIND>(st.w + (size_t)(r0 + r) * RB, xs, xr, lane);
        if (lane == 0) {
            const unsigned long long t = (unsigned long long)(e + s) << 32 | __float_as_uint(v);
            asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(st.yl + r0 + r), "l"(t) : "memory");
            st.y[r0 + r] = v;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Mode B / B0: one persistent kernel. Block b takes rows [b R / G, (b + 1) R / G) of each stage.
constexpr int B_MAX_ROWS = 96;  // rows a block at most (ceil(12,352 / 132) = 94)
constexpr int BUF = B_MAX_ROWS * RB;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void block_rows(int rows, int b, int g, int& r0, int& nr) {
    r0 = (int)((long long)rows * b / g);
    nr = (int)((long long)rows * (b + 1) / g) - r0;
}

// One bulk copy into shared memory, completing on mbarrier `bar` (shared addresses). With
// g_evict_first set, the weights go through L2 marked evict-first (they are read once a step), so the
// stream does not push the stages' small, hot outputs out of L2.
__device__ int g_evict_first;
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
    if (g_evict_first) {
        uint64_t pol;
        asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(
                dst),
            "l"(src), "r"(bytes), "r"(bar), "l"(pol)
            : "memory");
    } else {
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
            "l"(src), "r"(bytes), "r"(bar)
            : "memory");
    }
}

// Thread 0: stage s's rows of this block into buf with one mbarrier transaction.
__device__ __forceinline__ void issue_stage(const Stage& st, uint8_t* buf, uint64_t* bar, int chunk) {
    int r0, nr;
    block_rows(st.rows, blockIdx.x, gridDim.x, r0, nr);
    const uint32_t bytes = (uint32_t)nr * RB;
    const uint32_t b = smem_addr(bar);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(bytes) : "memory");
    const uint8_t* src = st.w + (size_t)r0 * RB;
    for (uint32_t o = 0; o < bytes; o += chunk) {
        const uint32_t n = min((uint32_t)chunk, bytes - o);
        bulk_copy(smem_addr(buf + o), src + o, n, b);
    }
}

__device__ __forceinline__ void wait_bar(uint64_t* bar, uint32_t parity) {
    const uint32_t b = smem_addr(bar);
    uint32_t done = 0;
    while (!done) {
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
            : "=r"(done)
            : "r"(b), "r"(parity)
            : "memory");
    }
}

// Thread 0: the block's first n mbarriers, each expecting one arrival (with its transaction bytes).
__device__ __forceinline__ void init_bars(uint64_t* bars, int n) {
    for (int k = 0; k < n; ++k) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&bars[k])));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// The rows of stage s this block computes: in buffer s & 1 of the two-buffer stream once their copy
// has landed (SMEM), or in global memory.
template <bool SMEM>
__device__ __forceinline__ const uint8_t* stage_rows(uint8_t* sm, uint64_t* bars, int s, const Stage& st, int r0) {
    if (!SMEM) return st.w + (size_t)r0 * RB;
    wait_bar(&bars[s & 1], (s >> 1) & 1);
    return sm + (size_t)(s & 1) * BUF;
}

// A persistent block's rows of stage s once its input is staged in xs (the barrier first: xs is
// whole), each value handed to out(row, value) by lane 0 of its warp.
template <bool SMEM, int KIND, typename Out>
__device__ __forceinline__ void compute_rows(uint8_t* sm, uint64_t* bars, int s, const Stage& st, int r0, int nr,
                                             const float* xs, Out out) {
    __syncthreads();
    spin_cycles(st.delay);
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const XRegs xr = load_xregs(xs, lane);
    const uint8_t* rows = stage_rows<SMEM>(sm, bars, s, st, r0);
    for (int r = warp; r < nr; r += B_WARPS) {
        const float v = row_value<KIND>(rows + (size_t)r * RB, xs, xr, lane);
        if (lane == 0) out(r0 + r, v);
    }
}

__device__ __forceinline__ void grid_arrive(unsigned* counter) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
    }
}

__device__ __forceinline__ void grid_wait(unsigned* counter, unsigned target, int* err) {
    if (threadIdx.x == 0) {
        unsigned v;
        long long spins = 0;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(counter) : "memory");
            if (++spins > (1ll << 28)) {
                atomicExch(err, 1);
                break;
            }
        } while (v < target);
    }
    __syncthreads();
}

template <bool SMEM, int KIND>
__global__ void __launch_bounds__(B_WARPS * WARP, 1)
    chain_persistent(const Stage* __restrict__ stages, int n, unsigned* counter, int* err, int chunk) {
    extern __shared__ __align__(128) uint8_t sm[];
    float* xs = (float*)(sm + 2 * BUF);
    uint64_t* bars = (uint64_t*)(sm + 2 * BUF + COLS * 4);
    const unsigned g = gridDim.x;
    if (SMEM) {
        if (threadIdx.x == 0) {
            init_bars(bars, 2);
            issue_stage(stages[0], sm, &bars[0], chunk);
            if (n > 1) issue_stage(stages[1], sm + BUF, &bars[1], chunk);
        }
        __syncthreads();
    }
    for (int s = 0; s < n; ++s) {
        const Stage st = stages[s];
        int r0, nr;
        block_rows(st.rows, blockIdx.x, g, r0, nr);
        if (!SMEM) prefetch_rows_l2(st.w + (size_t)r0 * RB, (size_t)nr * RB);
        if (s > 0) grid_wait(counter, (unsigned)s * g, err);
        stage_x<KIND>(xs, st.x, st.in_rows);
        compute_rows<SMEM, KIND>(sm, bars, s, st, r0, nr, xs, [&](int row, float v) { st.y[row] = v; });
        grid_arrive(counter);  // (its __syncthreads: every warp is done with this buffer and xs)
        if (SMEM && threadIdx.x == 0 && s + 2 < n) {
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            issue_stage(stages[s + 2], sm + (s & 1) * BUF, &bars[s & 1], chunk);
        }
    }
}

// Mode B2: the persistent kernel with a byte ring instead of two stage buffers: thread 0 keeps
// issuing the next stages' rows (in order, each stage's rows one contiguous segment, a segment
// that does not fit before the ring's end placed at its start) for as long as they fit, so the
// weights stream ahead by up to RING bytes whatever the stages' sizes. A stage with dep >= 0
// (the routed experts) is issued only once stage dep is done everywhere (its grid barrier).
constexpr int SLOTS = 16;
constexpr int RING = 224000;

struct RingState {
    int next, live, lo, hi;
};

__device__ __forceinline__ void ring_issue(RingState& r, const Stage* stages, int n, int done_all, int* seg,
                                           uint8_t* sm, uint64_t* bars) {
    while (r.next < n && r.live < SLOTS) {
        const Stage& st = stages[r.next];
        if (st.dep >= done_all) break;  // its rows are not known yet
        int r0, nr;
        block_rows(st.rows, blockIdx.x, gridDim.x, r0, nr);
        const int size = nr * RB;
        int p;
        if (r.live == 0) {
            r.lo = r.hi = 0;
            p = 0;
        } else if (r.hi > r.lo) {
            if (RING - r.hi >= size)
                p = r.hi;
            else if (r.lo >= size)
                p = 0;
            else
                break;
        } else {
            if (r.lo - r.hi >= size)
                p = r.hi;
            else
                break;
        }
        const int slot = r.next % SLOTS;
        seg[slot] = p;
        issue_stage(st, sm + p, &bars[slot], 1 << 20);
        r.hi = p + size;
        ++r.live;
        ++r.next;
    }
}

template <int KIND>
__global__ void __launch_bounds__(B_WARPS * WARP, 1)
    chain_ring(const Stage* __restrict__ stages, int n, unsigned* counter, int* err) {
    extern __shared__ __align__(128) uint8_t sm[];
    float* xs = (float*)(sm + RING);
    uint64_t* bars = (uint64_t*)(sm + RING + COLS * 4);
    int* seg = (int*)(bars + SLOTS);
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const unsigned g = gridDim.x;
    RingState r = {0, 0, 0, 0};  // thread 0's
    if (threadIdx.x == 0) {
        init_bars(bars, SLOTS);
        ring_issue(r, stages, n, 0, seg, sm, bars);
    }
    __syncthreads();
    for (int s = 0; s < n; ++s) {
        const Stage st = stages[s];
        int r0, nr;
        block_rows(st.rows, blockIdx.x, g, r0, nr);
        if (s > 0) {
            grid_wait(counter, (unsigned)s * g, err);
            if (threadIdx.x == 0) ring_issue(r, stages, n, s, seg, sm, bars);  // stages gated on s - 1
        }
        stage_x<KIND>(xs, st.x, st.in_rows);
        __syncthreads();
        spin_cycles(st.delay);
        const XRegs xr = load_xregs(xs, lane);
        wait_bar(&bars[s % SLOTS], (s / SLOTS) & 1);
        const uint8_t* rows = sm + seg[s % SLOTS];
        for (int k = warp; k < nr; k += B_WARPS) {
            const float v = row_value<KIND>(rows + (size_t)k * RB, xs, xr, lane);
            if (lane == 0) st.y[r0 + k] = v;
        }
        grid_arrive(counter);  // (its __syncthreads: every warp is done with the segment and xs)
        if (threadIdx.x == 0) {
            --r.live;
            if (r.live == 0)
                r.lo = r.hi = 0;
            else
                r.lo = seg[(s + 1) % SLOTS];
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            ring_issue(r, stages, n, s, seg, sm, bars);
        }
    }
}

// The RMS norm folded into a stage (`dn7`, `dn7l`): the block sums its staged input's squares (a
// warp sum each, then one warp over the warps' sums: one more block barrier). Only the norm's cost
// matters to the chain, so the sum is not applied; a store that never happens (a sum of squares is
// not negative) keeps the compiler from dropping it.
template <int KIND>
__device__ __forceinline__ void block_norm(const float* xs, float* sink) {
    constexpr int N = KIND == 0 ? COLS : RB;
    __shared__ float part[B_WARPS];
    __syncthreads();
    float ss = 0.f;
    for (int i = threadIdx.x; i < N; i += blockDim.x) {
        const float v = KIND == 0 ? xs[i] : (float)((const int8_t*)xs)[i];
        ss = fmaf(v, v, ss);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (threadIdx.x % WARP == 0) part[threadIdx.x / WARP] = ss;
    __syncthreads();
    if (threadIdx.x == 0) {
        float t = 0.f;
        for (int w = 0; w < B_WARPS; ++w) t += part[w];
        if (t < 0.f) sink[0] = t;  // never true: keeps the sum
    }
}

// Mode B3 (and B4: the same reading its rows from global memory, each stage's lines started into
// L2 before its wait, as B0): B's two-buffer weight stream with no grid barrier: a stage's outputs are written as
// (tag << 32 | value bits) with one 8-byte store each, and the next stage's blocks read them until
// every value they need carries this stage's tag (NCCL's low-latency protocol in one kernel). Tags
// are epoch + stage, the epoch new every launch. The outputs also go to y for the checks.
template <bool SMEM, int KIND>
__global__ void __launch_bounds__(B_WARPS * WARP, 1)
    chain_tagged(const Stage* __restrict__ stages, int n, int* err, unsigned epoch) {
    extern __shared__ __align__(128) uint8_t sm[];
    float* xs = (float*)(sm + 2 * BUF);
    uint64_t* bars = (uint64_t*)(sm + 2 * BUF + COLS * 4);
    if (SMEM && threadIdx.x == 0) {
        init_bars(bars, 2);
        issue_stage(stages[0], sm, &bars[0], 1 << 20);
        if (n > 1) issue_stage(stages[1], sm + BUF, &bars[1], 1 << 20);
    }
    __syncthreads();
    for (int s = 0; s < n; ++s) {
        const Stage st = stages[s];
        const int dep_next = s + 1 < n ? stages[s + 1].dep : -1;  // loaded before the wait
        int r0, nr;
        block_rows(st.rows, blockIdx.x, gridDim.x, r0, nr);
        if (!SMEM && st.dep < 0) prefetch_rows_l2(st.w + (size_t)r0 * RB, (size_t)nr * RB);
        if (s == 0) {
            stage_x<KIND>(xs, st.x, st.in_rows);
        } else if (st.group > 0) {
            // Only the rows the blocks of this block's group wrote in the stage before.
            const int g0 = blockIdx.x - blockIdx.x % st.group, g1 = min(g0 + st.group, (int)gridDim.x);
            int lo, hi, n0;
            block_rows(st.in_rows, g0, gridDim.x, lo, n0);
            block_rows(st.in_rows, g1, gridDim.x, hi, n0);
            stage_x_tagged<KIND>(xs, st.xl + lo, hi - lo, epoch + s - 1, err);
        } else {
            stage_x_tagged<KIND>(xs, st.xl, st.in_rows, epoch + s - 1, err);
        }
        if (st.norm) block_norm<KIND>(xs, st.y);
        // Stages whose rows the stage before chose (dep = s - 1: this stage and the next) are issued
        // now that this block has seen that stage's outputs.
        if (SMEM && threadIdx.x == 0 && s > 0) {
            if (st.dep == s - 1) issue_stage(st, sm + (s & 1) * BUF, &bars[s & 1], 1 << 20);
            if (dep_next == s - 1) issue_stage(stages[s + 1], sm + ((s + 1) & 1) * BUF, &bars[(s + 1) & 1], 1 << 20);
        }
        compute_rows<SMEM, KIND>(sm, bars, s, st, r0, nr, xs, [&](int row, float v) {
            const unsigned long long t = (unsigned long long)(epoch + s) << 32 | __float_as_uint(v);
            asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(st.yl + row), "l"(t) : "memory");
            st.y[row] = v;
        });
        __syncthreads();  // every warp is done with this buffer and xs
        if (SMEM && threadIdx.x == 0 && s + 2 < n) {
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            if (stages[s + 2].dep < 0) issue_stage(stages[s + 2], sm + (s & 1) * BUF, &bars[s & 1], 1 << 20);
        }
    }
}

// Mode B5: B3's tagged hand-over with the weights streamed in chunks of 8 rows through a ring of 24
// chunk slots (221,184 bytes), each with its own mbarrier: a warp waits only for the chunk that holds
// its row, so a stage's rows are computed as they land, and thread 0 refills the freed slots with
// the next chunks whatever stage they belong to (experts' chunks only once the router's outputs are
// seen).
constexpr int CH_ROWS = 8, CHB = CH_ROWS * RB, NCH = 24;

struct ChunkProducer {
    int stage, row;       // the next chunk: its stage and its first row within the block's rows
    long long issued;     // chunks issued so far
};

__device__ __forceinline__ void chunk_issue(ChunkProducer& p, long long consumed, const Stage* stages, int n,
                                            int done, uint8_t* ring, uint64_t* bars) {
    while (p.stage < n && p.issued - consumed < NCH) {
        const Stage& st = stages[p.stage];
        if (st.dep >= done) break;
        int r0, nr;
        block_rows(st.rows, blockIdx.x, gridDim.x, r0, nr);
        if (p.row >= nr) {
            ++p.stage;
            p.row = 0;
            continue;
        }
        const int k = min(CH_ROWS, nr - p.row);
        const int slot = (int)(p.issued % NCH);
        const uint32_t b = smem_addr(&bars[slot]), bytes = (uint32_t)k * RB;
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(bytes) : "memory");
        bulk_copy(smem_addr(ring + (size_t)slot * CHB), st.w + (size_t)(r0 + p.row) * RB, bytes, b);
        p.row += k;
        ++p.issued;
    }
}

template <int KIND>
__global__ void __launch_bounds__(B_WARPS * WARP, 1)
    chain_chunks(const Stage* __restrict__ stages, int n, int* err, unsigned epoch) {
    extern __shared__ __align__(128) uint8_t sm[];
    uint8_t* ring = sm;
    float* xs = (float*)(sm + NCH * CHB);
    uint64_t* bars = (uint64_t*)(sm + NCH * CHB + COLS * 4);
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    ChunkProducer p = {0, 0, 0};  // thread 0's
    long long gbase = 0;          // the global index of this stage's first chunk
    if (threadIdx.x == 0) {
        init_bars(bars, NCH);
        chunk_issue(p, 0, stages, n, 0, ring, bars);
    }
    __syncthreads();
    for (int s = 0; s < n; ++s) {
        const Stage st = stages[s];
        int r0, nr;
        block_rows(st.rows, blockIdx.x, gridDim.x, r0, nr);
        if (s == 0)
            stage_x<KIND>(xs, st.x, st.in_rows);
        else
            stage_x_tagged<KIND>(xs, st.xl, st.in_rows, epoch + s - 1, err);
        if (threadIdx.x == 0 && s > 0) chunk_issue(p, gbase, stages, n, s, ring, bars);  // gated chunks
        __syncthreads();
        spin_cycles(st.delay);
        const XRegs xr = load_xregs(xs, lane);
        for (int r = warp; r < nr; r += B_WARPS) {
            const long long g = gbase + r / CH_ROWS;
            const int slot = (int)(g % NCH);
            wait_bar(&bars[slot], (uint32_t)((g / NCH) & 1));
            const float v = row_value<KIND>(ring + (size_t)slot * CHB + (size_t)(r % CH_ROWS) * RB, xs, xr, lane);
            if (lane == 0) {
                const unsigned long long t = (unsigned long long)(epoch + s) << 32 | __float_as_uint(v);
                asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(st.yl + r0 + r), "l"(t) : "memory");
                st.y[r0 + r] = v;
            }
        }
        gbase += (nr + CH_ROWS - 1) / CH_ROWS;
        __syncthreads();  // every warp is done with this stage's chunks and xs
        if (threadIdx.x == 0) {
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            chunk_issue(p, gbase, stages, n, s, ring, bars);
        }
    }
}

// ---------------------------------------------------------------------------------------------
__global__ void read_sum(const uint4* p, size_t n, unsigned* out) {
    unsigned acc = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const uint4 v = p[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) *out = acc;
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint32_t rnd() {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 11);
}

static float half_bits_to_float(uint16_t h) {
    __half_raw r;
    r.x = h;
    return __half2float(__half(r));
}

static double host_row(const uint8_t* row, const float* x) {
    double acc = 0;
    for (int b = 0; b < COLS / QK; ++b) {
        const uint8_t* blk = row + b * BB;
        const double d = half_bits_to_float(*(const uint16_t*)blk), dmin = half_bits_to_float(*(const uint16_t*)(blk + 2));
        const uint8_t* q = blk + 4;
        for (int j = 0; j < 8; ++j) {
            int sc, m;
            if (j < 4) {
                sc = q[j] & 63;
                m = q[j + 4] & 63;
            } else {
                sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
                m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
            }
            for (int i = 0; i < 32; ++i) {
                const uint8_t byte = blk[16 + 32 * (j / 2) + i];
                const int qv = (j % 2 == 0) ? (byte & 0xF) : (byte >> 4);
                acc += (d * sc * qv - dmin * m) * x[b * QK + 32 * j + i];
            }
        }
    }
    return acc / (1.0 + fabs(acc));
}

// The cheap row on the host: the same integer sum and the same float operations, so the same bits.
static float host_row_q8(const uint8_t* row, const float* x) {
    long long acc = 0;
    for (int i = 0; i < RB; ++i) acc += (long long)(int8_t)row[i] * (int8_t)(int)(x[x_index(i, RB, COLS)] * 127.f);
    const float v = (float)(int)acc * (1.0f / 65536.0f);
    return v / (1.0f + fabsf(v));
}

// B3's tag base: unique across every launch of the run (A3's tags have the top bit set).
static unsigned g_epoch = 1;

struct Ctx {
    int layers, reps, sms, ns;
    bool local;  // dn7l: B3 / B4 read grouped inputs (their outputs compare with B3's, not A's)
    std::vector<int> layer;
    std::vector<Stage> st, st_dep;  // st: every stage's rows known ahead; st_dep: the experts' after the router
    Stage* dst;
    Stage* dst_dep;
    unsigned* counter;
    unsigned* epoch;
    int* err;
    cudaStream_t stream;
    cudaEvent_t e0, e1;
    double bw_ref;
    size_t wbytes;
    std::vector<uint8_t> first_rows;
    std::vector<float> hx;
};

static std::vector<const char*> STAGE_NAMES = {"in-projections", "out-projection", "router-sized",
                                               "experts gate/up-sized", "experts down-sized"};

// Mode A's launch configuration for a stage of `rows` rows, with programmatic dependent launch when
// `pdl` (used in place: cfg points at at).
struct StageLaunch {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute at[1];
    StageLaunch(int rows, cudaStream_t stream, bool pdl) {
        cfg.gridDim = dim3((rows + A_ROWS - 1) / A_ROWS);
        cfg.blockDim = dim3(A_WARPS * WARP);
        cfg.stream = stream;
        at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        at[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = at;
        cfg.numAttrs = pdl ? 1 : 0;
    }
};

static cudaGraphExec_t chain_graph(Ctx& c, void (*kernel)(Stage), const std::vector<const Stage*>& stages) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(c.stream, cudaStreamCaptureModeGlobal));
    for (const Stage* s : stages) {
        StageLaunch l(s->rows, c.stream, true);
        CK(cudaLaunchKernelEx(&l.cfg, kernel, *s));
    }
    CK(cudaStreamEndCapture(c.stream, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    CK(cudaGraphDestroy(g));
    return ge;
}

template <typename F>
static float time_it(Ctx& c, F launch) {
    for (int i = 0; i < 3; ++i) launch();
    CK(cudaStreamSynchronize(c.stream));
    std::vector<float> t;
    for (int i = 0; i < c.reps; ++i) {
        CK(cudaEventRecord(c.e0, c.stream));
        launch();
        CK(cudaEventRecord(c.e1, c.stream));
        CK(cudaEventSynchronize(c.e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, c.e0, c.e1));
        t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

template <int KIND>
static void run_kind(Ctx& c) {
    if (c.local) printf("\n(dn7l: B3 and B4 read grouped inputs; their outputs are compared with the first B3 run's)");
    printf("\n=== row function: %s\n",
           KIND == 0 ? "Q4_K against f32 activations (block-wise dequantisation, FMAs)"
                     : "bytes against int8 activations (dp4a: nearly free arithmetic)");
    const int ns = c.ns;
    std::vector<const Stage*> all;
    for (auto& s : c.st) all.push_back(&s);
    cudaGraphExec_t ga = chain_graph(c, stage_kernel<KIND>, all);
    std::vector<float> ref_out(16384), out(16384);
    auto last_output = [&](std::vector<float>& v) {
        CK(cudaMemcpy(v.data(), c.st[ns - 1].y, c.st[ns - 1].rows * 4, cudaMemcpyDeviceToHost));
    };
    // Stage 0 alone against the host (every 97th row), then the chain's output as the reference.
    {
        stage_kernel<KIND><<<(c.st[0].rows + A_ROWS - 1) / A_ROWS, A_WARPS * WARP, 0, c.stream>>>(c.st[0]);
        CK(cudaStreamSynchronize(c.stream));
        std::vector<float> y0(c.st[0].rows);
        CK(cudaMemcpy(y0.data(), c.st[0].y, c.st[0].rows * 4, cudaMemcpyDeviceToHost));
        double worst = 0;
        for (int r = 0; r < c.st[0].rows; r += 97) {
            const double want = KIND == 0 ? host_row(&c.first_rows[(size_t)r * RB], c.hx.data())
                                          : host_row_q8(&c.first_rows[(size_t)r * RB], c.hx.data());
            worst = fmax(worst, fabs(want - y0[r]));
        }
        const double tol = KIND == 0 ? 1e-3 : 0.0;
        printf("stage 0 against the host (every 97th row): max |diff| %.3g %s\n", worst,
               worst <= tol ? "ok" : "FAILED");
        CK(cudaGraphLaunch(ga, c.stream));
        CK(cudaStreamSynchronize(c.stream));
        last_output(ref_out);
    }
    std::vector<float> ref_local;  // dn7l: the first grouped run's output, for the other grouped runs
    auto report = [&](const char* what, float ms, bool grouped = false) {
        last_output(out);
        if (grouped && ref_local.empty()) ref_local = out;
        const std::vector<float>& ref = grouped ? ref_local : ref_out;
        const bool same = memcmp(out.data(), ref.data(), c.st[ns - 1].rows * 4) == 0;
        const double gbs = c.wbytes / (ms * 1e-3);
        printf("%-44s %8.3f ms a step  %6.2f us a layer  %5.0f GB/s (%4.1f %% of the reference)  outputs %s\n", what,
               ms, ms * 1e3 / c.layers, gbs / 1e9, 100.0 * gbs / c.bw_ref, same ? "identical" : "DIFFER");
        fflush(stdout);
    };
    report("A  launch a stage, PDL, graph", time_it(c, [&] { CK(cudaGraphLaunch(ga, c.stream)); }));

    const size_t smem_b = 2 * BUF + COLS * 4 + 16;
    CK(cudaFuncSetAttribute(chain_persistent<true, KIND>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem_b));
    CK(cudaFuncSetAttribute(chain_persistent<false, KIND>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem_b));
    int occ = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, chain_persistent<true, KIND>, B_WARPS * WARP, smem_b));
    if (occ < 1) {
        printf("persistent kernel cannot be resident (%d blocks an SM)\n", occ);
        return;
    }
    auto run_b = [&](bool smem, int chunk) {
        CK(cudaMemsetAsync(c.counter, 0, 4, c.stream));
        void* args[] = {(void*)&c.dst, (void*)&c.ns, (void*)&c.counter, (void*)&c.err, (void*)&chunk};
        void* f = smem ? (void*)chain_persistent<true, KIND> : (void*)chain_persistent<false, KIND>;
        CK(cudaLaunchCooperativeKernel(f, c.sms, B_WARPS * WARP, args, smem_b, c.stream));
    };
    for (int chunk : {1 << 20, 16384}) {
        char what[96];
        snprintf(what, sizeof what, "B  persistent, smem stream (chunk %d B)", chunk);
        report(what, time_it(c, [&] { run_b(true, chunk); }));
    }
    report("B0 persistent, L2 prefetch, no smem", time_it(c, [&] { run_b(false, 0); }));
    const size_t smem_r = RING + COLS * 4 + SLOTS * 8 + SLOTS * 4;
    CK(cudaFuncSetAttribute(chain_ring<KIND>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem_r));
    auto run_r = [&](bool dep) {
        CK(cudaMemsetAsync(c.counter, 0, 4, c.stream));
        Stage* d = dep ? c.dst_dep : c.dst;
        void* args[] = {(void*)&d, (void*)&c.ns, (void*)&c.counter, (void*)&c.err};
        CK(cudaLaunchCooperativeKernel((void*)chain_ring<KIND>, c.sms, B_WARPS * WARP, args, smem_r, c.stream));
    };
    report("B2 persistent, smem byte ring", time_it(c, [&] { run_r(false); }));
    // The experts' rows only after the router's stage, in both forms.
    {
        std::vector<const Stage*> alld;
        for (auto& st : c.st_dep) alld.push_back(&st);
        cudaGraphExec_t gd = chain_graph(c, stage_kernel<KIND>, alld);
        report("A  (experts' rows after the router)", time_it(c, [&] { CK(cudaGraphLaunch(gd, c.stream)); }));
        CK(cudaGraphExecDestroy(gd));
        report("B2 (experts' rows after the router)", time_it(c, [&] { run_r(true); }));
    }
    CK(cudaFuncSetAttribute(chain_tagged<true, KIND>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem_b));
    CK(cudaFuncSetAttribute(chain_tagged<false, KIND>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem_b));
    auto run_t = [&](bool smem, bool dep) {
        const unsigned e = g_epoch;
        g_epoch += c.ns + 2;
        Stage* d = dep ? c.dst_dep : c.dst;
        void* args[] = {(void*)&d, (void*)&c.ns, (void*)&c.err, (void*)&e};
        void* f = smem ? (void*)chain_tagged<true, KIND> : (void*)chain_tagged<false, KIND>;
        CK(cudaLaunchCooperativeKernel(f, c.sms, B_WARPS * WARP, args, smem_b, c.stream));
    };
    const bool gr = c.local;
    report("B3 persistent, smem stream, tagged data", time_it(c, [&] { run_t(true, false); }), gr);
    report("B3 (experts' rows after the router)", time_it(c, [&] { run_t(true, true); }), gr);
    report("B4 persistent, L2 prefetch, tagged data", time_it(c, [&] { run_t(false, false); }), gr);
    report("B4 (experts' rows after the router)", time_it(c, [&] { run_t(false, true); }), gr);
    const size_t smem_c = (size_t)NCH * CHB + COLS * 4 + NCH * 8;
    CK(cudaFuncSetAttribute(chain_chunks<KIND>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem_c));
    auto run_c = [&](bool dep) {
        const unsigned e = g_epoch;
        g_epoch += c.ns + 2;
        Stage* d = dep ? c.dst_dep : c.dst;
        void* args[] = {(void*)&d, (void*)&c.ns, (void*)&c.err, (void*)&e};
        CK(cudaLaunchCooperativeKernel((void*)chain_chunks<KIND>, c.sms, B_WARPS * WARP, args, smem_c, c.stream));
    };
    report("B5 persistent, chunk ring, tagged data", time_it(c, [&] { run_c(false); }));
    report("B5 (experts' rows after the router)", time_it(c, [&] { run_c(true); }));
    int terr = 0;
    CK(cudaMemcpy(&terr, c.err, 4, cudaMemcpyDeviceToHost));
    if (terr) printf("A WAIT TIMED OUT (%d)\n", terr);
    // A3 (slow: blocks spinning beside the kernel they wait for) only with PC_A3 set.
    for (int dep = 0; getenv("PC_A3") != nullptr && dep < 2; ++dep) {
        const std::vector<Stage>& v = dep ? c.st_dep : c.st;
        cudaGraph_t g;
        cudaGraphExec_t ge;
        CK(cudaStreamBeginCapture(c.stream, cudaStreamCaptureModeGlobal));
        bump_epoch<<<1, 1, 0, c.stream>>>(c.epoch);
        for (int k = 0; k < c.ns; ++k) {
            StageLaunch l(v[k].rows, c.stream, k > 0);
            CK(cudaLaunchKernelEx(&l.cfg, stage_kernel_tagged<KIND>, v[k], k, (const unsigned*)c.epoch, c.err));
        }
        CK(cudaStreamEndCapture(c.stream, &g));
        CK(cudaGraphInstantiate(&ge, g, 0));
        CK(cudaGraphDestroy(g));
        report(dep ? "A3 (experts' rows after the router)" : "A3 launch chain, early trigger, tagged data",
               time_it(c, [&] { CK(cudaGraphLaunch(ge, c.stream)); }));
        CK(cudaGraphExecDestroy(ge));
    }
    int herr = 0;
    CK(cudaMemcpy(&herr, c.err, 4, cudaMemcpyDeviceToHost));
    if (herr) printf("GRID BARRIER TIMED OUT (not all blocks resident?)\n");
    CK(cudaGraphExecDestroy(ga));

    // Mode A, one stage kind repeated: each kind's time a launch in a chain of its own.
    printf("mode A, one stage kind repeated (time a launch in a chain of %d):\n", c.layers);
    for (size_t k = 0; k < c.layer.size(); ++k) {
        std::vector<const Stage*> one;
        for (int l = 0; l < c.layers; ++l) one.push_back(&c.st[l * c.layer.size() + k]);
        cudaGraphExec_t ge = chain_graph(c, stage_kernel<KIND>, one);
        const float t = time_it(c, [&] { CK(cudaGraphLaunch(ge, c.stream)); });
        const double bytes = (double)c.layer[k] * RB;
        printf("  %-24s %6d rows %6.2f MB  %6.2f us a launch (%5.2f us of bytes at the reference)  %5.0f GB/s\n",
               STAGE_NAMES[k], c.layer[k], bytes / 1e6, t * 1e3 / c.layers, bytes / c.bw_ref * 1e6,
               bytes / (t * 1e-3 / c.layers) / 1e9);
        CK(cudaGraphExecDestroy(ge));
    }
}


int main(int argc, char** argv) {
    Ctx c;
    c.layers = argc > 1 ? atoi(argv[1]) : 48;
    c.reps = argc > 2 ? atoi(argv[2]) : 20;
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    c.sms = prop.multiProcessorCount;
    printf("device: %s, %d SMs, %.0f KiB shared memory a block at most\n", prop.name, c.sms,
           prop.sharedMemPerBlockOptin / 1024.0);

    // One layer's stages (rows of 2,048 Q4_K columns with about the model's bytes).
    // `tiny`: one row a block everywhere (132 rows on an H100), so a stage costs its synchronisation,
    // its input's trip through L2 and one row: the floor of a dependent stage in each form.
    // `dn8`: a DeltaNet layer's eight dependent stages as redlite runs them: the norm (one row a
    // block), the in-projections, the recurrence (the DeltaNet state's bytes and a serial chain of
    // `delay` cycles a block, ≈ 4 µs), the out-projection, the router, its top-k (one row a block),
    // the experts' gate/up and down (their rows chosen by the top-k).
    const bool tiny = argc > 3 && strcmp(argv[3], "tiny") == 0;
    const bool dn8 = argc > 3 && strcmp(argv[3], "dn8") == 0;
    // `dn7`: dn8 with the norm folded into the in-projections (each block sums its input's squares);
    // `dn7l`: dn7 with the two hand-overs that need only a slice of the stage before read as such in
    // B3 / B4: the recurrence of a head reads only its head's in-projection rows (groups of 4 blocks:
    // 132 SMs over 32 heads) and an expert's down rows only its gate/up rows (groups of 13 blocks: ten
    // experts). The launch chain and the barrier forms still wait for the whole stage before, and only
    // B3 / B4 pay the folded norm's sums (the other forms simply lose dn8's norm stage).
    const bool dn7 = argc > 3 && strcmp(argv[3], "dn7") == 0;
    const bool dn7l = argc > 3 && strcmp(argv[3], "dn7l") == 0;
    std::vector<int> delay, dep_of, group, norm;
    if (tiny) {
        c.layer = std::vector<int>(5, c.sms);
        dep_of = {-1, -1, -1, 2, 2};
    } else if (dn8) {
        c.layer = {c.sms, 12352, 4096, 4096, 3648, c.sms, 4704, 2352};
        delay = {0, 0, 7000, 0, 0, 0, 0, 0};
        dep_of = {-1, -1, -1, -1, -1, -1, 5, 5};
        STAGE_NAMES = {"norm (a row a block)", "in-projections", "recurrence-sized", "out-projection",
                       "router-sized", "top-k (a row a block)", "experts gate/up-sized", "experts down-sized"};
    } else if (dn7 || dn7l) {
        c.layer = {12352, 4096, 4096, 3648, c.sms, 4704, 2352};
        delay = {0, 7000, 0, 0, 0, 0, 0};
        dep_of = {-1, -1, -1, -1, -1, 4, 4};
        norm = {1, 0, 0, 0, 0, 0, 0};
        if (dn7l) group = {0, 4, 0, 0, 0, 0, 13};
        STAGE_NAMES = {"norm + in-projections", "recurrence-sized", "out-projection", "router-sized",
                       "top-k (a row a block)", "experts gate/up-sized", "experts down-sized"};
    } else {
        c.layer = {12352, 4096, 3648, 4704, 2352};
        dep_of = {-1, -1, -1, 2, 2};
    }
    c.local = dn7l;
    delay.resize(c.layer.size(), 0);
    group.resize(c.layer.size(), 0);
    norm.resize(c.layer.size(), 0);
    c.ns = c.layers * (int)c.layer.size();
    size_t total_rows = 0;
    for (int r : c.layer) total_rows += r;
    const size_t layer_bytes = total_rows * RB;
    // Distinct weights for every stage of the step (as the model: nothing is reused within a step).
    c.wbytes = layer_bytes * c.layers;
    printf("layers %d, %d stages, %.1f MB a layer, %.1f MB a step\n", c.layers, c.ns, layer_bytes / 1e6,
           c.wbytes / 1e6);
    std::vector<uint8_t> hw(layer_bytes);
    uint8_t* dw;
    CK(cudaMalloc(&dw, c.wbytes));
    // Random bytes with small finite d, dmin (the values do not matter for timing; they stay finite).
    for (int l = 0; l < c.layers; ++l) {
        for (size_t i = 0; i < layer_bytes; i += 4) {
            const uint32_t v = rnd();
            memcpy(&hw[i], &v, 4);
        }
        for (size_t r = 0; r < total_rows; ++r) {
            for (int b = 0; b < COLS / QK; ++b) {
                uint8_t* blk = &hw[r * RB + b * BB];
                const uint16_t d = __half_as_ushort(__float2half(0.001f * (1 + rnd() % 16)));
                const uint16_t m = __half_as_ushort(__float2half(0.0005f * (1 + rnd() % 16)));
                memcpy(blk, &d, 2);
                memcpy(blk + 2, &m, 2);
            }
        }
        CK(cudaMemcpy(dw + l * layer_bytes, hw.data(), layer_bytes, cudaMemcpyHostToDevice));
    }
    c.first_rows.resize(layer_bytes);  // layer 0's bytes, for the host checks
    CK(cudaMemcpy(c.first_rows.data(), dw, layer_bytes, cudaMemcpyDeviceToHost));

    float *x0, *ybuf[2];
    unsigned long long* ylbuf[2];
    CK(cudaMalloc(&ylbuf[0], 16384 * 8));
    CK(cudaMalloc(&ylbuf[1], 16384 * 8));
    CK(cudaMemset(ylbuf[0], 0, 16384 * 8));
    CK(cudaMemset(ylbuf[1], 0, 16384 * 8));
    CK(cudaMalloc(&x0, COLS * 4));
    CK(cudaMalloc(&ybuf[0], 16384 * 4));
    CK(cudaMalloc(&ybuf[1], 16384 * 4));
    c.hx.resize(COLS);
    for (auto& v : c.hx) v = ((int)(rnd() % 2001) - 1000) / 1000.0f;
    CK(cudaMemcpy(x0, c.hx.data(), COLS * 4, cudaMemcpyHostToDevice));

    c.st.resize(c.ns);
    size_t off = 0;
    for (int s = 0; s < c.ns; ++s) {
        const int rows = c.layer[s % c.layer.size()];
        c.st[s].w = dw + off;
        off += (size_t)rows * RB;
        c.st[s].rows = rows;
        c.st[s].y = ybuf[s & 1];
        c.st[s].x = s == 0 ? x0 : ybuf[(s - 1) & 1];
        c.st[s].in_rows = s == 0 ? COLS : c.st[s - 1].rows;
        c.st[s].dep = -1;
        c.st[s].delay = delay[s % c.layer.size()];
        c.st[s].yl = ylbuf[s & 1];
        c.st[s].xl = s == 0 ? nullptr : ylbuf[(s - 1) & 1];
        c.st[s].group = group[s % c.layer.size()];
        c.st[s].norm = norm[s % c.layer.size()];
    }
    // The routed experts' stages (kinds 3 and 4) read rows chosen by the router (kind 2).
    c.st_dep = c.st;
    for (int s = 0; s < c.ns; ++s) {
        const int k = s % (int)c.layer.size();
        if (dep_of[k] >= 0) c.st_dep[s].dep = s - (k - dep_of[k]);
    }
    CK(cudaMalloc(&c.dst, c.ns * sizeof(Stage)));
    CK(cudaMemcpy(c.dst, c.st.data(), c.ns * sizeof(Stage), cudaMemcpyHostToDevice));
    CK(cudaMalloc(&c.dst_dep, c.ns * sizeof(Stage)));
    CK(cudaMemcpy(c.dst_dep, c.st_dep.data(), c.ns * sizeof(Stage), cudaMemcpyHostToDevice));
    CK(cudaMalloc(&c.counter, 4));
    CK(cudaMalloc(&c.err, 4));
    CK(cudaMalloc(&c.epoch, 4));
    CK(cudaMemset(c.epoch, 0, 4));
    CK(cudaMemset(c.err, 0, 4));
    CK(cudaStreamCreateWithFlags(&c.stream, cudaStreamNonBlocking));
    CK(cudaEventCreate(&c.e0));
    CK(cudaEventCreate(&c.e1));

    // The read bandwidth reference (1 GiB, as redlite's read_sum).
    {
        const size_t n = (1ull << 30) / 16;
        uint4* big;
        unsigned* o;
        CK(cudaMalloc(&big, n * 16));
        CK(cudaMalloc(&o, 4));
        CK(cudaMemset(big, 1, n * 16));
        float best = 1e9f;
        for (int i = 0; i < 6; ++i) {
            CK(cudaEventRecord(c.e0, c.stream));
            read_sum<<<c.sms * 8, 512, 0, c.stream>>>(big, n, o);
            CK(cudaEventRecord(c.e1, c.stream));
            CK(cudaEventSynchronize(c.e1));
            float ms;
            CK(cudaEventElapsedTime(&ms, c.e0, c.e1));
            if (i > 0 && ms < best) best = ms;
        }
        c.bw_ref = (n * 16) / (best * 1e-3);
        printf("read bandwidth reference: %.0f GB/s (1 GiB, best of 5)\n", c.bw_ref / 1e9);
        CK(cudaFree(big));
        CK(cudaFree(o));
    }
    const int ef = getenv("PC_EVICT_FIRST") != nullptr;
    CK(cudaMemcpyToSymbol(g_evict_first, &ef, sizeof ef));
    if (ef) printf("bulk copies marked L2 evict-first\n");
    run_kind<0>(c);
    run_kind<1>(c);
    CK(cudaDeviceSynchronize());
    return 0;
}
