// rope_neox(x, head_dim, rope_dims, pos0, theta): NeoX ("rotate half") rotary embedding on the first
// rope_dims values of every head, in place. x is [tokens][heads][head_dim]; token t = blockIdx.y
// sits at position pos0 + t, head = blockIdx.x. Value i pairs with i + rope_dims/2, rotated by
// pos * theta^(-2i/rope_dims); the angle and its sine and cosine are computed in double and rounded
// once, like the oracle. Launch: grid = (heads, tokens), block = any (threads loop over the pairs).
extern "C" __global__ void rope_neox(float* __restrict__ x, int head_dim, int rope_dims, int pos0, double theta) {
    pdl_enter();
    const int half = rope_dims / 2;
    float* h = x + ((size_t)blockIdx.y * gridDim.x + blockIdx.x) * head_dim;
    const double pos = (double)(pos0 + (int)blockIdx.y);
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const double inv_freq = pow(theta, -2.0 * (double)i / (double)rope_dims);
        const double angle = pos * inv_freq;
        const float s = (float)sin(angle), c = (float)cos(angle);
        const float a = h[i], b = h[i + half];
        h[i] = a * c - b * s;
        h[i + half] = b * c + a * s;
    }
}
