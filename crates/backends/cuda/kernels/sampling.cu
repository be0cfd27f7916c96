// The better of two (value, index) candidates: the larger value, the lower index on ties.
__device__ __forceinline__ void argmax_take(float& bv, int& bi, float v, int i) {
    if (v > bv || (v == bv && i < bi)) {
        bv = v;
        bi = i;
    }
}

// The block's best (value, index) of its threads' candidates: valid in thread 0.
__device__ __forceinline__ void argmax_block(float& bv, int& bi) {
    __shared__ float sv[WARP];
    __shared__ int si[WARP];
    for (int o = WARP / 2; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        argmax_take(bv, bi, ov, oi);
    }
    const int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP, nw = blockDim.x / WARP;
    if (lane == 0) {
        sv[wid] = bv;
        si[wid] = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        bv = sv[0];
        bi = si[0];
        for (int w = 1; w < nw; ++w) argmax_take(bv, bi, sv[w], si[w]);
    }
}

// argmax(x, n, out, part, counter): per row (blockIdx.y) of n logits, the index of the largest
// value, lowest index on ties (greedy decoding on the lm_head output). NaN never wins. The row is
// cut into gridDim.x slices, a block each: every block writes its slice's best to part[row][slice]
// (float value, int index: 8 bytes), and the last block of the row to finish (counted in
// counter[row], which starts at 0 and is left at 0) picks the best of them in slice order. One
// block per row (gridDim.x = 1) needs neither buffer (null). Exact whatever the split.
// Launch: grid = (slices, rows), block = any multiple of 32.
// argmax_row: that search; true in every thread of the block that decides the row (the row's only
// block, or its last to finish), whose thread 0 then holds the row's index in `best` and its
// value in `best_v`.
__device__ __forceinline__ bool argmax_row(const float* __restrict__ x, int n, float2* __restrict__ part,
                                           u32* __restrict__ counter, int& best, float& best_v) {
    __shared__ int is_last;
    const int row = blockIdx.y, slices = gridDim.x;
    const float* r = x + (size_t)row * n;
    const int per = (n + slices - 1) / slices;
    const int lo = blockIdx.x * per, hi = min(n, lo + per);
    float bv = NEG_INF;
    int bi = 0x7fffffff;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) argmax_take(bv, bi, r[i], i);
    argmax_block(bv, bi);
    if (slices == 1) {
        best = bi == 0x7fffffff ? 0 : bi;
        best_v = bv;
        return true;
    }
    float2* parts = part + (size_t)row * slices;
    if (threadIdx.x == 0) {
        parts[blockIdx.x] = make_float2(bv, __int_as_float(bi));
        __threadfence();  // the slice's best is visible before the block is counted
        is_last = atomicAdd(&counter[row], 1u) == (u32)slices - 1;
    }
    __syncthreads();
    if (!is_last) return false;
    __threadfence();
    bv = NEG_INF;
    bi = 0x7fffffff;
    for (int s = threadIdx.x; s < slices; s += blockDim.x) {
        const float2 p = __ldcg(parts + s);
        argmax_take(bv, bi, p.x, __float_as_int(p.y));
    }
    argmax_block(bv, bi);
    if (threadIdx.x == 0) counter[row] = 0;
    best = bi == 0x7fffffff ? 0 : bi;
    best_v = bv;
    return true;
}

extern "C" __global__ void argmax(const float* __restrict__ x, int n, int* __restrict__ out,
                                  float2* __restrict__ part, u32* __restrict__ counter) {
    pdl_enter();
    int best;
    float best_v;
    if (argmax_row(x, n, part, counter, best, best_v) && threadIdx.x == 0) out[blockIdx.y] = best;
}

// argmax_chain(x, n, out, part, counter, input, drafts, j, adv, probs): between the chained steps
// of an MTP draft (one graph): the argmax of one row, then out[0] = drafts[j] = the token and the
// next step's input one slot adv positions on with that token (input = [position, ids...]):
// input[0] += adv, input[1] = the token. probs (null: none): probs[j] = the token's softmax
// probability, 1 / sum(exp(x - max)), summed by the deciding block (the host stops a draft after
// an unlikely token). Launch: as argmax, one row.
extern "C" __global__ void argmax_chain(const float* __restrict__ x, int n, int* __restrict__ out,
                                        float2* __restrict__ part, u32* __restrict__ counter,
                                        int* __restrict__ input, int* __restrict__ drafts, int j, int adv,
                                        float* __restrict__ probs) {
    pdl_enter();
    int best;
    float best_v;
    if (!argmax_row(x, n, part, counter, best, best_v)) return;
    if (threadIdx.x == 0) {
        out[0] = best;
        drafts[j] = best;
        input[0] += adv;
        input[1] = best;
    }
    if (probs == nullptr) return;
    __shared__ float top;
    __shared__ float scratch[WARP];
    if (threadIdx.x == 0) top = best_v;
    __syncthreads();
    float sum = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) sum += expf(x[i] - top);
    sum = block_sum(sum, scratch);
    if (threadIdx.x == 0) probs[j] = 1.0f / sum;
}

#define SAMPLE_MAX_K 64

// Whether (v, i) comes before (bv, bi) in the order largest value first, lower index on ties.
__device__ __forceinline__ bool ranks_before(float v, int i, float bv, int bi) {
    return v > bv || (v == bv && i < bi);
}

// sample_topk(logits, vocab, k, inv_temp, top_p, min_p, u, out): a draw per row (blockIdx.x) of
// n logits (NaN counts as -inf), in the engine sampler's order: temperature, top-k, top-p
// (smallest prefix of the sorted candidates whose mass reaches top_p), min-p (probability at
// least min_p times the largest), softmax over what is left; the token where the cumulative mass
// passes u[row] times the kept mass (u uniform in [0, 1), device data so a captured step can take
// a fresh one). k <= SAMPLE_MAX_K (<= vocab): k rounds of a block-wide arg-max, each taking the
// best entry ranked after the previous pick.
// Launch: grid = rows, block = any multiple of 32 (<= 1024).
extern "C" __global__ void sample_topk(const float* __restrict__ logits, int vocab, int k, float inv_temp,
                                       float top_p, float min_p, const float* __restrict__ u,
                                       int* __restrict__ out) {
    pdl_enter();
    __shared__ float cand_v[SAMPLE_MAX_K];
    __shared__ int cand_i[SAMPLE_MAX_K];
    __shared__ float sv[WARP];
    __shared__ int si[WARP];
    const float* row = logits + (size_t)blockIdx.x * vocab;
    const int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP, nw = blockDim.x / WARP;
    float pv = __int_as_float(0x7f800000);  // +inf: everything ranks after it
    int pi = -1;
    for (int r = 0; r < k; ++r) {
        float bv = NEG_INF;
        int bi = 0x7fffffff;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            float v = row[i];
            if (v != v) v = NEG_INF;
            const bool after = ranks_before(pv, pi, v, i);
            if (after && ranks_before(v, i, bv, bi)) { bv = v; bi = i; }
        }
        for (int o = WARP / 2; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ranks_before(ov, oi, bv, bi)) { bv = ov; bi = oi; }
        }
        if (lane == 0) { sv[wid] = bv; si[wid] = bi; }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int w = 1; w < nw; ++w) {
                if (ranks_before(sv[w], si[w], sv[0], si[0])) { sv[0] = sv[w]; si[0] = si[w]; }
            }
            cand_v[r] = sv[0];
            cand_i[r] = si[0];
        }
        __syncthreads();
        pv = cand_v[r];
        pi = cand_i[r];
        __syncthreads();  // sv/si are rewritten next round
    }
    if (threadIdx.x == 0) {
        // Probabilities of the candidates at the temperature (the largest is cand_v[0]).
        float p[SAMPLE_MAX_K];
        float total = 0.0f;
        for (int r = 0; r < k; ++r) {
            p[r] = expf((cand_v[r] - cand_v[0]) * inv_temp);
            total += p[r];
        }
        int keep = k;
        if (top_p < 1.0f) {
            float cum = 0.0f;
            for (int r = 0; r < k; ++r) {
                cum += p[r] / total;
                if (cum >= top_p) { keep = r + 1; break; }
            }
        }
        if (min_p > 0.0f) {
            int r = 1;
            while (r < keep && p[r] >= min_p * p[0]) ++r;
            keep = r;
        }
        float mass = 0.0f;
        for (int r = 0; r < keep; ++r) mass += p[r];
        const float target = u[blockIdx.x] * mass;
        int pick = keep - 1;
        float cum = 0.0f;
        for (int r = 0; r < keep; ++r) {
            cum += p[r];
            if (target < cum) { pick = r; break; }
        }
        out[blockIdx.x] = cand_i[pick] == 0x7fffffff ? 0 : cand_i[pick];
    }
}
