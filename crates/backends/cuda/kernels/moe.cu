// Mixture of experts: the router (softmax + top-k on the GPU) and the routed-expert FFN over the
// chosen experts only (gate + up + SwiGLU, then down + weighted sum).

// moe_router(logits, n_expert, k, idx, weight): per token (blockIdx.x), softmax over the
// router logits, the k most probable experts (ties: lower index), their probabilities
// renormalised to sum to 1; written in ascending expert order (the order the reference sums in).
// Launch: grid = n tokens, block = any multiple of 32 threads (ROUTER_THREADS),
// dynamic shared memory = n_expert floats.
extern "C" __global__ void moe_router(const float* __restrict__ logits, int n_expert, int k,
                                      int* __restrict__ idx_out, float* __restrict__ w_out) {
    pdl_enter();
    extern __shared__ float probs[];
    __shared__ float scratch[WARP];
    __shared__ int chosen[64];
    __shared__ float best_v[WARP];
    __shared__ int best_i[WARP];
    const float* l = logits + (size_t)blockIdx.x * n_expert;

    float m = NEG_INF;
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) m = fmaxf(m, l[e]);
    m = block_max(m, scratch);
    float s = 0.0f;
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) {
        const float p = expf(l[e] - m);
        probs[e] = p;
        s += p;
    }
    s = block_sum(s, scratch);
    __syncthreads();
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) probs[e] = probs[e] / s;
    __syncthreads();

    // k rounds of a block-wide argmax; a taken expert is marked with -inf.
    const int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP, nw = blockDim.x / WARP;
    for (int r = 0; r < k; ++r) {
        float bv = NEG_INF;
        int bi = 0x7fffffff;
        for (int e = threadIdx.x; e < n_expert; e += blockDim.x) {
            const float p = probs[e];
            if (p > bv || (p == bv && e < bi)) { bv = p; bi = e; }
        }
        for (int o = WARP / 2; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        if (lane == 0) { best_v[wid] = bv; best_i[wid] = bi; }
        __syncthreads();
        if (threadIdx.x == 0) {
            float v = best_v[0];  // only the index is needed; v breaks ties
            int i = best_i[0];
            for (int w = 1; w < nw; ++w) {
                if (best_v[w] > v || (best_v[w] == v && best_i[w] < i)) { v = best_v[w]; i = best_i[w]; }
            }
            chosen[r] = i;
            probs[i] = -probs[i] - 1.0f;  // mark taken (probabilities are >= 0), recoverable
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        // Sum of the chosen probabilities in rank order, like the reference; then ascending ids.
        float total = 0.0f;
        for (int r = 0; r < k; ++r) total += -(probs[chosen[r]] + 1.0f);
        for (int a = 1; a < k; ++a) {
            const int v = chosen[a];
            int b = a - 1;
            while (b >= 0 && chosen[b] > v) { chosen[b + 1] = chosen[b]; --b; }
            chosen[b + 1] = v;
        }
        for (int r = 0; r < k; ++r) {
            idx_out[(size_t)blockIdx.x * k + r] = chosen[r];
            w_out[(size_t)blockIdx.x * k + r] = -(probs[chosen[r]] + 1.0f) / total;
        }
    }
}

// moe_router_warp: moe_router's result computed by one warp per token, for n_expert <= 32 *
// ROUTER_VPL: lane l holds the probabilities of experts l, l + 32, ... in registers (indexed
// only by unrolled loops, so they stay there), and each of the k rounds is a local argmax over
// ROUTER_VPL values plus a butterfly warp argmax under the total order (p desc, id asc): no
// barrier and no shared-memory pass per round (moe_router: two barriers and a serial scan of
// the warps' winners per round). The softmax sums in another order than moe_router, so the
// weights may differ from it in the last bits; the chosen ids are the same whenever no two
// probabilities tie within a rounding step. Launch: grid = n tokens, block = 32 threads.
#define ROUTER_VPL 16
// The tail after the k rounds: by the lanes in parallel (1, default; k <= 32) or serially by lane
// 0 with shared memory (0, the earlier form). Same outputs bit for bit.
#ifndef ROUTER_LANE_TAIL
#define ROUTER_LANE_TAIL 1
#endif
// REDLITE_CUDA_TOPK_REDUX (set from the host after the module loads; default 1): the router's
// top-k rounds by router_topk_redux instead of the butterfly argmax below (the same choices).
__constant__ int g_knob_topk;
// REDLITE_CUDA_SOFTMAX_FLAT (set from the host after the module loads; default 1): the router's
// exps and divisions without a branch per slot, the tail's shuffles unrolled to
// ROUTER_TAIL_UNROLL ranks (the same values).
#define ROUTER_TAIL_UNROLL 16
__constant__ int g_knob_soft;
// REDLITE_CUDA_TOPK_LOGITS (default 1): the router's top-k chosen on the logits, the weights
// exp(l - max) / Σ over the chosen (router_topk_logits), without the softmax over every expert.
__constant__ int g_knob_tkl;

// Whether div_rn_tame(v, s, r1) is v / s: v a softmax numerator (0 or in [2^-90, 2]) and s its
// sum in [1, 2^20] (the max term is 1). Such operands pass the division's own range check
// (FCHK), and its fast path is div_rn_tame.
__device__ __forceinline__ bool div_tame(float v, float s) {
    return (v == 0.0f || (v >= 0x1p-90f && v <= 2.0f)) && s >= 1.0f && s <= 0x1p20f;
}

// The refined reciprocal of the compiler's correctly rounded f32 division (sm_90 SASS of v / s:
// MUFU.RCP, two FMAs), once per divisor.
__device__ __forceinline__ float div_recip(float s) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(s));
    return __fmaf_rn(r, __fmaf_rn(-s, r, 1.0f), r);
}

// The rest of that fast path (three FMAs; FCHK sends other operands to a slow path): bit for
// bit v / s where div_tame(v, s) holds, r1 = div_recip(s).
__device__ __forceinline__ float div_rn_tame(float v, float s, float r1) {
    const float q = __fmaf_rn(r1, v, 0.0f);
    return __fmaf_rn(r1, __fmaf_rn(-s, q, v), q);
}

// The lane's best slot among its ROUTER_VPL: the largest h, the lowest slot (= lowest id) on a
// tie, by a tree of depth log2(ROUTER_VPL) (a linear scan is a chain of ROUTER_VPL steps).
__device__ __forceinline__ void router_lane_best(const u32 (&h)[ROUTER_VPL], u32& bh, int& bj) {
    u32 th[ROUTER_VPL / 2];
    int tj[ROUTER_VPL / 2];
#pragma unroll
    for (int i = 0; i < ROUTER_VPL / 2; ++i) {
        const bool hi = h[2 * i + 1] > h[2 * i];
        th[i] = hi ? h[2 * i + 1] : h[2 * i];
        tj[i] = hi ? 2 * i + 1 : 2 * i;
    }
#pragma unroll
    for (int w = ROUTER_VPL / 4; w > 0; w >>= 1) {
#pragma unroll
        for (int i = 0; i < w; ++i) {
            const bool hi = th[2 * i + 1] > th[2 * i];  // strict: the lower slot keeps a tie
            th[i] = hi ? th[2 * i + 1] : th[2 * i];
            tj[i] = hi ? tj[2 * i + 1] : tj[2 * i];
        }
    }
    bh = th[0];
    bj = tj[0];
}

// A round's winning lane takes its slot jt out (key 0) and finds its best again.
__device__ __forceinline__ void router_lane_take(u32 (&h)[ROUTER_VPL], int jt, u32& bh, int& bj) {
#pragma unroll
    for (int j = 0; j < ROUTER_VPL; ++j) h[j] = j == jt ? 0u : h[j];
    router_lane_best(h, bh, bj);
}

// router_warp_row's k rounds from its probabilities v (lane holds experts lane + 32 j), by the
// calling warp, with the warp-wide max in one instruction (REDUX, sm_80+) instead of a 5-step
// shuffle butterfly: a slot's rank h is its probability's bits + 1 (p >= 0: the bits order as
// the value), 0 for a slot past the last expert or already chosen. Round: the largest h of the
// lanes' bests, then the largest ~id among the lanes holding it (= the lowest id: the order
// (p desc, id asc) of the rounds below); the winner's lane clears that slot and finds its best
// again (a tree). Lane r keeps the r-th choice. The same choices in the same rank order as the
// butterfly rounds, hence the same tail and outputs bit for bit. (ncu, session 17: the fused route
// kernel's other 15 warps waited for warp 0's top-k about 30 % of the kernel's time.)
// router_topk_keys is those rounds on any keys h (0: not a candidate); lane r < k gets the r-th
// choice's id and key.
// TOPK_BALLOT (default 1 since session 20: +0.6 % decode on the H200, the same bits): a round's
// winner found by a ballot of the lanes holding the maximum when there is one such lane (a tie
// falls back to the REDUX on ~id), the winner writing its id and key to shared memory for lane r
// to read after the rounds: one REDUX and the per-lane select fewer on each round's chain. The
// same choices.
#ifndef TOPK_BALLOT
#define TOPK_BALLOT 1
#endif
__device__ __forceinline__ void router_topk_keys(u32 (&h)[ROUTER_VPL], int lane, int k, int& my_id, u32& my_h) {
    u32 bh;
    int bj;
    router_lane_best(h, bh, bj);
#if TOPK_BALLOT
    __shared__ int won_id[WARP];
    __shared__ u32 won_h[WARP];
    for (int r = 0; r < k; ++r) {
        const u32 mh = __reduce_max_sync(0xffffffffu, bh);
        const u32 tied = __ballot_sync(0xffffffffu, bh == mh);
        bool win = bh == mh;
        if ((tied & (tied - 1u)) != 0u) {  // warp-uniform: several lanes hold the maximum
            const u32 ml = __reduce_max_sync(0xffffffffu, win ? ~(u32)(lane + WARP * bj) : 0u);
            win = (int)~ml == lane + WARP * bj;
        }
        if (win) {
            won_id[r] = lane + WARP * bj;
            won_h[r] = mh;
            router_lane_take(h, bj, bh, bj);
        }
    }
    __syncwarp();
    if (lane < k) {
        my_id = won_id[lane];
        my_h = won_h[lane];
    }
    __syncwarp();  // the next call's winners write these again
#else
    for (int r = 0; r < k; ++r) {
        const u32 mh = __reduce_max_sync(0xffffffffu, bh);
        const u32 ml = __reduce_max_sync(0xffffffffu, bh == mh ? ~(u32)(lane + WARP * bj) : 0u);
        const int id = (int)~ml;
        if (lane == r) {
            my_id = id;
            my_h = mh;
        }
        if (lane == id % WARP) router_lane_take(h, id / WARP, bh, bj);
    }
#endif
}

__device__ __forceinline__ void router_topk_redux(const float (&v)[ROUTER_VPL], int lane, int k, int& my_id,
                                                  float& my_p) {
    u32 h[ROUTER_VPL];
#pragma unroll
    for (int j = 0; j < ROUTER_VPL; ++j) h[j] = v[j] >= 0.0f ? __float_as_uint(v[j]) + 1u : 0u;
    u32 my_h = 1u;
    router_topk_keys(h, lane, k, my_id, my_h);
    my_p = __uint_as_float(my_h - 1u);
}

// The rank key of a logit: its bits mapped so that unsigned order is the float order (negative
// values' bits inverted, positive values' sign bit set); never 0 for a number (-inf: 0x007FFFFF).
__device__ __forceinline__ u32 logit_key(float l) {
    const u32 b = __float_as_uint(l);
    return (b & 0x80000000u) ? ~b : b | 0x80000000u;
}
__device__ __forceinline__ float key_logit(u32 h) {
    return __uint_as_float((h & 0x80000000u) ? h & 0x7FFFFFFFu : ~h);
}

// The top-k's tail with lane r < k holding the r-th choice (id, weight numerator p): the total in
// rank order, each choice's place in ascending id order by counting the smaller ids (ids are
// distinct), written by its lane. The shuffles of all ranks are issued together (k is a run-time
// value: a loop to k would wait for each in turn); k <= ROUTER_TAIL_UNROLL.
__device__ __forceinline__ void router_tail_unrolled(int my_id, float my_p, int lane, int k,
                                                     int* __restrict__ idx_out, float* __restrict__ w_out) {
    float ps[ROUTER_TAIL_UNROLL];
    int is[ROUTER_TAIL_UNROLL];
#pragma unroll
    for (int r = 0; r < ROUTER_TAIL_UNROLL; ++r) {
        ps[r] = __shfl_sync(0xffffffffu, my_p, r);
        is[r] = __shfl_sync(0xffffffffu, my_id, r);
    }
    float total = 0.0f;
    int pos = 0;
#pragma unroll
    for (int r = 0; r < ROUTER_TAIL_UNROLL; ++r) {
        if (r < k) {
            total += ps[r];
            pos += is[r] < my_id;
        }
    }
    if (lane < k) {
        idx_out[pos] = my_id;
        w_out[pos] = my_p / total;
    }
}

// router_warp_row's outputs from the logits v (lane holds experts lane + 32 j; m their max) without
// the softmax over every expert (REDLITE_CUDA_TOPK_LOGITS): the softmax is monotonic, so the top-k
// of the logits are the top-k of the probabilities (the order (value desc, id asc) of the rounds),
// and the renormalised weight p_i / Σ_chosen p_j = e^(l_i - m) / Σ_chosen e^(l_j - m): ten exps by
// the lanes of the choices, then router_tail_unrolled (the sum in rank order, ascending ids).
// k <= ROUTER_TAIL_UNROLL.
__device__ __forceinline__ void router_topk_logits(const float (&v)[ROUTER_VPL], float m, int lane, int n_expert,
                                                   int k, int* __restrict__ idx_out, float* __restrict__ w_out) {
    u32 h[ROUTER_VPL];
#pragma unroll
    for (int j = 0; j < ROUTER_VPL; ++j) h[j] = lane + WARP * j < n_expert ? logit_key(v[j]) : 0u;
    int my_id = 0;
    u32 my_h = 0u;
    router_topk_keys(h, lane, k, my_id, my_h);
    const float my_p = lane < k ? expf(key_logit(my_h) - m) : 0.0f;
    router_tail_unrolled(my_id, my_p, lane, k, idx_out, w_out);
}

// router_warp_row(l, n_expert, k, idx_out, w_out): moe_router_warp's work for one token, by the
// calling warp (its lanes 0..31): l the token's logits (read through L2: the kernel before wrote
// them from other blocks just before), idx_out / w_out the token's k outputs.
__device__ __forceinline__ void router_warp_row(const float* __restrict__ l, int n_expert, int k,
                                                int* __restrict__ idx_out, float* __restrict__ w_out) {
    __shared__ int chosen[64];
    __shared__ float chosen_p[64];
    const int lane = threadIdx.x % WARP;
    // Phases under REDLITE_TRACE (block 0's thread 0): 16 loads and max, 17 exps and sum, 18
    // divisions, 19 rounds, 20 tail.
    long long tt = trace_clock();
    float v[ROUTER_VPL];
    float m = NEG_INF;
#pragma unroll
    for (int j = 0; j < ROUTER_VPL; ++j) {
        const int e = lane + WARP * j;
        v[j] = e < n_expert ? __ldcg(l + e) : NEG_INF;
        m = fmaxf(m, v[j]);
    }
    m = warp_max(m);
    tt = trace_phase(16, tt);
    if (KNOB_ON(g_knob_tkl) && ROUTER_LANE_TAIL && k <= ROUTER_TAIL_UNROLL) {
        router_topk_logits(v, m, lane, n_expert, k, idx_out, w_out);
        trace_phase(19, tt);
        return;
    }
    float s = 0.0f;
    if (KNOB_ON(g_knob_soft)) {
        // Without a branch per slot: a slot past the last expert holds -inf, whose exp is the 0
        // the other form adds, so the 16 exps take the same instructions and interleave.
#pragma unroll
        for (int j = 0; j < ROUTER_VPL; ++j) {
            v[j] = expf(v[j] - m);
            s += v[j];
        }
    } else {
#pragma unroll
        for (int j = 0; j < ROUTER_VPL; ++j) {
            const int e = lane + WARP * j;
            v[j] = e < n_expert ? expf(v[j] - m) : 0.0f;
            s += v[j];
        }
    }
    s = warp_sum(s);
    tt = trace_phase(17, tt);
    // Probabilities are >= 0: -2 marks a lane slot past the last expert, -1 a chosen expert.
    if (KNOB_ON(g_knob_soft)) {
        // v / s by div_rn_tame where that is the division's own fast path (every value here but
        // a tiny one), then '/' for the rest: the same quotients, without a branch per slot.
        // Every slot's quotient computed (no predicate on the arithmetic: the chains interleave),
        // then kept where it is the division's.
        const float r1 = div_recip(s);
        unsigned slow = 0;
#pragma unroll
        for (int j = 0; j < ROUTER_VPL; ++j) {
            const bool ok = div_tame(v[j], s);
            const float q = div_rn_tame(v[j], s, r1);
            slow |= (unsigned)!ok << j;
            v[j] = ok ? q : v[j];
        }
        if (slow != 0) {
#pragma unroll
            for (int j = 0; j < ROUTER_VPL; ++j) {
                if ((slow >> j) & 1) v[j] = v[j] / s;
            }
        }
#pragma unroll
        for (int j = 0; j < ROUTER_VPL; ++j) v[j] = lane + WARP * j < n_expert ? v[j] : -2.0f;
    } else {
#pragma unroll
        for (int j = 0; j < ROUTER_VPL; ++j) v[j] = lane + WARP * j < n_expert ? v[j] / s : -2.0f;
    }
    tt = trace_phase(18, tt);
    int my_id = 0;  // lane r < k: the r-th choice (ROUTER_LANE_TAIL)
    float my_p = 0.0f;
    const bool redux = KNOB_ON(g_knob_topk) && ROUTER_LANE_TAIL && k <= WARP;
    if (redux) router_topk_redux(v, lane, k, my_id, my_p);
    tt = trace_phase(19, tt);
    for (int r = 0; r < (redux ? 0 : k); ++r) {
        // The lane's best (ties: its lower slot = lower id), then the warp's.
        float bv = v[0];
        int bj = 0;
#pragma unroll
        for (int j = 1; j < ROUTER_VPL; ++j) {
            if (v[j] > bv) {
                bv = v[j];
                bj = j;
            }
        }
        int bi = lane + WARP * bj;
#pragma unroll
        for (int o = WARP / 2; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) {
                bv = ov;
                bi = oi;
            }
        }
        // Every lane holds the same winner now.
        if (lane == bi % WARP) {
            const int jt = bi / WARP;
#pragma unroll
            for (int j = 0; j < ROUTER_VPL; ++j) {
                if (j == jt) v[j] = -1.0f;
            }
        }
        if (lane == 0) {
            chosen[r] = bi;
            chosen_p[r] = bv;
        }
        if (lane == r) {
            my_id = bi;
            my_p = bv;
        }
    }
    if (ROUTER_LANE_TAIL && k <= WARP) {
        // Lane r < k holds the r-th choice: the total in rank order (the same additions as the
        // serial loop below), each choice's place in ascending id order by counting the smaller
        // ids (ids are distinct), written by its lane: the serial loop's output bit for bit.
        if (KNOB_ON(g_knob_soft) && k <= ROUTER_TAIL_UNROLL) {
            router_tail_unrolled(my_id, my_p, lane, k, idx_out, w_out);
        } else {
            float total = 0.0f;
            int pos = 0;
            for (int r = 0; r < k; ++r) total += __shfl_sync(0xffffffffu, my_p, r);
            for (int r = 0; r < k; ++r) pos += __shfl_sync(0xffffffffu, my_id, r) < my_id;
            if (lane < k) {
                idx_out[pos] = my_id;
                w_out[pos] = my_p / total;
            }
        }
        trace_phase(20, tt);
        return;
    }
    __syncwarp();
    if (lane == 0) {
        // Sum of the chosen probabilities in rank order, like the reference; then ascending ids.
        float total = 0.0f;
        for (int r = 0; r < k; ++r) total += chosen_p[r];
        for (int a = 1; a < k; ++a) {
            const int id = chosen[a];
            const float p = chosen_p[a];
            int b = a - 1;
            while (b >= 0 && chosen[b] > id) {
                chosen[b + 1] = chosen[b];
                chosen_p[b + 1] = chosen_p[b];
                --b;
            }
            chosen[b + 1] = id;
            chosen_p[b + 1] = p;
        }
        for (int r = 0; r < k; ++r) {
            idx_out[r] = chosen[r];
            w_out[r] = chosen_p[r] / total;
        }
    }
}

// TOPK_PAR (compile-time, default 1 since session 34: +3.4 % decode on the H200, 417.86 against
// 404.12 tok/s, bit-identical; 0: warp 0's rounds always): the fused route kernel's top-k by the whole
// block instead of warp 0's k sequential rounds (session 33: ten rounds of ≈ 350 cycles, 1.85 µs a
// layer). Thread t holds expert t's key (logit_key: unsigned order is the logits' order; the id
// breaks a tie, lower first, as in the rounds). (1) Each warp's largest key by one REDUX; (2) t0,
// the k-th largest of the warps' maxima: k distinct experts have keys >= t0, so every one of the
// top k does too; (3) the experts with key >= t0 (typically 10-30 of 512) gathered into shared
// memory as (key, ~id) pairs, in any order; (4) warp 0 ranks each candidate by counting the
// candidates above it (a total order, so the ranks are distinct), and the rank-r candidate is the
// r-th choice of the rounds. The exps and router_tail_unrolled as in router_topk_logits: the same
// outputs bit for bit. More than TOPK_PAR_CAP candidates (ties, e.g. equal logits), more experts
// than threads, or k above the warps a block: returns false (block-uniform) and the caller runs
// router_warp_row.
#ifndef TOPK_PAR
#define TOPK_PAR 1
#endif
#define TOPK_PAR_CAP 64
__device__ __forceinline__ bool router_block_topk(const float* __restrict__ l, int n_expert, int k,
                                                  int* __restrict__ idx_out, float* __restrict__ w_out) {
    __shared__ u32 wmax[WARP];
    __shared__ unsigned long long cand[TOPK_PAR_CAP];
    __shared__ int ncand;
    __shared__ int won_id[ROUTER_TAIL_UNROLL];
    __shared__ u32 won_h[ROUTER_TAIL_UNROLL];
    const int t = (int)threadIdx.x, lane = t % WARP, wid = t / WARP, nw = (int)blockDim.x / WARP;
    if (!(KNOB_ON(g_knob_tkl) && ROUTER_LANE_TAIL) || n_expert > (int)blockDim.x || k > nw ||
        k > ROUTER_TAIL_UNROLL || nw > WARP)
        return false;
    // Phases under REDLITE_TRACE (block 0's thread 0): 16 loads and the warps' maxima, 17 t0 and the
    // candidates, 19 their ranks, 20 tail.
    long long tt = trace_clock();
    const u32 h = t < n_expert ? logit_key(__ldcg(l + t)) : 0u;
    const u32 wm = __reduce_max_sync(0xffffffffu, h);
    if (lane == 0) wmax[wid] = wm;
    if (t == 0) ncand = 0;
    __syncthreads();
    tt = trace_phase(16, tt);
    // t0 by every warp: lane i < nw ranks warp i's maximum (ties: the lower warp first).
    const u32 mine = lane < nw ? wmax[lane] : 0u;
    int rank = 0;
#pragma unroll 8
    for (int j = 0; j < nw; ++j) {
        const u32 o = wmax[j];
        rank += (o > mine) | ((o == mine) & (j < lane));
    }
    const u32 at = __ballot_sync(0xffffffffu, lane < nw && rank == k - 1);
    const u32 t0 = __shfl_sync(0xffffffffu, mine, __ffs(at) - 1);
    const bool c = h != 0u && h >= t0;
    const u32 cb = __ballot_sync(0xffffffffu, c);
    int base = 0;
    if (lane == 0 && cb != 0u) base = atomicAdd(&ncand, __popc(cb));
    base = __shfl_sync(0xffffffffu, base, 0);
    if (c) {
        const int slot = base + __popc(cb & ((1u << lane) - 1u));
        if (slot < TOPK_PAR_CAP) cand[slot] = ((unsigned long long)h << 32) | (u32)~t;
    }
    __syncthreads();
    tt = trace_phase(17, tt);
    const int n = ncand;
    if (n > TOPK_PAR_CAP) return false;
    if (wid != 0) return true;
    // Lane i ranks candidates i and i + 32 (0: none).
    const unsigned long long a = lane < n ? cand[lane] : 0ull, b = lane + WARP < n ? cand[lane + WARP] : 0ull;
    int ra = 0, rb = 0;
#pragma unroll 4
    for (int j = 0; j < n; ++j) {
        const unsigned long long o = cand[j];
        ra += o > a;
        rb += o > b;
    }
    if (lane < n && ra < k) {
        won_id[ra] = (int)~(u32)a;
        won_h[ra] = (u32)(a >> 32);
    }
    if (lane + WARP < n && rb < k) {
        won_id[rb] = (int)~(u32)b;
        won_h[rb] = (u32)(b >> 32);
    }
    __syncwarp();
    tt = trace_phase(19, tt);
    int my_id = 0;
    u32 my_h = 0u;
    if (lane < k) {
        my_id = won_id[lane];
        my_h = won_h[lane];
    }
    // The rounds' m is the largest logit: the rank-0 key's.
    const float m = key_logit(won_h[0]);
    const float my_p = lane < k ? expf(key_logit(my_h) - m) : 0.0f;
    router_tail_unrolled(my_id, my_p, lane, k, idx_out, w_out);
    trace_phase(20, tt);
    return true;
}

extern "C" __global__ void moe_router_warp(const float* __restrict__ logits, int n_expert, int k,
                                           int* __restrict__ idx_out, float* __restrict__ w_out) {
    pdl_enter();
    const size_t t = blockIdx.x;
    // Launched with more than a warp (the host's default, REDLITE_CUDA_ROUTER_PAR): the block-wide
    // top-k (TOPK_PAR), the same outputs; warp 0's rounds where it declines.
    if (TOPK_PAR && blockDim.x > WARP &&
        router_block_topk(logits + t * n_expert, n_expert, k, idx_out + t * k, w_out + t * k))
        return;
    if (threadIdx.x >= WARP) return;
    router_warp_row(logits + t * n_expert, n_expert, k, idx_out + t * k, w_out + t * k);
}

// moe_gate_up_<type>(gate, up, x, act, ff, hidden): for chosen expert e = blockIdx.y,
// act[e][r] = silu(gate_e[r] . x) * (up_e[r] . x). gate/up hold the device addresses of the
// chosen experts' [ff, hidden] weights (both of this type).
// Launch: block = 32 * warps, grid = (ceil(ff / warps), k).
template <typename T>
__device__ __forceinline__ void moe_gate_up_body(const u64* __restrict__ gate, const u64* __restrict__ up,
                                                 const float* __restrict__ x, float* __restrict__ act,
                                                 int ff, int hidden) {
    stage_tables<T>();  // before any warp leaves
    const int warps = blockDim.x / WARP;
    const int row = blockIdx.x * warps + threadIdx.x / WARP;
    const int lane = threadIdx.x % WARP;
    const int e = blockIdx.y;
    if (row >= ff) return;
    const size_t rb = row_bytes<T>(hidden);
    const float g = row_dot<T>((const u8*)gate[e] + (size_t)row * rb, x, hidden, lane);
    const float u = row_dot<T>((const u8*)up[e] + (size_t)row * rb, x, hidden, lane);
    if (lane == 0) act[(size_t)e * ff + row] = siluf_(g) * u;
}

// moe_down_<type>(down, act, weight, out, hidden, ff, k): out[r] = sum over e < k, in order, of
// weight[e] * (down_e[r] . act[e]). Launch: block = 32 * warps, grid = ceil(hidden / warps).
template <typename T>
__device__ __forceinline__ void moe_down_body(const u64* __restrict__ down, const float* __restrict__ act,
                                              const float* __restrict__ weight, float* __restrict__ out,
                                              int hidden, int ff, int k) {
    stage_tables<T>();  // before any warp leaves
    const int warps = blockDim.x / WARP;
    const int row = blockIdx.x * warps + threadIdx.x / WARP;
    const int lane = threadIdx.x % WARP;
    if (row >= hidden) return;
    const size_t rb = row_bytes<T>(ff);
    float s = 0.0f;
    for (int e = 0; e < k; ++e) {
        const float d = row_dot<T>((const u8*)down[e] + (size_t)row * rb, act + (size_t)e * ff, ff, lane);
        s += weight[e] * d;
    }
    if (lane == 0) out[row] = s;
}

#define MOE_KERNELS(name, T)                                                                         \
    extern "C" __global__ void moe_gate_up_##name(const u64* gate, const u64* up, const float* x,    \
                                                  float* act, int ff, int hidden) {                  \
        pdl_enter();                                                                                 \
        moe_gate_up_body<T>(gate, up, x, act, ff, hidden);                                           \
    }                                                                                                \
    extern "C" __global__ void moe_down_##name(const u64* down, const float* act, const float* weight, \
                                               float* out, int hidden, int ff, int k) {              \
        pdl_enter();                                                                                 \
        moe_down_body<T>(down, act, weight, out, hidden, ff, k);                                     \
    }

FOR_EACH_TYPE(MOE_KERNELS)

// The device-resident forms: the router's choice stays on the device. Each expert tensor is one
// buffer with expert e's [rows][cols] weight at byte offset e * stride (gate and up may share a
// buffer, as in the fused gate_up layout).

// moe_gate_up_ids_<type>(gate, up, stride, ids, x, act, ff, hidden, k): token t = blockIdx.z,
// choice e = blockIdx.y (expert ids[t][e]): act[t][e][r] = silu(gate . x[t]) * (up . x[t]).
// Launch: block = 32 * warps, grid = (ceil(ff / warps), k, tokens).
template <typename T>
__device__ __forceinline__ void moe_gate_up_ids_body(const u8* __restrict__ gate, const u8* __restrict__ up,
                                                     u64 stride, const int* __restrict__ ids,
                                                     const float* __restrict__ x, float* __restrict__ act,
                                                     int ff, int hidden, int k) {
    stage_tables<T>();  // before any warp leaves
    const int warps = blockDim.x / WARP;
    const int row = blockIdx.x * warps + threadIdx.x / WARP;
    const int lane = threadIdx.x % WARP;
    const size_t te = (size_t)blockIdx.z * k + blockIdx.y;
    if (row >= ff) return;
    const size_t off = (size_t)ids[te] * stride + (size_t)row * row_bytes<T>(hidden);
    const float* xt = x + (size_t)blockIdx.z * hidden;
    const float gv = row_dot<T>(gate + off, xt, hidden, lane);
    const float uv = row_dot<T>(up + off, xt, hidden, lane);
    if (lane == 0) act[te * ff + row] = siluf_(gv) * uv;
}

// moe_down_ids_<type>(down, stride, ids, weight, act, out, hidden, ff, k): token t = blockIdx.y:
// out[t][r] = sum over e < k, in order, of weight[t][e] * (down_{ids[t][e]}[r] . act[t][e]).
// Launch: block = 32 * warps, grid = (ceil(hidden / warps), tokens).
template <typename T>
__device__ __forceinline__ void moe_down_ids_body(const u8* __restrict__ down, u64 stride,
                                                  const int* __restrict__ ids, const float* __restrict__ weight,
                                                  const float* __restrict__ act, float* __restrict__ out,
                                                  int hidden, int ff, int k) {
    stage_tables<T>();  // before any warp leaves
    const int warps = blockDim.x / WARP;
    const int row = blockIdx.x * warps + threadIdx.x / WARP;
    const int lane = threadIdx.x % WARP;
    const size_t t = blockIdx.y;
    if (row >= hidden) return;
    const size_t rb = row_bytes<T>(ff);
    float s = 0.0f;
    for (int e = 0; e < k; ++e) {
        const size_t te = t * k + e;
        const float d = row_dot<T>(down + (size_t)ids[te] * stride + (size_t)row * rb, act + te * ff, ff, lane);
        s += weight[te] * d;
    }
    if (lane == 0) out[t * hidden + row] = s;
}

#define MOE_IDS_KERNELS(name, T)                                                                      \
    extern "C" __global__ void moe_gate_up_ids_##name(const u8* gate, const u8* up, u64 stride,       \
                                                      const int* ids, const float* x, float* act,     \
                                                      int ff, int hidden, int k) {                    \
        pdl_enter();                                                                                  \
        moe_gate_up_ids_body<T>(gate, up, stride, ids, x, act, ff, hidden, k);                        \
    }                                                                                                 \
    extern "C" __global__ void moe_down_ids_##name(const u8* down, u64 stride, const int* ids,        \
                                                   const float* weight, const float* act, float* out, \
                                                   int hidden, int ff, int k) {                       \
        pdl_enter();                                                                                  \
        moe_down_ids_body<T>(down, stride, ids, weight, act, out, hidden, ff, k);                     \
    }

FOR_EACH_TYPE(MOE_IDS_KERNELS)

// moe_combine(x, routed, shared, gate_logit, hidden): the MoE block's residual for token
// t = blockIdx.y: x[t] += routed[t] + sigmoid(gate_logit[t]) * shared[t] (the shared expert's
// scalar sigmoid gate). Launch: grid = (ceil(hidden / block), tokens).
extern "C" __global__ void moe_combine(float* __restrict__ x, const float* __restrict__ routed,
                                       const float* __restrict__ shared, const float* __restrict__ gate_logit,
                                       int hidden) {
    pdl_enter();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= hidden) return;
    const size_t at = (size_t)blockIdx.y * hidden + i;
    const float gs = sigmoidf_(gate_logit[blockIdx.y]);
    x[at] += routed[at] + gs * shared[at];
}

// ----- Through a per-layer expert table (the GPU expert cache) -----
// tab[3 e + p] is the address of part p (0 gate, 1 up, 2 down) of expert e of the layer: a slot
// of the device cache, or the expert's copy in mapped pinned host memory (read over PCIe). The
// same kernel reads the same bytes either way, so the result does not depend on where an expert
// is. Every resident case (all experts in device memory) is the same table.

// Whether row_dot<T> takes T through its group decoder (groups inside a block): then the
// expert kernels below can interleave several rows' groups in one loop.
template <typename T>
__device__ constexpr bool grouped() {
    return !WarpBlockDot<T>::ON && GroupDot<T>::G > 0 && GroupDot<T>::G <= T::QK;
}

// The gate and up rows of one expert in one pass: each lane's groups of both rows in one loop
// (twice the loads in flight, the activations loaded once). Per row, the lane sums the same
// groups in the same order as row_dot, so gv and uv are row_dot's values bit for bit.
template <typename T>
__device__ __forceinline__ void gate_up_dot(const u8* __restrict__ g, const u8* __restrict__ u,
                                            const float* __restrict__ x, int cols, int lane,
                                            float& gv, float& uv) {
    if constexpr (grouped<T>()) {
        constexpr int G = GroupDot<T>::G, PER_BLOCK = T::QK / G;
        const int groups = cols / G;
        float ga = 0.0f, ua = 0.0f;
#pragma unroll 2
        for (int gi = lane; gi < groups; gi += WARP) {
            const size_t at = (size_t)(gi / PER_BLOCK) * T::BB;
            const float* xg = x + (size_t)gi * G;
            ga += GroupDot<T>::dot(g + at, gi % PER_BLOCK, xg);
            ua += GroupDot<T>::dot(u + at, gi % PER_BLOCK, xg);
        }
        gv = warp_sum(ga);
        uv = warp_sum(ua);
    } else {
        gv = row_dot<T>(g, x, cols, lane);
        uv = row_dot<T>(u, x, cols, lane);
    }
}

// ----- IQ2_XXS through sub-block lanes (MOE_IQ2_SB = 1; off by default: slower) -----
// An experiment against the group decoder's ~30 instructions per weight: a lane takes whole
// 32-value sub-blocks (one scale per sub-block), the grid as floats and the sign codes as 8
// sign-bit masks in shared memory (12 KiB, staged per thread block), so a weight costs one XOR
// (the sign flipped into the activation) and one FMA; gate_up keeps the lane's 32 activations in
// registers for the gate and the up row. Right (self-test, parity, cache exactness on the H200)
// but twice as slow (bench expert K = 10: 60.3 against 30.9 us per call; decode 138 against
// 168 tok/s). Likely cause (not profiled): four random 16-byte shared loads per 8 weights move
// 8x the shared-memory bytes of the group decoder's one 8-byte grid load, so shared-memory
// bandwidth (with bank conflicts) becomes the limit. See docs/perf-ledger.md.
// MOE_IQ2_SB = 2: the ALU-only decode of iq2_sub_dot_alu (prepared, not yet run on a GPU).
#ifndef MOE_IQ2_SB
#define MOE_IQ2_SB 0
#endif
// Loop unrolling of the lane's sub-blocks in gate_up and in down (tuning switches).
#ifndef MOE_SB_UNROLL
#define MOE_SB_UNROLL 2
#endif
#ifndef MOE_SB_DN_UNROLL
#define MOE_SB_DN_UNROLL 2
#endif

template <typename T>
struct IsIq2xxs {
    enum { V = 0 };
};
template <>
struct IsIq2xxs<T_IQ2_XXS> {
    enum { V = 1 };
};

// Whether the expert kernels take T through the sub-block path.
template <typename T>
__device__ constexpr bool iq2_sb() {
    return MOE_IQ2_SB && IsIq2xxs<T>::V;
}

__shared__ float4 s_iq2f[512];  // grid entry i: floats of bytes 0..3 at 2i, 4..7 at 2i + 1
__shared__ uint4 s_iq2sm[256];  // sign code i: bit 31 set where value j is negative (same split)

__device__ __forceinline__ void stage_iq2_sb_tables() {
    if (MOE_IQ2_SB == 2) {  // the byte grid and sign bytes (2.1 KiB), as the group decoder
        stage_tables<T_IQ2_XXS>();
        return;
    }
    for (int i = threadIdx.x; i < 256; i += blockDim.x) {
        const u64 g = g_iq2xxs_grid[i];
        s_iq2f[2 * i] = make_float4((float)(g & 255), (float)((g >> 8) & 255), (float)((g >> 16) & 255),
                                    (float)((g >> 24) & 255));
        s_iq2f[2 * i + 1] = make_float4((float)((g >> 32) & 255), (float)((g >> 40) & 255),
                                        (float)((g >> 48) & 255), (float)((g >> 56) & 255));
    }
    for (int i = threadIdx.x; i < 128; i += blockDim.x) {
        const u32 s = g_ksigns_iq2xs[i];
        s_iq2sm[2 * i] = make_uint4((s & 1) << 31, ((s >> 1) & 1) << 31, ((s >> 2) & 1) << 31, ((s >> 3) & 1) << 31);
        s_iq2sm[2 * i + 1] =
            make_uint4(((s >> 4) & 1) << 31, ((s >> 5) & 1) << 31, ((s >> 6) & 1) << 31, ((s >> 7) & 1) << 31);
    }
    __syncthreads();
}

// The 32 activations of one sub-block into registers (16-byte aligned: 32 floats into a row of
// whole blocks).
__device__ __forceinline__ void ld_x32(const float* __restrict__ p, float (&x)[32]) {
#pragma unroll
    for (int w = 0; w < 8; ++w) {
        const float4 v = ld_x4(p + 4 * w);
        x[4 * w] = v.x;
        x[4 * w + 1] = v.y;
        x[4 * w + 2] = v.z;
        x[4 * w + 3] = v.w;
    }
}

__device__ __forceinline__ float flip_sign(float x, u32 m) { return __int_as_float(__float_as_int(x) ^ m); }

// The raw fields of sub-block ib of an IQ2_XXS block: 4 grid indices, the u32 of sign codes and
// scale, the block scale (2-byte aligned: four 16-bit loads and one for d).
struct Iq2Sub {
    u32 idx, aux;
    float d;
};

__device__ __forceinline__ Iq2Sub iq2_sub_load(const u8* __restrict__ b, int ib) {
    const u16* q = (const u16*)(b + 2 + 8 * ib);
    Iq2Sub s;
    s.idx = (u32)q[0] | ((u32)q[1] << 16);
    s.aux = (u32)q[2] | ((u32)q[3] << 16);
    s.d = ld_f16(b);
    return s;
}

// MOE_IQ2_SB = 2 (prepared, not yet run on a GPU): the same lanes, but the 8-byte grid entry
// and the sign byte of the group decoder (one 8-byte and one 1-byte shared load per 8 weights);
// a grid byte b becomes a float with one byte permute (0x4B0000bb = 2^23 + b) and one subtract,
// the sign bit j is shifted into the activation's sign: 5 ALU instructions per weight, no more
// shared-memory bytes than the group decoder.
__device__ __forceinline__ float iq2_sub_dot_alu(const Iq2Sub& s, const float (&x)[32]) {
    float acc0 = 0.0f, acc1 = 0.0f;
#pragma unroll
    for (int l = 0; l < 4; ++l) {
        const u64 g = s_iq2xxs_grid[(s.idx >> (8 * l)) & 255];
        const u32 sg = s_ksigns_iq2xs[(s.aux >> (7 * l)) & 127];
        const u32 half[2] = {(u32)g, (u32)(g >> 32)};
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float w = __int_as_float(__byte_perm(half[j >> 2], 0x4B000000u, 0x7540u | (j & 3))) - 8388608.0f;
            const float xs = flip_sign(x[8 * l + j], (sg << (31 - j)) & 0x80000000u);
            if (j & 1) {
                acc1 = fmaf(w, xs, acc1);
            } else {
                acc0 = fmaf(w, xs, acc0);
            }
        }
    }
    return s.d * (0.5f + (float)(s.aux >> 28)) * 0.25f * (acc0 + acc1);
}

// sub . x for one sub-block with its 32 activations in registers.
__device__ __forceinline__ float iq2_sub_dot(const Iq2Sub& s, const float (&x)[32]) {
    if (MOE_IQ2_SB == 2) return iq2_sub_dot_alu(s, x);
    float acc0 = 0.0f, acc1 = 0.0f;
#pragma unroll
    for (int l = 0; l < 4; ++l) {
        const u32 gi = (s.idx >> (8 * l)) & 255, si = (s.aux >> (7 * l)) & 127;
        const float4 g0 = s_iq2f[2 * gi], g1 = s_iq2f[2 * gi + 1];
        const uint4 m0 = s_iq2sm[2 * si], m1 = s_iq2sm[2 * si + 1];
        acc0 = fmaf(g0.x, flip_sign(x[8 * l], m0.x), acc0);
        acc1 = fmaf(g0.y, flip_sign(x[8 * l + 1], m0.y), acc1);
        acc0 = fmaf(g0.z, flip_sign(x[8 * l + 2], m0.z), acc0);
        acc1 = fmaf(g0.w, flip_sign(x[8 * l + 3], m0.w), acc1);
        acc0 = fmaf(g1.x, flip_sign(x[8 * l + 4], m1.x), acc0);
        acc1 = fmaf(g1.y, flip_sign(x[8 * l + 5], m1.y), acc1);
        acc0 = fmaf(g1.z, flip_sign(x[8 * l + 6], m1.z), acc0);
        acc1 = fmaf(g1.w, flip_sign(x[8 * l + 7], m1.w), acc1);
    }
    return s.d * (0.5f + (float)(s.aux >> 28)) * 0.25f * (acc0 + acc1);
}

// gate . x and up . x of one row pair, lane `lane` taking sub-blocks lane, lane + 32, ...
__device__ __forceinline__ void iq2_gate_up_sb(const u8* __restrict__ g, const u8* __restrict__ u,
                                               const float* __restrict__ x, int cols, int lane, float& gv,
                                               float& uv) {
    const int subs = cols / 32;
    float ga = 0.0f, ua = 0.0f;
    constexpr int U = MOE_SB_UNROLL;
#pragma unroll U
    for (int sb = lane; sb < subs; sb += WARP) {
        const size_t at = (size_t)(sb >> 3) * T_IQ2_XXS::BB;
        const Iq2Sub sg = iq2_sub_load(g + at, sb & 7), su = iq2_sub_load(u + at, sb & 7);
        float xr[32];
        ld_x32(x + (size_t)sb * 32, xr);
        ga += iq2_sub_dot(sg, xr);
        ua += iq2_sub_dot(su, xr);
    }
    gv = warp_sum(ga);
    uv = warp_sum(ua);
}

// sum over choices c < k of weight[c] * (down_c row . act[c]) for one output row: the lane takes
// the (choice, sub-block) pairs lane, lane + 32, ... (choice-major).
__device__ __forceinline__ float iq2_down_sb(const u64* __restrict__ tab, const int* __restrict__ ids,
                                             const float* __restrict__ weight, const float* __restrict__ act,
                                             size_t off, int ff, int k, int lane) {
    const int subs = ff / 32;
    float acc = 0.0f;
    constexpr int U = MOE_SB_DN_UNROLL;
#pragma unroll U
    for (int i = lane; i < k * subs; i += WARP) {
        const int c = i / subs, sb = i - c * subs;
        const u8* down = (const u8*)tab[3 * (size_t)ids[c] + 2] + off;
        const Iq2Sub s = iq2_sub_load(down + (size_t)(sb >> 3) * T_IQ2_XXS::BB, sb & 7);
        float xr[32];
        ld_x32(act + (size_t)c * ff + (size_t)sb * 32, xr);
        acc = fmaf(weight[c], iq2_sub_dot(s, xr), acc);
    }
    return warp_sum(acc);
}

// moe_gate_up_tab_<type>(tab, ids, x, act, ff, hidden, k): token t = blockIdx.z, choice
// c = blockIdx.y (expert ids[t][c]): act[t][c][r] = silu(gate . x[t]) * (up . x[t]).
// Launch: block = 32 * warps, grid = (ceil(ff / warps), k, tokens).
template <typename T>
__device__ __forceinline__ void moe_gate_up_tab_body(const u64* __restrict__ tab, const int* __restrict__ ids,
                                                     const float* __restrict__ x, float* __restrict__ act,
                                                     int ff, int hidden, int k) {
    const int warps = blockDim.x / WARP, wid = threadIdx.x / WARP;
    const int lane = threadIdx.x % WARP;
    // Rows per warp: as many as the grid leaves (the host may give fewer blocks than rows / warps
    // so that each block stages its tables once for more rows); row r of warp w of block b is
    // (b * per_warp + r) * warps + w.
    const int per_warp = (ff + gridDim.x * warps - 1) / (gridDim.x * warps);
    // The tables first: they depend on nothing, so they are staged while the router still runs.
    if constexpr (iq2_sb<T>()) {
        stage_iq2_sb_tables();
    } else {
        stage_tables<T>();  // before any warp leaves
    }
    pdl_enter();  // ids come from the router
    const size_t te = (size_t)blockIdx.z * k + blockIdx.y;
    const u64* parts = tab + 3 * (size_t)ids[te];
    const size_t rb = row_bytes<T>(hidden);
    for (int r = 0; r < per_warp; ++r) {
        const int row = (blockIdx.x * per_warp + r) * warps + wid;
        if (row >= ff) break;
        prefetch_l2((const u8*)parts[0] + (size_t)row * rb, rb, lane, WARP);
        prefetch_l2((const u8*)parts[1] + (size_t)row * rb, rb, lane, WARP);
    }
    const float* xt = x + (size_t)blockIdx.z * hidden;
    for (int r = 0; r < per_warp; ++r) {
        const int row = (blockIdx.x * per_warp + r) * warps + wid;
        if (row >= ff) return;
        const size_t off = (size_t)row * rb;
        float gv, uv;
        if constexpr (iq2_sb<T>()) {
            iq2_gate_up_sb((const u8*)parts[0] + off, (const u8*)parts[1] + off, xt, hidden, lane, gv, uv);
        } else {
            gate_up_dot<T>((const u8*)parts[0] + off, (const u8*)parts[1] + off, xt, hidden, lane, gv, uv);
        }
        if (lane == 0) act[te * ff + row] = siluf_(gv) * uv;
    }
}

// ----- IQ2_XXS experts on 8-bit activations (REDLITE_CUDA_Q8_MOE) -----
// moe_gate_up_tab_q8_iq2_xxs(tab, ids, xq, act, ff, hidden, k): moe_gate_up_tab_iq2_xxs on the q8
// row of x a producer wrote (token t's at xq + t * Q8_ROW_BYTES(hidden): matvec_res's epilogue).
// A lane takes whole 32-weight sub-blocks; a sub-block's four grid entries, their bytes negated
// where the weight is negative, against its 32 quants are 8 dp4a (iq2xxs_sub_q8): Σ s g q, exact
// in i32. Its value is
// db · (dx · Σ) with db = d (0.5 + scale) / 4 as the f32 decoder; the lane adds its sub-blocks in
// order, then a warp sum. About 1.5 instructions per weight against the f32 group decoder's ~10.
// Launch: as moe_gate_up_tab (grid = (ceil(ff / warps), k, tokens), block = 32 * warps).

// The grid into shared memory (the sign bytes are computed, not staged: session 28 measured the
// staged ksigns table at -0.7 % decode).
__device__ __forceinline__ void stage_iq2_q8_tables() {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) s_iq2xxs_grid[i] = g_iq2xxs_grid[i];
    __syncthreads();
}

// A sign code's byte mask of negative weights (0xFF bytes), computed: the sign byte is the 7-bit
// code plus its parity in bit 7 (ksigns_iq2xs), each nibble's bits spread to the top bit of a
// byte by one multiply (no carries: the four shifted copies do not overlap), then widened to 0xFF
// bytes. About a dozen ALU operations instead of a random 8-byte shared-memory load from a
// staged table (ncu, session 18: a 5.5-way bank conflict on average; +3.6 % decode in the route
// kernel, +1 % in the down kernel).
__device__ __forceinline__ u64 iq2_negmask_alu(u32 code) {
    const u32 sg = code | ((__popc(code) & 1u) << 7);
    const u32 lo = ((((sg & 15u) * 0x10204080u) & 0x80808080u) >> 7) * 255u;
    const u32 hi = ((((sg >> 4) * 0x10204080u) & 0x80808080u) >> 7) * 255u;
    return ((u64)hi << 32) | lo;
}

// IQ2_SIGNED_DP4A (with IQ2_NEGSUM=0; default 1): iq2xxs_sub_q8 negates the grid bytes of the
// negative weights (iq2_signed_bytes) and takes one dp4a per four weights; 0: Σ g q - 2 Σ_neg g q with the
// quants masked by iq2_negmask_alu (two dp4a and a mask per four weights). The same i32 sums.
#ifndef IQ2_SIGNED_DP4A
#define IQ2_SIGNED_DP4A 1
#endif

// The four grid bytes g (each in 8..43) with byte j negated where bit j of n (< 16) is set: the
// multiply puts bit j at the top bit of byte j (as iq2_negmask_alu), PRMT's sign-replicating
// selectors (0x8 | j) widen each top bit to a 0xFF / 0x00 byte m_j, and g_j ^ m_j + (m_j & 1) is
// the byte's two's-complement negation where m_j = 0xFF (no carry leaves a byte: 0x100 - g_j
// fits). Six operations a word, against a mask, an AND and a second dp4a. (PRMT through inline
// PTX: __byte_perm ignores a selector's top bit, the sign-replicate flag.)
__device__ __forceinline__ u32 prmt_sign_bytes(u32 x) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, 0xBA98;" : "=r"(r) : "r"(x), "r"(0u));
    return r;
}
__device__ __forceinline__ u32 iq2_signed_bytes(u32 g, u32 n) {
    const u32 m = prmt_sign_bytes(n * 0x10204080u);
    return (g ^ m) + (m & 0x01010101u);
}

// IQ2_NEGSUM (default 1 since session 48: +2.0 % decode on the H100, bench expert -2.7 % at 10
// experts a call; 0: the IQ2_SIGNED_DP4A forms below): iq2xxs_sub_q8 without the negation's add.
// With m_j the 0xFF / 0x00 mask byte of a negative weight, (g ^ m)_j is s_j g_j - [m_j] as a signed byte
// and m_j is -[m_j], so Σ s g q = dp4a(g ^ m, q) - dp4a(m, q), the second summed apart over the
// sub-block and taken off once: per four weights an XOR and two dp4a instead of an XOR, an AND,
// an add and one dp4a. The upper half's mask input takes the parity bit (sign 7) through the
// multiply's addend (bit 3 of the nibble lands on bit 31; the three code bits leave it clear).
// Exact integer sums either way: the same bits.
#ifndef IQ2_NEGSUM
#define IQ2_NEGSUM 1
#endif

// Σ sign · grid · q over one IQ2_XXS sub-block (grid indices `idx`, sign codes and scale `aux`)
// with its 32 quants (a: quants 0..15, b: 16..31).
__device__ __forceinline__ int iq2xxs_sub_q8(u32 idx, u32 aux, const int4 a, const int4 b) {
    const int q[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#if IQ2_NEGSUM
    int sum = 0, neg = 0;
#pragma unroll
    for (int l = 0; l < 4; ++l) {
        const u64 g = s_iq2xxs_grid[(idx >> (8 * l)) & 255];
        const u32 code = (aux >> (7 * l)) & 127;
        const u32 mlo = prmt_sign_bytes((code & 15u) * 0x10204080u);
        const u32 mhi = prmt_sign_bytes((code >> 4) * 0x10204080u + ((u32)__popc(code) << 31));
        sum = dp4a((u32)g ^ mlo, q[2 * l], sum);
        neg = dp4a(mlo, q[2 * l], neg);
        sum = dp4a((u32)(g >> 32) ^ mhi, q[2 * l + 1], sum);
        neg = dp4a(mhi, q[2 * l + 1], neg);
    }
    return sum - neg;
#elif IQ2_SIGNED_DP4A
    int sum = 0;
#pragma unroll
    for (int l = 0; l < 4; ++l) {
        const u64 g = s_iq2xxs_grid[(idx >> (8 * l)) & 255];
        const u32 code = (aux >> (7 * l)) & 127;
        const u32 sg = code | ((__popc(code) & 1u) << 7);
        sum = dp4a(iq2_signed_bytes((u32)g, sg & 15u), q[2 * l], sum);
        sum = dp4a(iq2_signed_bytes((u32)(g >> 32), sg >> 4), q[2 * l + 1], sum);
    }
    return sum;
#else
    int sum = 0, neg = 0;
#pragma unroll
    for (int l = 0; l < 4; ++l) {
        const u64 g = s_iq2xxs_grid[(idx >> (8 * l)) & 255];
        const u64 m = iq2_negmask_alu((aux >> (7 * l)) & 127);
        const u32 glo = (u32)g, ghi = (u32)(g >> 32);
        sum = dp4a(glo, q[2 * l], sum);
        sum = dp4a(ghi, q[2 * l + 1], sum);
        neg = dp4a(glo, q[2 * l] & (int)(u32)m, neg);
        neg = dp4a(ghi, q[2 * l + 1] & (int)(u32)(m >> 32), neg);
    }
    return sum - 2 * neg;
#endif
}

// IQ2_LDG (default 1 since session 20: +0.5 % decode on the H200, the same bits):
// iq2xxs_sub_value tells the compiler its weight pointer is global (`__isGlobal`), so that its
// loads are `LDG.E.U16` instead of the generic `LD.E.U16` it emits for expert pointers computed
// from u64 values.
#ifndef IQ2_LDG
#define IQ2_LDG 1
#endif

// IQ2_WORD_LOADS (default 1 since session 62; 0: four 2-byte loads): a sub-block's grid indices and
// sign codes (8 bytes at `at`, 2-byte aligned: the 66-byte blocks of a row that starts on a word
// alternate between 0 and 2 bytes off a word) as two aligned 4-byte loads and, where `at` is 2 bytes
// off, a 2-byte load of the last two bytes, joined by funnel shifts (ld8_a2). Every byte read lies
// inside the sub-block's block (the first word starts at most 2 bytes before `at`, after d); the
// same words, the same bits (the full-size step logits compared bit for bit). On an H100 the
// verify's routed kernels read 12–21 % fewer global sectors (ncu) and the full-size 8-row verify
// took 0.2–1.2 % less in five alternating pairs, the decode step the same; in isolation (`bench
// expert`, session 63) the decode-form expert kernels take 3–7 % longer with them. (Session 41's
// form, IQ2_WIDE_LD, also took d from its aligned word, with a select more: decode −0.9 % then.)
#ifndef IQ2_WORD_LOADS
#define IQ2_WORD_LOADS 1
#endif

// Sub-block words at `at` (2-byte aligned): idx = bytes 0..3, aux = bytes 4..7.
__device__ __forceinline__ void iq2_sub_words(const u8* at, u32& idx, u32& aux) {
#if IQ2_WORD_LOADS
    ld8_a2(at, idx, aux);
#else
    idx = ld_u32_a2(at);
    aux = ld_u32_a2(at + 4);
#endif
}

// One sub-block's value: db · (dx · Σ), db = d (0.5 + scale) / 4 as the f32 decoder.
__device__ __forceinline__ float iq2xxs_sub_value(const u8* __restrict__ w, int sb, const Q8Row& x, const int4 a,
                                                  const int4 b) {
#if IQ2_LDG
    __builtin_assume(__isGlobal(w));
#endif
    const u8* blk = w + (size_t)(sb >> 3) * 66;
    const u8* at = blk + 2 + 8 * (sb & 7);
    u32 idx, aux;
    iq2_sub_words(at, idx, aux);
    const float db = ld_f16(blk) * (0.5f + (float)(aux >> 28)) * 0.25f;
    return __fmul_rn(db, __fmul_rn(x.d[sb], (float)iq2xxs_sub_q8(idx, aux, a, b)));
}

// The lane's sums over sub-blocks lane, lane + 32, ... (in that order) of a gate and an up row of
// `cols` IQ2_XXS weights: both rows' loads in one loop, the quants loaded once.
__device__ __forceinline__ void iq2xxs_gate_up_q8(const u8* __restrict__ g, const u8* __restrict__ u,
                                                  const Q8Row& x, int cols, int lane, float& ga, float& ua) {
    ga = 0.0f;
    ua = 0.0f;
#pragma unroll 2
    for (int sb = lane; sb < cols / 32; sb += WARP) {
        const int4 a = *(const int4*)(x.q + 32 * sb), b = *(const int4*)(x.q + 32 * sb + 16);
        ga = __fadd_rn(ga, iq2xxs_sub_value(g, sb, x, a, b));
        ua = __fadd_rn(ua, iq2xxs_sub_value(u, sb, x, a, b));
    }
}

// iq2xxs_gate_up_q8 for two rows at once (gate and up of rows 0 and 1): all four rows' loads in one
// loop; each row's partial takes the one-row function's operations in its order (the same bits).
__device__ __forceinline__ void iq2xxs_gate_up2_q8(const u8* __restrict__ g0, const u8* __restrict__ u0,
                                                   const u8* __restrict__ g1, const u8* __restrict__ u1,
                                                   const Q8Row& x, int cols, int lane, float& ga0, float& ua0,
                                                   float& ga1, float& ua1) {
    ga0 = 0.0f;
    ua0 = 0.0f;
    ga1 = 0.0f;
    ua1 = 0.0f;
#pragma unroll 2
    for (int sb = lane; sb < cols / 32; sb += WARP) {
        const int4 a = *(const int4*)(x.q + 32 * sb), b = *(const int4*)(x.q + 32 * sb + 16);
        ga0 = __fadd_rn(ga0, iq2xxs_sub_value(g0, sb, x, a, b));
        ua0 = __fadd_rn(ua0, iq2xxs_sub_value(u0, sb, x, a, b));
        ga1 = __fadd_rn(ga1, iq2xxs_sub_value(g1, sb, x, a, b));
        ua1 = __fadd_rn(ua1, iq2xxs_sub_value(u1, sb, x, a, b));
    }
}

extern "C" __global__ void moe_gate_up_tab_q8_iq2_xxs(const u64* __restrict__ tab, const int* __restrict__ ids,
                                                      const u8* __restrict__ xq, float* __restrict__ act, int ff,
                                                      int hidden, int k) {
    const int warps = blockDim.x / WARP, wid = threadIdx.x / WARP;
    const int lane = threadIdx.x % WARP;
    const int per_warp = (ff + gridDim.x * warps - 1) / (gridDim.x * warps);
    stage_iq2_q8_tables();  // depends on nothing: before the wait
    pdl_enter();            // ids and xq come from the kernels before
    const size_t te = (size_t)blockIdx.z * k + blockIdx.y;
    const u64* parts = tab + 3 * (size_t)ids[te];
    const size_t rb = row_bytes<T_IQ2_XXS>(hidden);
    for (int r = 0; r < per_warp; ++r) {
        const int row = (blockIdx.x * per_warp + r) * warps + wid;
        if (row >= ff) break;
        prefetch_l2((const u8*)parts[0] + (size_t)row * rb, rb, lane, WARP);
        prefetch_l2((const u8*)parts[1] + (size_t)row * rb, rb, lane, WARP);
    }
    const Q8Row x = q8_row((u8*)xq + (size_t)blockIdx.z * Q8_ROW_BYTES(hidden), hidden);
    for (int r = 0; r < per_warp; ++r) {
        const int row = (blockIdx.x * per_warp + r) * warps + wid;
        if (row >= ff) return;
        const size_t off = (size_t)row * rb;
        float ga, ua;
        iq2xxs_gate_up_q8((const u8*)parts[0] + off, (const u8*)parts[1] + off, x, hidden, lane, ga, ua);
        const float gv = warp_sum(ga), uv = warp_sum(ua);
        if (lane == 0) act[te * ff + row] = siluf_(gv) * uv;
    }
}

// The row a warp of the down kernels (moe_down_combine_tab_*) works on: `parts` warps per row,
// what the grid gives (the host launches hidden * parts / warps blocks), warp `part` of them.
struct DownRow {
    int parts, row, part;
    bool valid;
};

__device__ __forceinline__ DownRow down_row(int hidden) {
    const int warps = blockDim.x / WARP, wid = threadIdx.x / WARP;
    DownRow d;
    d.parts = max(1, min(warps, (int)((size_t)gridDim.x * warps / hidden)));
    d.row = blockIdx.x * (warps / d.parts) + wid / d.parts;
    d.part = wid % d.parts;
    d.valid = d.row < hidden;
    return d;
}

// The down kernels' end: the warp's sum `s` (lane-summed), with sum_parts the row's parts added
// in order (else part 0's own sum stands), then x[t][row] += that + sigmoid(gate_logit[t]) ·
// shared[t][row]. Every thread of the block calls it (a barrier when the row has parts).
__device__ __forceinline__ void down_row_finish(const DownRow& d, float s, bool sum_parts, size_t t, int hidden,
                                                float* __restrict__ x, const float* __restrict__ shared,
                                                const float* __restrict__ gate_logit) {
    __shared__ float red[32];
    const int wid = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    if (d.parts > 1) {
        if (lane == 0) red[wid] = s;
        __syncthreads();
        if (d.part == 0 && lane == 0 && sum_parts) {
            s = 0.0f;
            for (int p = 0; p < d.parts; ++p) s += red[wid + p];
        }
    }
    if (d.valid && d.part == 0 && lane == 0) {
        const size_t at = t * hidden + d.row;
        x[at] += s + sigmoidf_(gate_logit[t]) * shared[at];
    }
}

// ----- IQ2_XXS down projection on 8-bit activations (REDLITE_CUDA_Q8_MOE_DOWN; on by default) -----
// moe_gate_up_tab_q8q_iq2_xxs(tab, ids, xq, act, actq, ff, hidden, k, dstride): moe_gate_up_tab_q8_iq2_xxs
// with a block owning 32 consecutive rows of one (token, choice), so that it also quantises their
// 32 activations as one q8 block of that pair's row at actq + (t k + c) * Q8_ROW_BYTES(ff)
// (q8_block32; f32 act written too). Warp w of the block's W = blockDim.x / 32 warps takes rows
// w, w + W, ... (W = 32: one row each; 16: two, so that two 512-thread blocks fit an SM: at 64
// registers a 1,024-thread block has an SM to itself and a decode step's 160 blocks take two
// waves on 132 SMs; 16 is the default, +1.4 % decode). Launch: grid = (ff / 32, k, tokens),
// block = 32 * W threads, W = 8, 16 or 32 (ff a multiple of 32).
// Rows lo .. hi - 1 of gate/up unit bx of pair te (token, choice): warp w takes rows lo + w,
// lo + w + W, ... (W = blockDim.x / 32 warps), with PAIR rows r and r + W together (both rows'
// loads in flight before either's arithmetic); each row's activation silu(gate . x) * (up . x)
// into act_s[r] and act.
template <bool PAIR>
__device__ __forceinline__ void gate_up_rows_span(const u8* __restrict__ gate, const u8* __restrict__ up,
                                                  const Q8Row& x, float* __restrict__ act, float* act_s, int ff,
                                                  int hidden, size_t te, int bx, int lo, int hi) {
    const int wid = threadIdx.x / WARP, lane = threadIdx.x % WARP, nw = blockDim.x / WARP;
    const size_t rb = row_bytes<T_IQ2_XXS>(hidden);
    for (int r = lo + wid; r < hi; r += PAIR ? 2 * nw : nw) {
        const int row = bx * WARP + r;
        const size_t off = (size_t)row * rb;
        if (PAIR && r + nw < hi) {
            const size_t off1 = off + (size_t)nw * rb;
            float ga, ua, ga1, ua1;
            iq2xxs_gate_up2_q8(gate + off, up + off, gate + off1, up + off1, x, hidden, lane, ga, ua, ga1, ua1);
            const float gv = warp_sum(ga), uv = warp_sum(ua), gv1 = warp_sum(ga1), uv1 = warp_sum(ua1);
            if (lane == 0) {
                const float a = siluf_(gv) * uv, a1 = siluf_(gv1) * uv1;
                act_s[r] = a;
                act_s[r + nw] = a1;
                act[te * ff + row] = a;
                act[te * ff + row + nw] = a1;
            }
            continue;
        }
        float ga, ua;
        iq2xxs_gate_up_q8(gate + off, up + off, x, hidden, lane, ga, ua);
        const float gv = warp_sum(ga), uv = warp_sum(ua);
        if (lane == 0) {
            const float a = siluf_(gv) * uv;
            act_s[r] = a;
            act[te * ff + row] = a;
        }
    }
}

// The rows of moe_gate_up_tab_q8q_iq2_xxs's block for (token t = blockIdx.z, choice blockIdx.y), its
// expert `id`: act and the q8 block of actq (every thread calls it; after the tables are staged).
// (bx, by, bz): the block's place in that grid (blockIdx, or moe_route_gate_up_q8q's virtual block).
template <bool PAIR>
__device__ __forceinline__ void gate_up_q8q_rows(const u8* __restrict__ gate, const u8* __restrict__ up,
                                                 const u8* __restrict__ xq, float* __restrict__ act,
                                                 u8* __restrict__ actq, int ff, int hidden, int k, int bx, int by,
                                                 int bz) {
    __shared__ float act_s[WARP];
    // Phases under REDLITE_TRACE (block 0's thread 0): 21 its rows, 22 the barrier, 23 the q8 tail.
    long long tt = trace_clock();
    const int wid = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const size_t te = (size_t)bz * k + by;
    const Q8Row x = q8_row((u8*)xq + (size_t)bz * Q8_ROW_BYTES(hidden), hidden);
    gate_up_rows_span<PAIR>(gate, up, x, act, act_s, ff, hidden, te, bx, 0, WARP);
    tt = trace_phase(21, tt);
    __syncthreads();
    tt = trace_phase(22, tt);
    if (wid == 0) {
        q8_row_block32(act_s[lane], lane, actq + te * Q8_ROW_BYTES(ff), ff, bx);
    }
    trace_phase(23, tt);
}

// Where expert `id`'s part p (0 gate, 1 up, 2 down) is: the table's entry, or with `dstride` != 0
// (every expert resident: the table is affine in the id, expert e's parts at expert 0's +
// e · dstride; the host checks it) expert 0's entry `e0` (read before the wait: the table is the
// host's, written before the call) plus id · dstride, one dependent load fewer.
__device__ __forceinline__ const u8* expert_part(const u64* __restrict__ tab, int id, int p, u64 dstride, u64 e0) {
    return dstride != 0 ? (const u8*)(e0 + (u64)id * dstride) : (const u8*)tab[3 * (size_t)id + p];
}

// TAB_PAIR (default 1, session 22): moe_gate_up_tab_q8q_iq2_xxs (the verify rows' and short
// prompts' gate/up) takes a warp's two rows together, as the decode step's fused route kernel does
// (both rows' loads in flight before either's arithmetic; each row's sums in the one-row order, so
// the same bits). 0: a row at a time.
#ifndef TAB_PAIR
#define TAB_PAIR 1
#endif

// moe_gate_up_tab_q8q_iq2_xxs(..., dstride): the parts through expert_part.
extern "C" __global__ __launch_bounds__(1024) void moe_gate_up_tab_q8q_iq2_xxs(
    const u64* __restrict__ tab, const int* __restrict__ ids, const u8* __restrict__ xq, float* __restrict__ act,
    u8* __restrict__ actq, int ff, int hidden, int k, u64 dstride) {
    stage_iq2_q8_tables();  // depends on nothing: before the wait
    const u64 g0 = dstride != 0 ? tab[0] : 0, u0 = dstride != 0 ? tab[1] : 0;
    pdl_enter();  // ids and xq come from the kernels before
    const int id = ids[(size_t)blockIdx.z * k + blockIdx.y];
    gate_up_q8q_rows<TAB_PAIR != 0>(expert_part(tab, id, 0, dstride, g0), expert_part(tab, id, 1, dstride, u0), xq, act,
                            actq, ff, hidden, k, blockIdx.x, blockIdx.y, blockIdx.z);
}

// GU_TOK_MAX (default 4): the most tokens a block of moe_gate_up_tok_q8q_iq2_xxs takes.
#ifndef GU_TOK_MAX
#define GU_TOK_MAX 4
#endif

// moe_gate_up_tok_q8q_iq2_xxs(tab, ids, xq, act, actq, ff, hidden, k, dstride, n, tile):
// moe_gate_up_tab_q8q_iq2_xxs for a call of n tokens with `tile` (1 .. GU_TOK_MAX) of them a block:
// block (bx, c, z) takes unit bx of choice c of tokens z · tile, ...: the tables staged once a
// block, and a warp's row of every token's expert loaded together (as the one-token kernel pairs
// two rows of one expert). Each row's sums take the one-token function's operations in its order
// and each token's 32 activations the same q8 block: the same bits.
// Launch: grid = (ff / 32, k, ceil(n / tile)), block = 32 * W threads (W >= GU_TOK_MAX).
extern "C" __global__ __launch_bounds__(512, 2) void moe_gate_up_tok_q8q_iq2_xxs(
    const u64* __restrict__ tab, const int* __restrict__ ids, const u8* __restrict__ xq, float* __restrict__ act,
    u8* __restrict__ actq, int ff, int hidden, int k, u64 dstride, int n, int tile) {
    __shared__ float act_s[GU_TOK_MAX][WARP];
    stage_iq2_q8_tables();  // depends on nothing: before the wait
    const u64 g0 = dstride != 0 ? tab[0] : 0, u0 = dstride != 0 ? tab[1] : 0;
    pdl_enter();  // ids and xq come from the kernels before
    const int wid = threadIdx.x / WARP, lane = threadIdx.x % WARP, nw = blockDim.x / WARP;
    const int per = min(max(tile, 1), GU_TOK_MAX);
    const int t0 = blockIdx.z * per, nt = min(per, n - t0);
    const int bx = blockIdx.x, c = blockIdx.y;
    const size_t rb = row_bytes<T_IQ2_XXS>(hidden);
    const u8* gate[GU_TOK_MAX];
    const u8* up[GU_TOK_MAX];
#pragma unroll
    for (int j = 0; j < GU_TOK_MAX; ++j) {
        const int id = ids[(size_t)(t0 + min(j, nt - 1)) * k + c];  // past the call: unused
        gate[j] = expert_part(tab, id, 0, dstride, g0);
        up[j] = expert_part(tab, id, 1, dstride, u0);
    }
    for (int r = wid; r < WARP; r += nw) {
        const int row = bx * WARP + r;
        const size_t off = (size_t)row * rb;
        float ga[GU_TOK_MAX], ua[GU_TOK_MAX];
#pragma unroll
        for (int j = 0; j < GU_TOK_MAX; ++j) {
            ga[j] = 0.0f;
            ua[j] = 0.0f;
        }
#pragma unroll 2
        for (int sb = lane; sb < hidden / 32; sb += WARP) {
#pragma unroll
            for (int j = 0; j < GU_TOK_MAX; ++j) {
                if (j < nt) {
                    const Q8Row x = q8_row((u8*)xq + (size_t)(t0 + j) * Q8_ROW_BYTES(hidden), hidden);
                    const int4 a = *(const int4*)(x.q + 32 * sb), b = *(const int4*)(x.q + 32 * sb + 16);
                    ga[j] = __fadd_rn(ga[j], iq2xxs_sub_value(gate[j] + off, sb, x, a, b));
                    ua[j] = __fadd_rn(ua[j], iq2xxs_sub_value(up[j] + off, sb, x, a, b));
                }
            }
        }
#pragma unroll
        for (int j = 0; j < GU_TOK_MAX; ++j) {
            const float gv = warp_sum(ga[j]), uv = warp_sum(ua[j]);
            if (lane == 0 && j < nt) {
                const float a = siluf_(gv) * uv;
                act_s[j][r] = a;
                act[((size_t)(t0 + j) * k + c) * ff + row] = a;
            }
        }
    }
    __syncthreads();
    if (wid < nt) {
        q8_row_block32(act_s[wid][lane], lane, actq + ((size_t)(t0 + wid) * k + c) * Q8_ROW_BYTES(ff), ff, bx);
    }
}

// moe_gate_up_route_q8q_iq2_xxs(logits, n_expert, tab, ids, wts, xq, act, actq, ff, hidden, k, dstride): the
// router's top-k and moe_gate_up_tab_q8q_iq2_xxs in one launch: warp 0 of every block computes
// moe_router_warp's choices of its token from the router logits (router_warp_row: the same ids and
// weights bit for bit; each block redoes the cheap top-k instead of waiting for a launch of its
// own), the blocks (0, 0, t) write them to ids / wts (the down kernel and the expert cache read
// them there), and each block runs its choice's rows. k <= 32, n_expert <= 32 * ROUTER_VPL.
// Launch: as moe_gate_up_tab_q8q_iq2_xxs.
template <bool PAIR>
__device__ __forceinline__ void gate_up_route_body(const float* __restrict__ logits, int n_expert,
                                                   const u64* __restrict__ tab, int* __restrict__ ids,
                                                   float* __restrict__ wts, const u8* __restrict__ xq,
                                                   float* __restrict__ act, u8* __restrict__ actq, int ff, int hidden,
                                                   int k, u64 dstride) {
    __shared__ int ids_s[WARP];
    __shared__ float wts_s[WARP];
    stage_iq2_q8_tables();  // depends on nothing: before the wait
    const u64 g0 = dstride != 0 ? tab[0] : 0, u0 = dstride != 0 ? tab[1] : 0;
    pdl_enter();  // the logits and xq come from the kernels before
    const size_t t = blockIdx.z;
    const bool par = TOPK_PAR && router_block_topk(logits + t * n_expert, n_expert, k, ids_s, wts_s);  // block-uniform
    if (threadIdx.x < WARP) {
        if (!par) router_warp_row(logits + t * n_expert, n_expert, k, ids_s, wts_s);
        __syncwarp();
        if (blockIdx.x == 0 && blockIdx.y == 0 && (int)threadIdx.x < k) {
            ids[t * k + threadIdx.x] = ids_s[threadIdx.x];
            wts[t * k + threadIdx.x] = wts_s[threadIdx.x];
        }
    }
    __syncthreads();
    const int id = ids_s[blockIdx.y];
    gate_up_q8q_rows<PAIR>(expert_part(tab, id, 0, dstride, g0), expert_part(tab, id, 1, dstride, u0), xq, act,
                           actq, ff, hidden, k, blockIdx.x, blockIdx.y, blockIdx.z);
}

extern "C" __global__ __launch_bounds__(1024) void moe_gate_up_route_q8q_iq2_xxs(
    const float* __restrict__ logits, int n_expert, const u64* __restrict__ tab, int* __restrict__ ids,
    float* __restrict__ wts, const u8* __restrict__ xq, float* __restrict__ act, u8* __restrict__ actq, int ff,
    int hidden, int k, u64 dstride) {
    gate_up_route_body<false>(logits, n_expert, tab, ids, wts, xq, act, actq, ff, hidden, k, dstride);
}

// moe_gate_up_route2_q8q_iq2_xxs: the same with a warp's two rows (16-warp blocks) walked together
// (the default; REDLITE_CUDA_MOE_GU_PAIR=0 the one above): the same bits, one memory round trip
// fewer per warp.
extern "C" __global__ __launch_bounds__(1024) void moe_gate_up_route2_q8q_iq2_xxs(
    const float* __restrict__ logits, int n_expert, const u64* __restrict__ tab, int* __restrict__ ids,
    float* __restrict__ wts, const u8* __restrict__ xq, float* __restrict__ act, u8* __restrict__ actq, int ff,
    int hidden, int k, u64 dstride) {
    gate_up_route_body<true>(logits, n_expert, tab, ids, wts, xq, act, actq, ff, hidden, k, dstride);
}

// ----- The router's logits, its top-k and the routed gate/up in one launch (REDLITE_CUDA_ROUTE_FUSED) -----
// (grid_sync: common.cu)
// ROUTE_KO (compile-time, default 0; timing only, the outputs are garbage): 1 leaves the router's
// rows and the grid barrier out of the fused route kernel (the top-k then reads the logits the
// layer before left), 2 its top-k (the layer's choices of the step before), 3 neither but the
// choices replaced by the step before's after the top-k (what 2 gains from reusing the experts).
// What moving either off the chain could win. 4 / 5 (session 34): the gate/up rows left out in
// blocks 132 .. (the second block on 28 of the H200's 132 SMs) / in blocks 0 .. 27 (as many units,
// on SMs with one block): whether the SMs holding two blocks set the kernel's end. 6 (session
// 34): the router rows' x not loaded (ones instead; on ROUTE_W_EARLY's path): what their loads
// and partials after the wait owe to x.
#ifndef ROUTE_KO
#define ROUTE_KO 0
#endif
// ROUTE_ROWS2 (compile-time, default 1 since session 34: +0.7 % decode on the H200, 407.09 against
// 404.12 tok/s, bit-identical): a block half's router rows of (at most) two virtual blocks in one
// round (row_partial_pair_f32: both rows' loads together, each row in row_partial's order, the
// same logits), one barrier. Written for two rounds a block, but with the router split 4 warps a
// row (REDLITE_CUDA_ROUTER_LANE_ITERS=4, session 19) the 80B layout's 257 virtual blocks already
// took one round over the 320 halves: there it saves the loop's second barrier.
#ifndef ROUTE_ROWS2
#define ROUTE_ROWS2 1
#endif
// ROUTE_W_EARLY (compile-time, default 1 since session 34: +2.0 % decode on the H200, 427.01
// against 418.48 tok/s, bit-identical; with ROUTE_ROWS2): a lane's router weights (up to four
// groups of 4 of its block half's one row) loaded into registers before the wait, and after it
// all of x's groups at once, so that the rows take one L2 round trip after the wait instead of
// row_partial_pair_f32's two (unrolled by 2 over 4 groups): the rows' loads and partials 1.88 ->
// 0.64 µs a layer. (Session 34's first form, two groups of each of two rows, never ran at full size.)
#ifndef ROUTE_W_EARLY
#define ROUTE_W_EARLY 1
#endif

// The fused route kernel's body: block b (512 threads, two 8-warp router groups) owns gate/up
// unit b (32 rows of one choice).
__device__ __forceinline__ void route_gate_up_body(
    const float* __restrict__ xn, int cols, int parts, const u8* __restrict__ w0, float* __restrict__ y0, int r0,
    const u8* __restrict__ w1, float* __restrict__ y1, int r1, int n_expert, const u64* __restrict__ tab,
    int* __restrict__ ids, float* __restrict__ wts, const u8* __restrict__ xq, float* __restrict__ act,
    u8* __restrict__ actq, int ff, int hidden, int k, u64 dstride, unsigned long long* __restrict__ counter) {
    __shared__ float red[2][MVF_WARPS];
#if ROUTE_ROWS2
    __shared__ float red2[2][MVF_WARPS];
#endif
    __shared__ int ids_s[WARP];
    __shared__ float wts_s[WARP];
    // Phases under REDLITE_TRACE (common.cu): 1 launch to the end of the wait, 2 router rows, 3
    // grid barrier, 4 top-k, 5 gate/up rows (block 0).
    long long tt = trace_start();
    const int wid = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int groups = (int)blockDim.x / (WARP * MVF_WARPS);  // router groups a block: 2 or 1
    const int half = wid / MVF_WARPS, w = wid % MVF_WARPS;
    const int per = MVF_WARPS / parts;  // rows of a matvec3_x_f32 block
    const int part = w % parts, w0p = w - part;
    const int nb = gridDim.x;
    const int vblocks = (r0 + per - 1) / per + (r1 + per - 1) / per;
    const size_t rbytes = (size_t)cols * 4;
    // Virtual block vb's row for this warp (matvec3_x_f32's mvf_matrix and mvf_first), or null.
    auto row_of = [&](int vb, float*& y) -> const u8* {
        const int nb0 = (r0 + per - 1) / per;
        const int m = vb < nb0 ? 0 : 1, b = vb < nb0 ? vb : vb - nb0;
        const int row = b * per + w / parts, rows = m == 0 ? r0 : r1;
        if (row >= rows) return nullptr;
        y = (m == 0 ? y0 : y1) + row;
        return (m == 0 ? w0 : w1) + (size_t)row * rbytes;
    };
    // The block's router rows into L2 while the kernel before runs.
    for (int vb = groups * blockIdx.x + half; vb < vblocks; vb += groups * nb) {
        float* y;
        const u8* wr = row_of(vb, y);
        if (wr != nullptr) prefetch_l2(wr, rbytes, part * WARP + lane, parts * WARP);
    }
#if ROUTE_ROWS2 && ROUTE_W_EARLY
    // The lane's router weights into registers before the wait (they do not depend on the kernels
    // before), where its block half has one row (the 80B layout: 257 virtual blocks of 2 rows over
    // 320 halves) and the lane at most 4 groups of it (2,048 columns over 4 warps).
    const int gs4 = cols / GroupDot<T_F32>::G, g_lane = part * WARP + lane, g_stride = parts * WARP;
    const int wva = groups * blockIdx.x + half;
    const bool w_early = vblocks <= 2 * groups * nb && wva + groups * nb >= vblocks &&
                         cols % GroupDot<T_F32>::G == 0 && g_lane + 4 * g_stride >= gs4;
    float4 wra[4];
    if (w_early) {
        float* yd = nullptr;
        const u8* wa = wva < vblocks ? row_of(wva, yd) : nullptr;
#pragma unroll
        for (int it = 0; it < 4; ++it) {
            const int gi = g_lane + it * g_stride;
            const size_t o = (size_t)gi * GroupDot<T_F32>::G * T_F32::BB;
            wra[it] = wa != nullptr && gi < gs4 ? GroupDot<T_F32>::load4(wa + o)
                                                : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    }
#endif
    stage_iq2_q8_tables();
    const u64 g0 = dstride != 0 ? tab[0] : 0, u0 = dstride != 0 ? tab[1] : 0;
    pdl_enter();  // xn and xq come from the kernels before
    tt = trace_phase(1, tt);
#if ROUTE_KO != 1
#if ROUTE_ROWS2
    if (vblocks <= 2 * groups * nb) {
        // The block half's (at most) two virtual blocks at once: one round of loads, reductions
        // and barrier instead of two.
        const int va = groups * blockIdx.x + half, vb2 = va + groups * nb;
        float *ya = nullptr, *yb = nullptr;
        const u8* wa = va < vblocks ? row_of(va, ya) : nullptr;
        const u8* wb = vb2 < vblocks ? row_of(vb2, yb) : nullptr;
        float acc_a = 0.0f, acc_b = 0.0f;
        long long tr = trace_clock();
#if ROUTE_W_EARLY
        if (w_early) {
            // row_partial_pair_f32's sums on the preloaded weights (its second row is null here):
            // the same groups in the same order, the same expression; all of x's loads at once.
            float4 xu[4];
#pragma unroll
            for (int it = 0; it < 4; ++it) {
                const int gi = g_lane + it * g_stride;
#if ROUTE_KO == 6
                xu[it] = make_float4(1.0f, 1.0f, 1.0f, 1.0f);  // timing only: x not loaded
                (void)gi;
#else
                xu[it] = gi < gs4 ? GroupDot<T_F32>::load4((const u8*)(xn + (size_t)gi * GroupDot<T_F32>::G))
                                  : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#endif
            }
#pragma unroll
            for (int it = 0; it < 4; ++it) {
                if (g_lane + it * g_stride < gs4) acc_a += GroupDot<T_F32>::dot4(wra[it], xu[it]);
            }
        } else
#endif
            row_partial_pair_f32(wa, wb, xn, cols, lane, part, parts, acc_a, acc_b);
        tr = trace_phase(30, tr);  // (the clock after the loads' use: their latency included)
        const float sa = warp_sum(acc_a), sb = warp_sum(acc_b);
        if (lane == 0) {
            red[half][w] = sa;
            red2[half][w] = sb;
        }
        tr = trace_phase(31, tr);
        __syncthreads();
        tr = trace_phase(32, tr);
        if (part == 0 && lane == 0) {
            if (wa != nullptr) {
                float sum = 0.0f;
                for (int p = 0; p < parts; ++p) sum += red[half][w0p + p];
                *ya = 1.0f * sum;
            }
            if (wb != nullptr) {
                float sum = 0.0f;
                for (int p = 0; p < parts; ++p) sum += red2[half][w0p + p];
                *yb = 1.0f * sum;
            }
        }
        trace_phase(33, tr);
    } else
#endif
    for (int base = groups * blockIdx.x; base < vblocks; base += groups * nb) {
        float* y = nullptr;
        const u8* wr = base + half < vblocks ? row_of(base + half, y) : nullptr;
        const float acc = wr != nullptr ? row_partial<T_F32>(wr, xn, cols, lane, part, parts) : 0.0f;
        const float v = warp_sum(acc);
        if (lane == 0) red[half][w] = v;
        __syncthreads();
        if (wr != nullptr && part == 0 && lane == 0) {
            float sum = 0.0f;
            for (int p = 0; p < parts; ++p) sum += red[half][w0p + p];
            *y = 1.0f * sum;
        }
        __syncthreads();
    }
    tt = trace_phase(2, tt);
    grid_sync(counter, nb);
#endif
    tt = trace_phase(3, tt);
    const int slices = ff / WARP;
    const int unit = blockIdx.x;
    const int bx = unit % slices, by = unit / slices;
#if ROUTE_KO == 2
    // Timing only: the layer's choices of the step before (its ids buffer), no top-k.
    if ((int)threadIdx.x < k) {
        ids_s[threadIdx.x] = ids[threadIdx.x];
        wts_s[threadIdx.x] = wts[threadIdx.x];
    }
#else
    const bool par = TOPK_PAR && router_block_topk(y0, n_expert, k, ids_s, wts_s);  // block-uniform
    if (threadIdx.x < WARP) {
        if (!par) router_warp_row(y0, n_expert, k, ids_s, wts_s);
        __syncwarp();
        if (ROUTE_KO != 3 && blockIdx.x == 0 && (int)threadIdx.x < k) {
            ids[threadIdx.x] = ids_s[threadIdx.x];
            wts[threadIdx.x] = wts_s[threadIdx.x];
        }
    }
#endif
#if ROUTE_KO == 3
    // Timing only: the top-k as always, then the layer's choices of the step before instead.
    __syncthreads();
    if ((int)threadIdx.x < k) {
        ids_s[threadIdx.x] = ids[threadIdx.x];
        wts_s[threadIdx.x] = wts[threadIdx.x];
    }
#endif
    __syncthreads();
    tt = trace_phase(4, tt);
    const int id = ids_s[by];
    const u8* gate = expert_part(tab, id, 0, dstride, g0);
    const u8* up = expert_part(tab, id, 1, dstride, u0);
#if ROUTE_KO == 4
    if (blockIdx.x >= 132) return;
#elif ROUTE_KO == 5
    if (blockIdx.x < 28) return;
#endif
    gate_up_q8q_rows<true>(gate, up, xq, act, actq, ff, hidden, k, bx, by, 0);
    trace_phase(5, tt);
}

// moe_route_gate_up_q8q_iq2_xxs(xn, cols, parts, w0, y0, r0, w1, y1, r1, n_expert, tab, ids, wts, xq, act,
// actq, ff, hidden, k, dstride, counter): matvec3_x_f32 on the router matrices (w0: the router,
// r0 = n_expert rows into the logits y0; w1: the shared expert's gate vector, r1 rows into y1;
// split: `parts` slices a row, one row a warp group), a grid barrier, then
// moe_gate_up_route2_q8q_iq2_xxs on those logits, for one token. Block b takes gate/up block
// (b % (ff / 32), b / (ff / 32)) of the separate kernel; for the logits each half of a block
// (8 warps: a matvec3_x_f32 block) takes that kernel's block half, half + 2 B, ...: the same lane
// partials and the same sums of the slices, so every output is the separate kernels' bit for bit.
// The launch boundary between the router and its top-k becomes a barrier, and the gate/up blocks
// are resident (tables staged) before the logits exist.
// Launch: grid = (ff / 32) * k blocks (all resident at once), block = 512 threads.
extern "C" __global__ __launch_bounds__(512, 2) void moe_route_gate_up_q8q_iq2_xxs(
    const float* __restrict__ xn, int cols, int parts, const u8* __restrict__ w0, float* __restrict__ y0, int r0,
    const u8* __restrict__ w1, float* __restrict__ y1, int r1, int n_expert, const u64* __restrict__ tab,
    int* __restrict__ ids, float* __restrict__ wts, const u8* __restrict__ xq, float* __restrict__ act,
    u8* __restrict__ actq, int ff, int hidden, int k, u64 dstride, unsigned long long* __restrict__ counter) {
    route_gate_up_body(xn, cols, parts, w0, y0, r0, w1, y1, r1, n_expert, tab, ids, wts, xq, act, actq, ff,
                       hidden, k, dstride, counter);
}

// DOWN_LOOP (default 1): moe_down_combine_tab_q8_iq2_xxs walks its (choice, sub-block) pairs
// without a division per pair and unrolled (0: a division per pair, not unrolled).
#ifndef DOWN_LOOP
#define DOWN_LOOP 1
#endif

// Pair (te, sb) of the q8 down kernels: weight[te] · (sub-block sb of the down row at `off` of
// choice te's expert, against sub-block sb of its q8 activation row).
__device__ __forceinline__ float down_pair_q8(const u64* __restrict__ tab, const int* __restrict__ ids,
                                              const float* __restrict__ weight, const u8* __restrict__ actq,
                                              size_t te, int sb, size_t off, int ff, u64 dstride, u64 d0) {
    const u8* down = expert_part(tab, ids[te], 2, dstride, d0) + off;
    const Q8Row a = q8_row((u8*)actq + te * Q8_ROW_BYTES(ff), ff);
    const int4 q0 = *(const int4*)(a.q + 32 * sb), q1 = *(const int4*)(a.q + 32 * sb + 16);
    const float v = iq2xxs_sub_value(down, sb, a, q0, q1);
    return __fmul_rn(weight[te], v);
}

// moe_down_combine_tab_q8_iq2_xxs(tab, ids, weight, actq, x, shared, gate_logit, hidden, ff, k,
// dstride): moe_down_combine_tab_iq2_xxs on the q8 activation rows of moe_gate_up_tab_q8q_iq2_xxs: the
// warps of a row share out its (choice, sub-block) pairs, lane l adding weight[c] * (sub-block
// value) over pairs l, l + 32 · parts, ... (choice-major), then the parts in order.
// Launch: as moe_down_combine_tab (grid = (hidden * parts / warps, tokens), block = 32 * warps).
extern "C" __global__ void moe_down_combine_tab_q8_iq2_xxs(const u64* __restrict__ tab, const int* __restrict__ ids,
                                                           const float* __restrict__ weight,
                                                           const u8* __restrict__ actq, float* __restrict__ x,
                                                           const float* __restrict__ shared,
                                                           const float* __restrict__ gate_logit, int hidden, int ff,
                                                           int k, u64 dstride) {
    long long tt = trace_start(6);
    const int lane = threadIdx.x % WARP;
    const size_t t = blockIdx.y;
    const DownRow d = down_row(hidden);
    const size_t off = (size_t)d.row * row_bytes<T_IQ2_XXS>(ff);
    stage_iq2_q8_tables();
    const u64 d0 = dstride != 0 ? tab[2] : 0;  // before the wait: see expert_part
    pdl_enter();  // ids, actq and x come from the kernels before
    tt = trace_phase(7, tt);
    const int sbs = ff / 32;
    float acc = 0.0f;
    if (d.valid) {
        // Pair i = c · sbs + sb. DOWN_LOOP: walked without a division per pair (c and sb advance
        // by the step's quotient and remainder), unrolled so that several pairs' loads are in
        // flight (the trip count is k · sbs / step, 2–3 at decode): the same pairs in the same
        // order. (Braces outside the #if: kernels.rs's tests match them in the source text.)
        const int step = d.parts * WARP, n = k * sbs;
        const int dc = step / sbs, ds = step - dc * sbs;
        const int i0 = d.part * WARP + lane;
        int c = i0 / sbs, sb = i0 - c * sbs;
#if DOWN_LOOP
#pragma unroll 4
#endif
        for (int i = i0; i < n; i += step) {
#if !DOWN_LOOP
            c = i / sbs;
            sb = i - c * sbs;
#endif
            acc = __fadd_rn(acc, down_pair_q8(tab, ids, weight, actq, t * k + c, sb, off, ff, dstride, d0));
#if DOWN_LOOP
            c += dc;
            sb += ds;
            if (sb >= sbs) {
                sb -= sbs;
                ++c;
            }
#endif
        }
    }
    down_row_finish(d, warp_sum(acc), true, t, hidden, x, shared, gate_logit);
    trace_phase(8, tt);
}

// DOWN_TOK_MAX (default 8): the most tokens a block of moe_down_combine_tok_q8_iq2_xxs takes.
#ifndef DOWN_TOK_MAX
#define DOWN_TOK_MAX 8
#endif

// moe_down_combine_tok_q8_iq2_xxs(tab, ids, weight, actq, x, shared, gate_logit, hidden, ff, k,
// dstride, n, tile): moe_down_combine_tab_q8_iq2_xxs for a call of n tokens with `tile` (1 ..
// DOWN_TOK_MAX) of them a block: the tables staged once a block instead of once a token, the
// tokens' loads of a pair in flight together, one barrier for all of them. Each token's lane sum
// takes the one-token kernel's pairs in its order, its row the parts in order: the same bits.
// Launch: grid = (hidden * parts / warps, ceil(n / tile)), block = 32 * warps.
extern "C" __global__ void moe_down_combine_tok_q8_iq2_xxs(const u64* __restrict__ tab, const int* __restrict__ ids,
                                                           const float* __restrict__ weight,
                                                           const u8* __restrict__ actq, float* __restrict__ x,
                                                           const float* __restrict__ shared,
                                                           const float* __restrict__ gate_logit, int hidden, int ff,
                                                           int k, u64 dstride, int n, int tile) {
    __shared__ float red[DOWN_TOK_MAX][32];
    const int wid = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const DownRow d = down_row(hidden);
    const size_t off = (size_t)d.row * row_bytes<T_IQ2_XXS>(ff);
    stage_iq2_q8_tables();
    const u64 d0 = dstride != 0 ? tab[2] : 0;  // before the wait: see expert_part
    pdl_enter();  // ids, actq and x come from the kernels before
    const int per = min(max(tile, 1), DOWN_TOK_MAX);
    const int t0 = blockIdx.y * per, nt = min(per, n - t0);
    const int sbs = ff / 32;
    float acc[DOWN_TOK_MAX];
#pragma unroll
    for (int j = 0; j < DOWN_TOK_MAX; ++j) acc[j] = 0.0f;
    if (d.valid) {
        const int step = d.parts * WARP, np = k * sbs;
        const int dc = step / sbs, ds = step - dc * sbs;
        const int i0 = d.part * WARP + lane;
        int c = i0 / sbs, sb = i0 - c * sbs;
        for (int i = i0; i < np; i += step) {
#pragma unroll
            for (int j = 0; j < DOWN_TOK_MAX; ++j) {
                if (j < nt) {
                    const size_t te = (size_t)(t0 + j) * k + c;
                    acc[j] = __fadd_rn(acc[j], down_pair_q8(tab, ids, weight, actq, te, sb, off, ff, dstride, d0));
                }
            }
            c += dc;
            sb += ds;
            if (sb >= sbs) {
                sb -= sbs;
                ++c;
            }
        }
    }
    // down_row_finish for every token, with one barrier.
#pragma unroll
    for (int j = 0; j < DOWN_TOK_MAX; ++j) acc[j] = warp_sum(acc[j]);
    if (d.parts > 1) {
        if (lane == 0) {
#pragma unroll
            for (int j = 0; j < DOWN_TOK_MAX; ++j) red[j][wid] = acc[j];
        }
        __syncthreads();
    }
    if (d.valid && d.part == 0 && lane == 0) {
        for (int j = 0; j < nt; ++j) {
            float s = acc[j];
            if (d.parts > 1) {
                s = 0.0f;
                for (int p = 0; p < d.parts; ++p) s += red[j][wid + p];
            }
            const size_t t = t0 + j, at = t * hidden + d.row;
            x[at] += s + sigmoidf_(gate_logit[t]) * shared[at];
        }
    }
}

// moe_down_combine_tab_<type>(tab, ids, weight, act, x, shared, gate_logit, hidden, ff, k): the routed experts' down projections, their weighted sum (in
// choice order) and the MoE residual in one: for token t = blockIdx.y, x[t][r] += sum_c
// weight[t][c] * (down_{ids[t][c]}[r] . act[t][c]) + sigmoid(gate_logit[t]) * shared[t][r]. For
// group-decoded types the warp's lanes share out the (choice, group) pairs of all k experts of the
// row (k times the loads in flight of one row, one warp sum): lane l sums weight[c] * group dot
// over pairs l, l + 32, ... (choice-major).
// Launch: block = 32 * warps, grid = (ceil(hidden / warps), tokens).
template <typename T>
__device__ __forceinline__ void moe_down_combine_tab_body(const u64* __restrict__ tab, const int* __restrict__ ids,
                                                          const float* __restrict__ weight,
                                                          const float* __restrict__ act, float* __restrict__ x,
                                                          const float* __restrict__ shared,
                                                          const float* __restrict__ gate_logit, int hidden,
                                                          int ff, int k) {
    const int lane = threadIdx.x % WARP;
    const size_t t = blockIdx.y;
    // The `parts` warps of a row share out its (choice, group) pairs and add their sums in order.
    // Group-decoded types only: otherwise the first warp of the row computes all of it.
    const DownRow d = down_row(hidden);
    const int parts = d.parts, part = d.part;
    const bool valid = d.valid;
    const size_t off = (size_t)d.row * row_bytes<T>(ff);
    if constexpr (iq2_sb<T>()) {
        stage_iq2_sb_tables();
    } else {
        stage_tables<T>();  // before any warp leaves
    }
    pdl_enter();  // ids, act and x come from the kernels before
    // Lane c fetches choice c's row.
    if (valid && part == 0 && lane < k) {
        prefetch_l2((const u8*)tab[3 * (size_t)ids[t * k + lane] + 2] + off, row_bytes<T>(ff), 0, 1);
    }
    float s = 0.0f;
    if constexpr (iq2_sb<T>()) {
        if (valid && part == 0) s = iq2_down_sb(tab, ids + t * k, weight + t * k, act + t * k * ff, off, ff, k, lane);
    } else if constexpr (grouped<T>()) {
        constexpr int G = GroupDot<T>::G, PER_BLOCK = T::QK / G;
        const int groups = ff / G;
        float acc = 0.0f;
        if (valid) {
#pragma unroll 4
            for (int i = part * WARP + lane; i < k * groups; i += parts * WARP) {
                const int c = i / groups, gi = i - c * groups;
                const size_t te = t * k + c;
                const u8* down = (const u8*)tab[3 * (size_t)ids[te] + 2] + off;
                acc += weight[te] * GroupDot<T>::dot(down + (size_t)(gi / PER_BLOCK) * T::BB, gi % PER_BLOCK,
                                                     act + te * ff + (size_t)gi * G);
            }
        }
        s = warp_sum(acc);
    } else if (valid && part == 0) {
        for (int c = 0; c < k; ++c) {
            const size_t te = t * k + c;
            const u8* down = (const u8*)tab[3 * (size_t)ids[te] + 2];
            s += weight[te] * row_dot<T>(down + off, act + te * ff, ff, lane);
        }
    }
    down_row_finish(d, s, grouped<T>() && !iq2_sb<T>(), t, hidden, x, shared, gate_logit);
}

#define MOE_TAB_KERNELS(name, T)                                                                      \
    extern "C" __global__ void moe_gate_up_tab_##name(const u64* tab, const int* ids, const float* x, \
                                                      float* act, int ff, int hidden, int k) {         \
        moe_gate_up_tab_body<T>(tab, ids, x, act, ff, hidden, k);                                     \
    }                                                                                                 \
    extern "C" __global__ void moe_down_combine_tab_##name(const u64* tab, const int* ids,            \
                                                           const float* weight, const float* act,     \
                                                           float* x, const float* shared,             \
                                                           const float* gate_logit, int hidden,       \
                                                           int ff, int k) {                           \
        moe_down_combine_tab_body<T>(tab, ids, weight, act, x, shared, gate_logit, hidden, ff, k);    \
    }

FOR_EACH_TYPE(MOE_TAB_KERNELS)
