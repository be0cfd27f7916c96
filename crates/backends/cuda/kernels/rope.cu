// RoPE pieces shared with attention.cu (its prerequisite). Pair i's angle at pos (double), and the
// rotation of pair (i, i + half) by its rounded cosine and sine: one source for rope_neox, the
// computed and the table forms of attn_qk_prep, so all give the same bits.
__device__ __forceinline__ double rope_angle(int i, int pos, int rope_dims, double theta) {
    return (double)pos * pow(theta, -2.0 * (double)i / (double)rope_dims);
}
__device__ __forceinline__ void rope_rotate(float* h, int i, int half, float c, float s) {
    const float a = h[i], b = h[i + half];
    h[i] = a * c - b * s;
    h[i + half] = b * c + a * s;
}

// NeoX rotation of the pairs (i, i + rope_dims/2) of one head at h, at position pos, pairs first,
// first + step, ...; angles in double, sine and cosine rounded once (as the oracle does).
__device__ __forceinline__ void rope_neox_pairs(float* h, int rope_dims, int pos, double theta, int first, int step) {
    const int half = rope_dims / 2;
    for (int i = first; i < half; i += step) {
        const double angle = rope_angle(i, pos, rope_dims, theta);
        rope_rotate(h, i, half, (float)cos(angle), (float)sin(angle));
    }
}

// rope_neox(x, head_dim, rope_dims, pos0, theta): NeoX ("rotate half") rotary embedding on the first
// rope_dims values of every head, in place. x is [tokens][heads][head_dim]; token t = blockIdx.y
// sits at position pos0 + t, head = blockIdx.x. Value i pairs with i + rope_dims/2, rotated by
// pos * theta^(-2i/rope_dims); the angle and its sine and cosine are computed in double and rounded
// once, like the oracle. Launch: grid = (heads, tokens), block = any (threads loop over the pairs).
extern "C" __global__ void rope_neox(float* __restrict__ x, int head_dim, int rope_dims, int pos0, double theta) {
    pdl_enter();
    float* h = x + ((size_t)blockIdx.y * gridDim.x + blockIdx.x) * head_dim;
    rope_neox_pairs(h, rope_dims, pos0 + (int)blockIdx.y, theta, threadIdx.x, blockDim.x);
}
