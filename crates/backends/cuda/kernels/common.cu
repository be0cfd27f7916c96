// redlite CUDA kernels: helpers shared by every family.
//
// The sources are compiled by NVRTC at start-up without the CUDA include tree, so nothing here
// includes a header: the integer types, the f16 conversion and the reductions are written out.
// Every kernel file is concatenated after this one into a single module.

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define WARP 32
#define NEG_INF __int_as_float(0xff800000)

// IEEE half (as stored in GGUF) to f32, through the hardware conversion.
__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// bfloat16 to f32: the top half of the f32 bit pattern.
__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }

// Little-endian loads. Every block size of the type table is even and every 16-bit field sits at
// an even offset, so in a weight buffer (allocations are aligned) 16-bit fields are 2-byte aligned
// and read with one load; 32-bit fields are only 2-byte aligned (e.g. IQ2_XXS, 66-byte blocks),
// so they take two.
__device__ __forceinline__ u16 ld_u16(const u8* p) { return *(const u16*)p; }
__device__ __forceinline__ u32 ld_u32(const u8* p) { return (u32)ld_u16(p) | ((u32)ld_u16(p + 2) << 16); }
__device__ __forceinline__ float ld_f16(const u8* p) { return f16_to_f32(ld_u16(p)); }

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = WARP / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the whole thread block (blockDim.x a multiple of 32, at most 1024). Every thread gets
// the result. `scratch` holds at least 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP, nw = blockDim.x / WARP;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[wid] = v;
    __syncthreads();
    v = lane < nw ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP, nw = blockDim.x / WARP;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[wid] = v;
    __syncthreads();
    v = lane < nw ? scratch[lane] : NEG_INF;
    return warp_max(v);
}

// Programmatic dependent launch (sm_90+). The host may launch a kernel before the one ahead of it
// in the stream has finished (REDLITE_CUDA_PDL); every kernel calls pdl_enter() before it reads
// anything an earlier kernel wrote or writes anything an earlier kernel reads: it waits there
// until the earlier grid has completed and its writes are visible, then lets the next kernel
// launch (its blocks take free SM slots and run their own prologue meanwhile). Work that reads
// only the weights or constant tables (L2 prefetch, staging the IQ tables) may come before it.
// Without the launch attribute, and before sm_90, both instructions are no-ops. The
// `pdl_coverage` test checks that every kernel reaches pdl_enter().
__device__ __forceinline__ void pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// KNOBS_FIXED (compile-time, default 1 since session 33): every run-time knob (`g_knob_*`, set
// from the environment after the module loads) read as its default, 1, so that the compiler drops
// the other forms' code (the fused route kernel 7,704 -> 6,712 SASS instructions, NVRTC 13.0).
// The same values: the defaults' paths. H200, session 33 run 8: decode +0.6 % (408.52 against
// 405.94 tok/s, three alternating rounds; full-size logits bit-identical). The knobs' variables
// act again only with REDLITE_CUDA_DEFINES=KNOBS_FIXED=0 (kernels.rs warns).
#ifndef KNOBS_FIXED
#define KNOBS_FIXED 1
#endif
#define KNOB_ON(k) (KNOBS_FIXED || (k))

// REDLITE_CUDA_SYNC_RELEASE (set from the host after the module loads; default 1): grid_sync's
// arrival as one release atomic and no sequentially consistent fences (the form of CUTLASS's
// generic barrier: the block's writes, a CTA barrier, thread 0's release add; thread 0's acquire
// loads, a CTA barrier, the block's reads) instead of __threadfence (MEMBAR.SC.GPU) on both sides.
__constant__ int g_knob_sync;

// grid_sync(counter, blocks): a barrier over the whole grid, for a kernel whose blocks are all
// resident at once (the host checks the occupancy). `counter` only ever grows: block arrivals
// are counted, and a launch of B blocks adds B per barrier, so a barrier's target is the next
// multiple of B above a block's own arrival. Every thread calls it; the writes of every block
// before it are visible to every block after it (fence, then the count; acquire loads).
__device__ __forceinline__ void grid_sync(unsigned long long* counter, unsigned blocks) {
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned long long old;
        if (KNOB_ON(g_knob_sync)) {
            asm volatile("atom.add.release.gpu.global.u64 %0, [%1], 1;" : "=l"(old) : "l"(counter) : "memory");
        } else {
            __threadfence();
            old = atomicAdd(counter, 1ull);
        }
        const unsigned long long target = (old / blocks + 1) * blocks;
        unsigned long long now;
        do {
            asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(now) : "l"(counter) : "memory");
        } while (now < target);
        if (!KNOB_ON(g_knob_sync)) __threadfence();
    }
    __syncthreads();
}
// Each counter serves launches of one grid size only (the host keeps one per size).

// A global load served by L2 (not a possibly stale L1 line): values other blocks just wrote.
__device__ __forceinline__ float ld_cg(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
    return v;
}

// Weight prefetch into L2 before a block's prologue (staging the activations or the IQ tables and
// its barrier), so the row's DRAM (or PCIe) latency overlaps it; off with MVF_PREFETCH=0.
#ifndef MVF_PREFETCH
#define MVF_PREFETCH 1
#endif

// Starts fetching the 128-byte lines of [p, p + bytes) into L2, line i, i + n, ... by the
// calling thread. A hint: it neither waits nor faults.
__device__ __forceinline__ void prefetch_l2(const u8* p, size_t bytes, int i, int n) {
    if (!MVF_PREFETCH) return;
    const size_t head = (size_t)p & 127;
    const u8* start = p - head;
    for (size_t off = (size_t)i * 128; off < bytes + head; off += (size_t)n * 128) {
        asm volatile("prefetch.L2 [%0];" ::"l"(start + off));
    }
}

// REDLITE_CUDA_PRE_WEIGHTS (set from the host after the module loads; default 1): kernels start
// their small weight vectors (norm weights, RoPE rows) into L1 before the wait, so that after it
// they read only what the kernel ahead wrote.
__constant__ int g_knob_pre;

// Phase timing (REDLITE_TRACE, compiled in only with REDLITE_CUDA_DEFINES=REDLITE_TRACE: a
// diagnostic build, since even an untaken branch and a live clock value cost the fused route
// kernel registers): kernels that know their phases add each phase's length (SM clock cycles,
// block 0's thread 0) to g_trace[phase], and g_trace[count slot] counts the calls; the host reads
// the sums back (`Gpu::trace`). Without it the stamps are no-ops. Slots: the fused route kernel
// 0 (calls), 1..5; moe_down_combine_tab_q8_iq2_xxs 6, 7..8; matvec_q8x 9, 10..11; dn_fused_cols
// 12, 13..14 (each: the calls, launch to the end of the wait, the wait's end to block 0's end);
// inside the route kernel's top-k (router_warp_row) 16..20, its gate/up rows 21..23;
// dn_fused_cols_rows 24, 25..29 (the wait, the chunks' prologues, their recurrences, the QK
// head's barrier, the gated norms and conv window); the route kernel's router rows (ROUTE_ROWS2)
// 30..33 (loads and lane partials, warp sums, barrier, row sums and stores).
#define TRACE_SLOTS 34
__device__ unsigned long long g_trace[TRACE_SLOTS];

// The clock of block 0's thread 0 (0 elsewhere, or not built in), without counting a call: for
// phases inside a helper whose kernel counts its own calls.
__device__ __forceinline__ long long trace_clock() {
#ifdef REDLITE_TRACE
    if (threadIdx.x != 0 || blockIdx.x != 0 || blockIdx.y != 0 || blockIdx.z != 0) return 0;
    return clock64();
#else
    return 0;
#endif
}

// The clock at a call's start (0 when not traced: another block or thread, or not built in);
// counts the call in slot `calls`.
__device__ __forceinline__ long long trace_start(int calls = 0) {
#ifdef REDLITE_TRACE
    const long long t = trace_clock();
    if (t != 0) atomicAdd(&g_trace[calls], 1ull);
    return t;
#else
    (void)calls;
    return 0;
#endif
}

// Adds the cycles since `t` to phase slot `phase` (1 .. TRACE_SLOTS - 1) and returns the clock
// now (t == 0: not traced, returns 0).
__device__ __forceinline__ long long trace_phase(int phase, long long t) {
#ifdef REDLITE_TRACE
    if (t == 0) return 0;
    const long long now = clock64();
    atomicAdd(&g_trace[phase], (unsigned long long)(now - t));
    return now;
#else
    (void)phase;
    (void)t;
    return 0;
#endif
}

// Starts the 128-byte lines of [p, p + bytes) into this SM's L1, a line per thread of the block
// (a hint: it neither waits nor faults). For a few KB of weights read after the wait.
__device__ __forceinline__ void prefetch_l1_block(const void* p, size_t bytes) {
    if (!KNOB_ON(g_knob_pre) || p == nullptr) return;
    const size_t head = (size_t)p & 127;
    const u8* start = (const u8*)p - head;
    for (size_t off = (size_t)threadIdx.x * 128; off < bytes + head; off += (size_t)blockDim.x * 128) {
        asm volatile("prefetch.global.L1 [%0];" ::"l"(start + off));
    }
}

// Two f32 to one f16x2 word: `lo` in the low half (the element of the lower index).
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// c += a · b for one m16n8k16 tile (a: 16×16 row-major, b: 16×8 column-major, f32 c).
__device__ __forceinline__ void mma_16816(float* c, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float siluf_(float x) { return x * sigmoidf_(x); }

// The IQ lookup tables. Filled from the host (redlite_gguf::quant::grids) right after the module
// loads, so the values are never retyped here.
__device__ u64 g_iq2xxs_grid[256];
__device__ u64 g_iq2xs_grid[512];
__device__ u64 g_iq2s_grid[1024];
__device__ u32 g_iq3xxs_grid[256];
__device__ u32 g_iq3s_grid[512];
__device__ u64 g_iq1s_grid[2048];
__device__ u8 g_ksigns_iq2xs[128];
__device__ i8 g_kvalues_iq4nl[16];
