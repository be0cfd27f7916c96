//! [`CudaModel`]: the whole Qwen3-Next forward pass on one GPU.
//!
//! Weights are uploaded once in the file's quantized layout (the model crate's loader does the
//! shape checks and layout fix-ups; [`HostLoader`] only records where each weight's bytes are).
//! Hidden states, KV caches, conv and delta-rule states live on the device. A call uploads the
//! token ids and the start position, launches kernels only, and downloads the sampled token (or
//! the logits when asked for them).
//!
//! One layer, for n tokens at once, as in `redlite_model::qwen3next`. A decode step (n = 1, the
//! defaults; 508 launches on the 80B layout: 10 a DeltaNet layer, 12 an attention layer, then the
//! embedding, the final norm, the lm_head and the draw):
//!
//! ```text
//! DeltaNet:  rms_norm_q8: the q8 row of x · attn_norm and 1 / rms
//!            →  matvec_q8x_q4_k: qkv, z, ba in one launch
//!            →  dn_fused_cols: conv, q/k L2 norm, gates, delta rule, RMSNorm(o)·silu(z)
//!            →  matvec_res_q4_k: x += W_out·gated
//!            →  res_norm_router: xn = rms_norm(x, post_norm) and its q8 row, with the router's
//!               logits and the shared expert's gate logit on it
//! attention: rms_norm_q8  →  matvec_q8x_q4_k: q·gate, k, v
//!            →  attn_qk_prep (QK-norm, RoPE, KV write)  →  attn_split_gqa8xh3_h (chunks of the
//!            cache)  →  attn_merge (· sigmoid(gate))  →  matvec_res_q4_k  →  res_norm_router
//! MoE:       side stream from the start: matvec_q8x_q4_k (shared gate, up)  →  swiglu_q8
//!            →  matvec_q8x_q4_k (shared down)
//!            main: moe_gate_up_route2_q8q_iq2_xxs (the top-k in every block, the chosen
//!            experts' gate/up, SwiGLU and its q8 rows; ids kept per layer)
//!            →  (join)  moe_down_combine_tab_q8_iq2_xxs: x += Σ w·down(act) + sigmoid(g)·shared
//!            (experts found through the expert cache's per-layer table, `expert_cache.rs`)
//! ```
//!
//! Other calls take other forms of the same steps: a verify pass (a few tokens) the token-tile
//! kernels (`matvec_q8x_tok_*`, from 6 tokens `matvec_q8x_mma_q4_k` on the tensor cores,
//! `matvec_res_tok_*` (Q4_K: `matvec_res_xr_q4_k`, activations in registers) then
//! `res_norm_q8`, `matvec3_x_tok_f32` for
//! the router, `moe_router_warp`, `moe_gate_up_tok_*`, `moe_down_combine_tok_*`), each row the
//! one-token kernels' bits; a prompt the GEMMs on the tensor cores (`gemm_*`, `moe_gemm_*`) and
//! the multi-token DeltaNet and attention kernels; shapes a fused kernel does not take the
//! unfused forms (`matvec_norm3_*`, the five DeltaNet kernels). `REDLITE_CUDA_NORM_ROUTER=0`
//! runs the router, its top-k and the gate/up as one launch instead (`moe_route_gate_up_*`, a
//! grid barrier after the logits).
//!
//! then the final norm, the lm_head and `argmax` / `sample_topk`. Every position-dependent kernel
//! reads the start position from device memory, so the decode step is captured once as a CUDA
//! graph and replayed for every token (only the token id and position are copied in, and the
//! chosen id out).
//!
//! The parts, one file each: [`load`] (upload and checks), [`forward`] (the pass as launches),
//! [`delta_net`], [`attention`], [`moe`] (one layer's blocks), [`launch`] (the products in each
//! form and the prompt GEMMs), [`speculative`] (verify, `keep`, MTP drafts).

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use cudarc::driver::{
    result as cu, sys, CudaContext, CudaEvent, CudaFunction, CudaGraph, CudaStream, LaunchConfig,
    PushKernelArg,
};
use redlite_gguf::{GgmlType, GgufFile};
use redlite_model::weights::{LayerWeights, MixerWeights, MtpWeights, Weights};
use redlite_model::{Config, KvType, ModelError};

use crate::expert_cache::{
    device_used, moe_warps, slots_per_layer, ExpertBytes, ExpertCache, ExpertCacheSize,
    ExpertLayout, ExpertPolicy,
};
use crate::host::{HostLinear, HostLoader};
use crate::kernels::type_suffix;
use crate::mtp_queue::MtpQueue;
use crate::ops::{
    delta_seq_launch, dn_fused_launch, row_bytes, DeltaDims, RouterKernel, MATVEC_WARPS,
};
use crate::{CudaError, Gpu};

mod attention;
mod delta_net;
mod forward;
mod launch;
mod load;
mod moe;
mod speculative;

pub use load::expert_span;
use moe::moe_tok_tiles;
pub use moe::{MOE_TOK_DOWN_MAX, MOE_TOK_GU_MAX};

/// The ε of the L2 normalisation of DeltaNet q and k (as the model crate).
const L2_NORM_EPS: f32 = 1e-6;
/// Most rows of a speculative verify pass.
pub const MAX_VERIFY_ROWS: usize = 64;
/// Largest router top-k the router kernel handles.
const MAX_EXPERTS_USED: usize = 64;
/// Largest top-k of on-device sampling (the kernel's `SAMPLE_MAX_K`).
pub const MAX_SAMPLE_TOP_K: usize = 64;
/// Blocks per row of the greedy `argmax` (each takes a slice of the vocabulary; the last to finish
/// picks the best of their winners).
const ARGMAX_SLICES: usize = 128;
/// Largest head dimension of the attention kernels (`ATTN_MAX_HD`).
const MAX_HEAD_DIM: usize = 512;
/// Warps per block of the fused matvec kernels (`MVF_WARPS`).
pub(crate) const MVF_WARPS: usize = 8;
pub(crate) const MVF_THREADS: u32 = 32 * MVF_WARPS as u32;

/// Dynamic shared memory of `matvec_q8x_mma_q4_k` for rows `cols` wide: its 16 rows (each padded
/// by 16 bytes), their scale quads (one a block and sub-block pair, one of padding) and the tile's
/// 8 q8 rows (each padded by 16 bytes), or `None` past [`Q8X_MMA_MAX_SMEM`].
pub fn q8x_mma_smem(cols: usize) -> Option<u32> {
    let q8_row = crate::ops::q8_row_bytes(cols);
    let bytes = 16 * (cols / 256 * 144 + 16) + 16 * 16 * (cols / 64 + 1) + 8 * (q8_row + 16);
    (bytes <= Q8X_MMA_MAX_SMEM as usize).then_some(bytes as u32)
}

/// The dynamic shared memory `matvec_q8x_mma_q4_k` is opted in to (64 KiB: rows of 2,048 take
/// 49,792 bytes; three blocks an SM fit the 228 KiB of an H100 / H200).
pub const Q8X_MMA_MAX_SMEM: u32 = 64 * 1024;

/// Opts `matvec_q8x_mma_q4_k` in to [`Q8X_MMA_MAX_SMEM`] bytes of dynamic shared memory.
pub fn q8x_mma_opt_in(f: &CudaFunction) -> Result<(), CudaError> {
    f.set_attribute(
        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        Q8X_MMA_MAX_SMEM as i32,
    )
    .map_err(|e| CudaError::driver("matvec_q8x_mma_q4_k's shared memory limit", e))
}

/// `grid_sync` counters (one per kernel and grid size that uses the barrier).
const GRID_COUNTERS: usize = 16;
/// Threads of `moe_route_gate_up_q8q_iq2_xxs` (two 8-warp router groups; the gate/up's 16 warps).
const ROUTE_FUSED_THREADS: u32 = 512;
/// Largest input of `matvec_norm3_*` (its shared memory holds the normalised input).
const MVF_MAX_COLS: usize = 12 * 1024;
/// The split decode attention's buffers hold at most `max_context / ATTN_MIN_CHUNK` chunks a head
/// ([`attn_splits`]).
const ATTN_MIN_CHUNK: usize = 64;
/// Shortest chunk of the split decode attention by default (`REDLITE_CUDA_ATTN_MIN_CHUNK`), both
/// kernels: short contexts spread over more blocks (`attn_split_gqa`: 303.0 tok/s at positions
/// 8–136 against 299.6 with 64 on the H200; `attn_split`, the demo model at ≈ 1,000 positions:
/// +2.0 % decode against 64, session 21).
const ATTN_DEFAULT_MIN_CHUNK: usize = 16;
/// Default number of chunks a decode step's attention is cut into (`REDLITE_CUDA_ATTN_SPLITS`;
/// the chunks are at least [`ATTN_DEFAULT_MIN_CHUNK`] long): 128 (chunks of 256 at position
/// 32,768). On the H200 (session 10): at 32,768 chunks of 256 gave 166.4 / 162.4 tok/s, of 64
/// (512 splits) 159.2, of 1,024 79.6; at 4,096 chunks of 64 (64 splits) 230.4, of 256 165.1.
const ATTN_DEFAULT_SPLITS: usize = 128;
const ATTN_MAX_SPLITS: usize = 512;

/// Most consecutive rows per group of warps in the fused matvec kernels (`MVF_MAX_ROWS`).
pub(crate) const MVF_MAX_ROWS: usize = 4;

/// How the fused matvec kernels cut their work (`MvfSplit` in matvec.cu): each row in `parts`
/// slices (warps), each group of `parts` warps taking `rows` consecutive rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MvfSplit {
    pub parts: usize,
    pub rows: usize,
}

impl MvfSplit {
    /// The kernels' `split` argument: `parts | rows << 8`.
    pub(crate) fn arg(self) -> i32 {
        (self.parts | self.rows << 8) as i32
    }

    /// Matrix rows one block of `MVF_WARPS` warps covers.
    pub(crate) fn rows_per_block(self) -> u32 {
        (MVF_WARPS / self.parts * self.rows) as u32
    }
}

/// Rows per group of warps of `matvec_norm3` (tuning switch `REDLITE_CUDA_MVF_ROWS`, 1 to
/// `MVF_MAX_ROWS`; default 2: two rows' loads in flight per lane, the block's staging of x spread
/// over twice the rows) and of `matvec_res` (`REDLITE_CUDA_RES_ROWS`, default 1: its 2048 rows
/// give few enough blocks already).
pub(crate) fn mvf_rows_from_env(residual: bool) -> usize {
    let (var, default) = if residual {
        ("REDLITE_CUDA_RES_ROWS", 1)
    } else {
        ("REDLITE_CUDA_MVF_ROWS", 2)
    };
    env_parse(var).unwrap_or(default).clamp(1, MVF_MAX_ROWS)
}

/// Warps per row asked of the down kernels (`REDLITE_CUDA_MOE_DOWN_PARTS`, default 2).
pub(crate) fn moe_down_parts_from_env() -> usize {
    env_parse("REDLITE_CUDA_MOE_DOWN_PARTS").unwrap_or(2)
}

/// `asked` warps a row fitted to a block of `warps`: a power of two from 1 to `warps`.
pub(crate) fn fit_down_parts(asked: usize, warps: u32) -> usize {
    asked
        .clamp(1, warps as usize)
        .next_power_of_two()
        .min(warps as usize)
}

/// Rows per warp group of the one-token 8-bit kernels (`REDLITE_CUDA_Q8_ROWS`, 1 to 16, default 2
/// since session 55: +1.3 % decode on an H100 against 4, +1.9 % with 16 norm slices; 1 loses
/// 8.5 %, 3 0.4 %; the same bits for any count).
pub(crate) fn q8_rows_from_env() -> usize {
    env_parse("REDLITE_CUDA_Q8_ROWS").unwrap_or(2).clamp(1, 16)
}

/// A tuning setting from the environment, parsed, or `None` when unset or unreadable.
pub(crate) fn env_parse<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

/// A comma-separated list from the environment (empty when unset).
fn env_list(name: &str) -> Vec<String> {
    std::env::var(name)
        .map(|v| {
            v.split(',')
                .filter(|s| !s.is_empty())
                .map(String::from)
                .collect()
        })
        .unwrap_or_default()
}

/// An on/off tuning switch from the environment: `0` off, `1` on, anything else the default.
pub(crate) fn env_switch(name: &str, default: bool) -> bool {
    match std::env::var(name).as_deref().map(str::trim) {
        Ok("0") => false,
        Ok("1") => true,
        _ => default,
    }
}

/// Most tokens per tile of `matvec_norm3_tok` (`MVF_MAX_TILE`).
pub(crate) const MVF_MAX_TILE: usize = 4;

/// Tokens per tile of the token-tile matvec (`matvec_norm3_tok`, `matvec_res_tok`: weights read
/// and decoded once per tile, the tile's tokens one after another in each warp) for calls of more
/// than one token: tuning switch `REDLITE_CUDA_TOKEN_TILE`, 1 (off) to `MVF_MAX_TILE`; unset (0):
/// [`AUTO_TILE_SMALL`] tokens a tile for calls of up to [`AUTO_TILE_SMALL_ROWS`] tokens, else
/// `MVF_MAX_TILE`. Outputs are bit-identical whatever the tile.
pub(crate) fn token_tile_from_env() -> usize {
    env_parse("REDLITE_CUDA_TOKEN_TILE").map_or(0, |t: usize| t.clamp(1, MVF_MAX_TILE))
}

/// The automatic tile for short calls (MTP passes, short lookup passes): two tiles of 2 run in
/// parallel where one tile of 4 runs its tokens serially. H200, session 22: the demo's MTP
/// rewrite 1.45× → 1.62× (4-row verify 1.51 → 1.34× a step, 8 rows 1.67 → 1.58×); full-size
/// 4 / 8 rows 5.84 / 9.12 ms → 5.78 / 9.18 (even), 16 rows 15.99 → 16.39 ms (tile 4 stays there).
const AUTO_TILE_SMALL: usize = 2;
const AUTO_TILE_SMALL_ROWS: usize = 8;

/// Prompts of at least this many tokens run their products through the GEMMs (`gemm.cu`: the
/// tensor-core `gemm_<type>`, `gemm_f32_simt` for f32 weights, and `moe_gemm_<type>` over the
/// routed experts grouped by expert) instead of the per-token matvecs; `REDLITE_CUDA_GEMM=0` turns
/// them off. Decode steps and speculative verify rows always take the matvecs (their rows stay
/// bit-identical to each other).
pub(crate) const GEMM_MIN_TOKENS: usize = 16;
/// The most rows of a verify pass or an MTP draft step replayed as a captured graph.
const SMALL_GRAPH_ROWS: usize = 16;
/// Verify passes of one row count before theirs is captured as a graph.
const VERIFY_GRAPH_AFTER: u32 = 3;
/// Captures of one graph tried before its launches run without one (see `CudaModel::capture`).
const CAPTURE_TRIES: usize = 3;
/// A capture invalidated from outside, as the driver returns it (from the end of the capture, or
/// from a launch inside it: [`CudaError::driver_code`]).
const INVALIDATED: sys::CUresult = sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
/// The most chained MTP drafts of one draft graph.
const MAX_GRAPH_DRAFTS: usize = 8;
/// `gemm.cu`'s tile: weight rows and tokens per block, columns per step, threads.
const GEMM_BM: usize = 64;
const GEMM_BN: usize = 64;
const GEMM_BK: usize = 32;
const GEMM_THREADS: u32 = 128;

/// Tokens a block of the activations-in-registers kernels (`matvec_res_xr_q4_k`,
/// `matvec_q8x_xr_q6_k`; `XR_TOKENS` in matvec.cu).
pub(crate) const XR_TOKENS: usize = 8;
/// Rows of a block of `matvec_res_xr_q4_k` (`XR_ROWS` in matvec.cu).
pub(crate) const RES_XR_ROWS: u32 = 8;
/// Rows of a block of `matvec_q8x_xr_q6_k`.
pub(crate) const HEAD_XR_ROWS: u32 = 16;

/// Rows a warp group of the Q4_K output projections' token tiles for a call of `n` tokens: `want`
/// (1 or 2) when set, else 2 up to 4 tokens and 1 beyond (session 29, full-size 2 / 4 / 8 / 16-row
/// verify: two rows −3.4 / −1.6 / −0.3 / +0.5 %).
pub(crate) fn res_tok_rows(want: usize, n: usize) -> usize {
    match want {
        1 | 2 => want,
        _ if n <= 4 => 2,
        _ => 1,
    }
}

/// The tile `matvec_norm3_tok` runs for `n` tokens of width `cols` (its shared memory holds the
/// tile's inputs: at most 48 KiB), or 1 (use `matvec_norm3`); `want` 0: by `n` (`token_tile_from_env`).
pub(crate) fn token_tile(want: usize, n: usize, cols: usize) -> usize {
    if n < 2 {
        return 1;
    }
    let want = match want {
        0 if n <= AUTO_TILE_SMALL_ROWS => AUTO_TILE_SMALL,
        0 => MVF_MAX_TILE,
        w => w,
    };
    want.min(n).min((48 * 1024) / (4 * cols.max(1))).max(1)
}

/// Slices of a row in the fused matvec kernels (warps per row, a power of two up to `MVF_WARPS`):
/// enough that a lane walks about `lane_iters` units of work (one warp's loop iterations: blocks
/// of the warp block decoders, groups of the group decoders, else values, 32 lanes at a time).
pub(crate) fn mvf_parts(ty: GgmlType, cols: usize, lane_iters: usize) -> usize {
    let per_iter = match ty {
        GgmlType::Q6K => 256,
        GgmlType::Q4K | GgmlType::Q8_0 => 16 * 32,
        GgmlType::IQ2XXS => 8 * 32,
        GgmlType::F32 => 4 * 32,
        _ => 32,
    };
    let iters = cols.div_ceil(per_iter);
    iters
        .div_ceil(lane_iters.max(1))
        .next_power_of_two()
        .clamp(1, MVF_WARPS)
}

/// The decode attention's `attn_split_gqa` kernel with 4 positions a warp step, for a cache of
/// `kv`: `attn_split_gqa4x` (its scores reduced transposed, one a lane: +4.5 % decode at position
/// 32,768 on the H200, session 23) unless `REDLITE_CUDA_ATTN_XR=0` (`attn_split_gqa4`); on an
/// f16 cache their `_h` forms, the XR one as `REDLITE_CUDA_ATTN_H` says: `8xh3` (the default
/// where the shape takes it, head_dim 256 with 8 query heads a KV head as the Qwen3-Next models:
/// `attn_split_gqa8xh3_h`, a KV head's query heads over two 4-warp blocks, three an SM; short
/// decode 398.60 tok/s against 393.60 with `4xp`, position 32,768 even, session 27), `4xp` (the
/// default for other shapes, `attn_split_gqa4xp_h`: the next warp step's rows loaded ahead;
/// position 32,768 349.0 tok/s against 340.7 with `4x`, session 24), `4x`
/// (`attn_split_gqa4x_h`, the same bits as `4xp`) or `8x` (`attn_split_gqa8x_h`, 8 rows loaded a
/// warp step: 347.4), or on the tensor cores (Q and P in f16) `mma` (`attn_split_mma_h`: in a
/// step even with 4xp at 32K in session 25; alone at 32K the fastest, 30.3 µs against 8xh3's
/// 32.0, session 27; two blocks an SM at 128 registers were slower, 33.8). `(heads, nkv, hd)`:
/// the model's attention shape.
fn attn_gqa4_kernel(kv: KvType, shape: (usize, usize, usize)) -> Result<String, CudaError> {
    let xr = env_switch("REDLITE_CUDA_ATTN_XR", true);
    if xr && kv == KvType::F16 {
        let (nh, nkv, hd) = shape;
        let form = std::env::var("REDLITE_CUDA_ATTN_H").unwrap_or_else(|_| {
            let takes = crate::ops::attn_split_takes("attn_split_gqa8xh3", nh, nkv, hd);
            (if takes { "8xh3" } else { "4xp" }).into()
        });
        return match form.as_str() {
            "8x" | "4xp" | "4x" | "8xh3" => Ok(format!("attn_split_gqa{form}_h")),
            "mma" => Ok("attn_split_mma_h".into()),
            other => Err(CudaError::Invalid(format!(
                "REDLITE_CUDA_ATTN_H={other} (8x, 4xp, 4x, 8xh3 or mma)"
            ))),
        };
    }
    crate::ops::kv_kernel(
        if xr {
            "attn_split_gqa4x"
        } else {
            "attn_split_gqa4"
        },
        kv,
    )
}

/// Chunks of the split decode attention for a context of `o.max_context` positions.
fn attn_splits(o: &CudaModelOptions) -> usize {
    o.max_context
        .div_ceil(ATTN_MIN_CHUNK)
        .clamp(1, ATTN_MAX_SPLITS)
}

/// `dn_fused_seq`'s launch `(threads, shared bytes)` for this model, or `None` when the shape does
/// not fit it (the DeltaNet core then runs as five kernels).
fn dn_fused(c: &Config) -> Option<(u32, u32)> {
    dn_fused_launch(DeltaDims {
        nk: c.dn_k_heads,
        nv: c.dn_v_heads,
        dk: c.dn_k_dim,
        dv: c.dn_v_dim,
    })
}

/// Sizes fixed at load time.
#[derive(Debug, Clone, Copy)]
pub struct CudaModelOptions {
    /// KV cache positions per attention layer.
    pub max_context: usize,
    /// Tokens per forward launch; longer prompts go in chunks of this many.
    pub max_batch: usize,
    /// Capture the decode step as a CUDA graph and replay it.
    pub graphs: bool,
    /// Routed experts in device memory: all, or a bounded cache (the rest read from pinned
    /// host memory, see [`crate::expert_cache`]).
    pub experts: ExpertCacheSize,
    /// Which missed experts a bounded cache promotes.
    pub expert_policy: ExpertPolicy,
    /// Rows a speculative verify pass ([`CudaModel::verify`]) may hold (0: none). Each row keeps
    /// the DeltaNet states after it (`36 × 2 MiB` at full size) for the rollback.
    pub max_verify: usize,
    /// Load the file's MTP block, when it has one, for [`CudaModel::mtp_draft`]: its layer's
    /// experts stay resident whatever `experts` says, and every trunk call then also queues its
    /// rows' hidden states for the MTP cache.
    pub mtp: bool,
    /// The KV cache's element type: f32 or f16 (half the bytes a position, and half what the
    /// decode attention streams at long contexts; the attention kernels' `_h` forms).
    pub kv_type: KvType,
}

impl Default for CudaModelOptions {
    fn default() -> Self {
        CudaModelOptions {
            max_context: 4096,
            max_batch: 256,
            graphs: true,
            experts: ExpertCacheSize::All,
            expert_policy: ExpertPolicy::Lfu,
            max_verify: 0,
            mtp: false,
            kv_type: KvType::F32,
        }
    }
}

/// On-device sampling: the engine sampler's temperature, top-k, top-p and min-p (no penalties).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuSampling {
    /// `<= 0`: greedy (arg-max).
    pub temperature: f32,
    /// 1..=[`MAX_SAMPLE_TOP_K`] when sampling.
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
}

impl GpuSampling {
    pub fn greedy() -> GpuSampling {
        GpuSampling {
            temperature: 0.0,
            top_k: 1,
            top_p: 1.0,
            min_p: 0.0,
        }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature.is_nan() || self.temperature <= 0.0
    }

    /// Whether the GPU kernel can draw with these settings (else the caller samples on the host).
    pub fn supported(&self) -> bool {
        self.is_greedy() || (1..=MAX_SAMPLE_TOP_K).contains(&self.top_k)
    }
}

/// Which logits a forward call computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Head {
    /// None (an early prompt chunk).
    None,
    /// The last token's only.
    Last,
    /// Every token's.
    All,
}

/// How the tokens of one call are computed.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Rows {
    /// A prompt (or one decode token): causal attention over the tokens together (split over
    /// the cache for one token), the recurrent states carried to the end.
    Prompt,
    /// A verify pass: every token exactly as a one-token step at its position computes it
    /// (split attention per row), and the DeltaNet states after every row kept for a rollback.
    Steps,
}

/// A kernel argument (pointers are raw device addresses).
#[derive(Clone, Copy)]
pub(crate) enum A {
    P(u64),
    I(i32),
    F(f32),
    D(f64),
}

/// Launches `f` with `args` through `cuLaunchKernelEx`, with the programmatic-stream-serialization
/// attribute when `pdl` (the kernel waits in `pdl_enter` for the grid before it).
///
/// # Safety
/// `args` must be the kernel's parameters, in order and of its types, and every pointer among
/// them a live device buffer the kernel may access as launched.
pub(crate) unsafe fn launch_ex(
    stream: &cudarc::driver::CudaStream,
    f: &CudaFunction,
    (grid, block, shared): ((u32, u32, u32), u32, u32),
    args: &[A],
    pdl: bool,
) -> Result<(), cudarc::driver::DriverError> {
    use std::ffi::c_void;
    let mut params: Vec<*mut c_void> = args
        .iter()
        .map(|a| match a {
            A::P(v) => v as *const u64 as *mut c_void,
            A::I(v) => v as *const i32 as *mut c_void,
            A::F(v) => v as *const f32 as *mut c_void,
            A::D(v) => v as *const f64 as *mut c_void,
        })
        .collect();
    // SAFETY: an all-zero attribute value is valid (a union of plain integers).
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let cfg = sys::CUlaunchConfig {
        gridDimX: grid.0,
        gridDimY: grid.1,
        gridDimZ: grid.2,
        blockDimX: block,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: shared,
        hStream: stream.cu_stream(),
        attrs: &mut attr,
        numAttrs: u32::from(pdl),
    };
    // SAFETY: the caller's contract; `params` points at values that live until the call returns
    // (the driver copies them).
    unsafe {
        sys::cuLaunchKernelEx(
            &cfg,
            f.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
}

/// Device allocations, freed together when the model goes.
struct Arena {
    ctx: Arc<CudaContext>,
    ptrs: Vec<u64>,
    bytes: usize,
}

impl Arena {
    fn alloc(&mut self, bytes: usize) -> Result<u64, CudaError> {
        // SAFETY: a plain allocation in the bound context; freed once in `drop`.
        let p = unsafe { cu::malloc_sync(bytes.max(16)) }.map_err(|e| {
            CudaError::driver(
                format!(
                    "allocating {bytes} bytes (model holds {} MiB)",
                    self.bytes >> 20
                ),
                e,
            )
        })?;
        self.ptrs.push(p);
        self.bytes += bytes;
        Ok(p)
    }

    fn upload(&mut self, bytes: &[u8]) -> Result<u64, CudaError> {
        let p = self.alloc(bytes.len())?;
        // SAFETY: `p` holds `bytes.len()` bytes; the copy is synchronous.
        unsafe { cu::memcpy_htod_sync(p, bytes) }
            .map_err(|e| CudaError::driver("uploading weights", e))?;
        Ok(p)
    }

    fn upload_f32(&mut self, v: &[f32]) -> Result<u64, CudaError> {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.upload(&bytes)
    }

    fn f32s(&mut self, n: usize) -> Result<u64, CudaError> {
        self.alloc(4 * n)
    }

    /// `bytes` bytes of zeros.
    fn zeros(&mut self, bytes: usize) -> Result<u64, CudaError> {
        let p = self.alloc(bytes)?;
        // SAFETY: `p` holds at least `bytes` bytes; the memset is synchronous.
        unsafe { cu::memset_d8_sync(p, 0, bytes.max(16)) }
            .map_err(|e| CudaError::driver("clearing a device buffer", e))?;
        Ok(p)
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            for &p in &self.ptrs {
                // SAFETY: each pointer came from `malloc_sync` and is freed once.
                let _ = unsafe { cu::free_sync(p) };
            }
        }
    }
}

/// What `res_norm_router` reads of a layer's router (see `Model::norm_router`): its row split
/// and the two matrices (the router, the shared expert's gate vector).
#[derive(Clone)]
struct NormRouter {
    split: MvfSplit,
    router: DevLinear,
    gate: DevLinear,
}

/// A linear layer on the device and its matvec kernel.
#[derive(Clone)]
struct DevLinear {
    rows: usize,
    cols: usize,
    ptr: u64,
    f: CudaFunction,
    /// The weight type (names the fused kernels `matvec_norm3_<type>`, `matvec_res_<type>`).
    ty: GgmlType,
}

/// The routed experts of one layer: where they are is the expert cache's table of layer
/// `layer`; the kernels for their types.
#[derive(Clone)]
struct DevExperts {
    layer: usize,
    /// `moe_gemm_<type>` of the gate/up parts and of the down part (prompts, [`GEMM_MIN_TOKENS`]).
    gemm_gate_up_f: CudaFunction,
    gemm_down_f: CudaFunction,
    gate_up_f: CudaFunction,
    /// `moe_gate_up_tab_q8_iq2_xxs` when gate and up are IQ2_XXS (8-bit activations from `xq`).
    gate_up_q8_f: Option<CudaFunction>,
    /// `moe_gate_up_tab_q8q_iq2_xxs` and `moe_down_combine_tab_q8_iq2_xxs` when every part is
    /// IQ2_XXS (the down projection on 8-bit activations too).
    q8_down_f: Option<(CudaFunction, CudaFunction)>,
    /// Their token-tile forms for calls of several tokens (`moe_gate_up_tok_q8q_iq2_xxs`,
    /// `moe_down_combine_tok_q8_iq2_xxs`: the same bits, [`CudaModel::moe_tok`] tokens a block).
    q8_tok_f: Option<(CudaFunction, CudaFunction)>,
    down_f: CudaFunction,
    /// Warps per block of both kernels ([`moe_warps`]).
    warps: u32,
    /// The down part's type.
    down_ty: GgmlType,
}

/// Prompt GEMMs through cuBLAS: a weight matrix is decoded whole into f16 (`dequant_f16_<type>`),
/// the tokens' activations rounded to f16 (`f32_to_f16`), then one cublasGemmEx. Used for calls
/// of at least `min_tokens` tokens (`REDLITE_CUDA_CUBLAS_MIN`, default 64) on matrices of at
/// least 64 rows that fit the f16 buffers (every dense layer matrix; not the lm_head, whose
/// prompt rows are one matvec); f32 matrices (the router) go to cuBLAS as they are, in f32.
/// The main stream and the shared expert's stream each have their own handle and buffers,
/// since they run at the same time.
struct PromptBlas {
    min_tokens: usize,
    /// f32 weights (the router) through cublasGemmEx in f32 too (`REDLITE_CUDA_CUBLAS_F32=0`:
    /// `gemm_f32_simt`).
    f32: bool,
    main: BlasLane,
    side: BlasLane,
}

/// One stream's cuBLAS handle and f16 staging buffers.
struct BlasLane {
    blas: crate::blas::Blas,
    /// f16 `[w_elems]`: the decoded weight matrix.
    wh: u64,
    w_elems: usize,
    /// f16 `[x_elems]`: the activations.
    xh: u64,
    x_elems: usize,
}

impl PromptBlas {
    /// Handles and buffers for prompts of up to `max_batch` tokens, or `None` and why not (cuBLAS
    /// switched off, its library missing or failing to start, batches too small to reach
    /// `min_tokens`): the prompts then keep the own GEMM kernels. Only a failed allocation is an
    /// error.
    fn new(
        arena: &mut Arena,
        file: &GgufFile,
        c: &Config,
        opts: &CudaModelOptions,
        (main, side): (&Arc<CudaStream>, &Arc<CudaStream>),
    ) -> Result<Result<PromptBlas, String>, CudaError> {
        let min_tokens = env_parse("REDLITE_CUDA_CUBLAS_MIN")
            .unwrap_or(64)
            .max(GEMM_MIN_TOKENS);
        if !env_switch("REDLITE_CUDA_CUBLAS", true) || !env_switch("REDLITE_CUDA_GEMM", true) {
            return Ok(Err("switched off".into()));
        }
        if opts.max_batch < min_tokens {
            return Ok(Err(format!(
                "{} tokens per call, cuBLAS from {min_tokens}",
                opts.max_batch
            )));
        }
        if !crate::blas::available() {
            return Ok(Err("libcublas not found".into()));
        }
        let handles = (
            crate::blas::Blas::new(main.clone()),
            crate::blas::Blas::new(side.clone()),
        );
        let (main_blas, side_blas) = match handles {
            (Ok(m), Ok(s)) => (m, s),
            (Err(e), _) | (_, Err(e)) => return Ok(Err(e.to_string())),
        };
        // The largest dense matrix of the layers (routed experts excluded: they have their own
        // grouped kernels).
        let (mut w_elems, mut cols) = (0usize, c.hidden);
        for t in file.tensors() {
            if t.name.starts_with("blk.") && t.dims.len() == 2 && !t.name.contains("_exps") {
                w_elems = w_elems.max(t.n_elements as usize);
                cols = cols.max(t.dims[0] as usize);
            }
        }
        let sh = c.shared_ff * c.hidden;
        let b = opts.max_batch;
        let mut lane = |blas, w_elems: usize, x_elems: usize| {
            Ok::<_, CudaError>(BlasLane {
                blas,
                wh: arena.alloc(2 * w_elems)?,
                w_elems,
                xh: arena.alloc(2 * x_elems)?,
                x_elems,
            })
        };
        Ok(Ok(PromptBlas {
            min_tokens,
            f32: env_switch("REDLITE_CUDA_CUBLAS_F32", true),
            main: lane(main_blas, w_elems, b * cols)?,
            side: lane(side_blas, sh, b * c.hidden.max(c.shared_ff))?,
        }))
    }
}

/// The shared expert's own stream: forked from the model's stream after the router and joined
/// before the routed down projection, so it runs beside the routed experts (two branches of the
/// captured graph).
struct MoeSide {
    stream: Arc<CudaStream>,
    fork: CudaEvent,
    join: CudaEvent,
}

impl MoeSide {
    fn new(ctx: &Arc<CudaContext>) -> Result<MoeSide, CudaError> {
        let drv = |e| CudaError::driver("creating the shared expert's stream", e);
        Ok(MoeSide {
            stream: crate::device::new_stream(ctx).map_err(drv)?,
            fork: ctx.new_event(None).map_err(drv)?,
            join: ctx.new_event(None).map_err(drv)?,
        })
    }
}

#[derive(Clone)]
struct DevMoe {
    router: DevLinear,
    experts: DevExperts,
    sh_gate: DevLinear,
    sh_up: DevLinear,
    sh_down: DevLinear,
    /// The shared expert's gate vector as a 1-row F32 matrix.
    sh_gate_vec: DevLinear,
}

#[derive(Clone)]
enum DevMixer {
    Attention {
        wq: DevLinear,
        wk: DevLinear,
        wv: DevLinear,
        wo: DevLinear,
        q_norm: u64,
        k_norm: u64,
        /// `[max_context][kv_heads][head_dim]` each.
        kc: u64,
        vc: u64,
    },
    DeltaNet {
        qkv: DevLinear,
        z: DevLinear,
        ba: DevLinear,
        out: DevLinear,
        conv_w: u64,
        dt_bias: u64,
        a: u64,
        norm: u64,
        /// `[kernel − 1][channels]`.
        conv_state: u64,
        /// `[v_heads][k_dim][v_dim]`.
        s: u64,
        /// The states after each row of a verify pass (`[max_verify]` of each; 0 without).
        conv_trace: u64,
        s_trace: u64,
    },
}

struct DevLayer {
    attn_norm: u64,
    post_norm: u64,
    mixer: DevMixer,
    moe: DevMoe,
}

/// The MTP block on the device (`blk.N.nextn.*` and its full-attention decoder layer) and its
/// cache of slots: slot t ran `(h_t, token t+1)` at position t, h_t being the trunk's final
/// hidden state at t after the output norm (the CPU's `Model::mtp_hidden` inputs).
struct DevMtp {
    enorm: u64,
    hnorm: u64,
    /// `[hidden, 2·hidden]` of `[enorm(embed(token)) | hnorm(h)]`.
    eh_proj: DevLinear,
    layer: DevLayer,
    shared_head_norm: u64,
    /// The layer's routed experts (all resident), a cache of one layer: swapped in for
    /// `CudaModel::experts` while the MTP layer runs (its `DevExperts::layer` is 0).
    experts: ExpertCache,
    /// f32 `[queue rows][hidden]`: the queued slots' hidden states, then the waiting trunk row's
    /// (which row holds what: `queue`).
    q: u64,
    queue: MtpQueue,
    /// f32 `[max_batch][2·hidden]`: the eh_proj input.
    cat: u64,
    /// The `x` row the last head drew its draft from: a chained step's hidden input, taken
    /// through the shared-head norm by `embed_cat2` (hence the `true` beside it where passed).
    head_row: u64,
    /// Whole drafts (the queued slots, then the chained steps) as one graph, by (slots,
    /// drafts, with probabilities), and where they leave their drafts (i32
    /// `[MAX_GRAPH_DRAFTS]`) and, with probabilities, each draft's (f32 `[MAX_GRAPH_DRAFTS]`).
    draft_graphs: HashMap<(usize, usize, bool), CudaGraph>,
    drafts: u64,
    draft_probs: u64,
}

/// The kernels that do not depend on a weight type.
struct Kernels {
    rms_norm: CudaFunction,
    rms_norm_gated: CudaFunction,
    argmax_chain: CudaFunction,
    dn_restore: CudaFunction,
    swiglu: CudaFunction,
    dn_conv_seq: CudaFunction,
    dn_conv_prompt: CudaFunction,
    dn_conv_shift: CudaFunction,
    dn_qk_norm: CudaFunction,
    dn_gates: CudaFunction,
    dn_delta_seq: CudaFunction,
    dn_fused_seq: CudaFunction,
    dn_fused_cols: CudaFunction,
    dn_fused_cols_rows: CudaFunction,
    attn_qk_prep: CudaFunction,
    attn_causal: CudaFunction,
    attn_prompt: CudaFunction,
    attn_split: CudaFunction,
    attn_split_gqa: CudaFunction,
    attn_split_gqa4: CudaFunction,
    attn_merge: CudaFunction,
    argmax: CudaFunction,
    sample_topk: CudaFunction,
    moe_group: CudaFunction,
    swiglu_pairs: CudaFunction,
    moe_combine_pairs: CudaFunction,
    matvec_q8x: CudaFunction,
    matvec_q8x_q6k: CudaFunction,
    matvec_q8x_tok: CudaFunction,
    matvec_q8x_tok_q6k: CudaFunction,
    matvec_q8x_xr_q6k: CudaFunction,
    matvec_q8x_mma: CudaFunction,
    swiglu_q8: CudaFunction,
    rms_norm_q8: CudaFunction,
    matvec3_x_f32: CudaFunction,
    matvec3_x_tok_f32: CudaFunction,
    res_norm_q8: CudaFunction,
    res_norm_router: CudaFunction,
    moe_gate_up_route: CudaFunction,
    moe_gate_up_route2: CudaFunction,
    /// `moe_route_gate_up_q8q_iq2_xxs` and its blocks an SM (its grid barrier needs every block
    /// resident at once: the launch checks the grid against it).
    moe_route_fused: (CudaFunction, u32),
}

/// Activation buffers for `max_batch` tokens.
struct Scratch {
    x: u64,
    xn: u64,
    // DeltaNet
    qkv: u64,
    conv: u64,
    z: u64,
    ba: u64,
    beta: u64,
    g: u64,
    o: u64,
    gated: u64,
    // attention
    qg: u64,
    kn: u64,
    vn: u64,
    q: u64,
    gate: u64,
    att: u64,
    // MoE
    rlog: u64,
    wts: u64,
    act: u64,
    sg: u64,
    su: u64,
    sa: u64,
    shared: u64,
    gl: u64,
    // head
    logits: u64,
    /// i32 `[1 + max_batch]`: the start position, then the token ids.
    input: u64,
    /// i32 `[max(1, max_verify)]`: the sampled token (the rows' greedy tokens of a verify pass).
    out: u64,
    /// f32 `[1]`: the uniform draw of the sampler.
    u: u64,
    /// u32 `[max_batch]`, zero between launches: blocks finished per token (`matvec_res_*`).
    counter: u64,
    /// u64 `[GRID_COUNTERS]`, only ever growing: `grid_sync`'s block arrivals, one counter per
    /// (kernel, grid size) (`CudaModel::grid_counter`).
    grid_counter: u64,
    /// `dn_fused_cols`' barrier counters, one per QK head (u64, only ever growing).
    dn_counter: u64,
    /// `argmax`'s slice winners (f32 value, i32 index) `[max(1, max_verify)][ARGMAX_SLICES]` and
    /// its u32 `[max(1, max_verify)]` count of finished slices per row (zero between launches).
    argmax_part: u64,
    argmax_counter: u64,
    /// `[max_batch]` q8 rows of `xn` (`q8_row_bytes(hidden)` each), written with it by
    /// `matvec_res` for the MoE's 8-bit kernels.
    xq: u64,
    /// `[max_batch]` q8 rows of the shared expert's activation `sa` (`swiglu_q8`).
    xq_sa: u64,
    /// `[max_batch · k]` q8 rows of the routed experts' activations (`q8_row_bytes(expert_ff)`
    /// each; `REDLITE_CUDA_Q8_MOE_DOWN`).
    act_q: u64,
    /// `[max_batch]` q8 rows of a mixer's normalised input and f32 `[max_batch]` its 1 / rms
    /// (`rms_norm_q8`).
    xq_in: u64,
    xq_inv: u64,
    // Prompts through the GEMMs ([`GEMM_MIN_TOKENS`]): the routed experts' (token, choice) pairs
    // grouped by expert, their gate/up rows, their down rows.
    /// i32 `[n_expert + 1]`: where each expert's pairs start in `pairs`.
    pair_off: u64,
    /// i32 `[max_batch · k]`: pair indices `t · k + j`, grouped by expert.
    pairs: u64,
    /// f32 `[max_batch · k][2 · expert_ff]`: each pair's gate then up rows.
    gu: u64,
    /// f32 `[max_batch · k][hidden]`: each pair's down rows (unweighted).
    down: u64,
    /// f32 `[max(1, max_verify)][heads][attn_splits][head_dim + 2]`: the chunks of `attn_split`.
    attn_part: u64,
    /// f32 pairs `[max_context][rope_dims / 2]`: `rope_table`'s {cos, sin} per position and pair.
    rope_cs: u64,
}

/// The captured decode step and the sampling settings it was captured with.
struct Captured {
    graph: CudaGraph,
    sampling: GpuSampling,
}

/// A Qwen3-Next model resident on one GPU, with one sequence's state.
pub struct CudaModel {
    pub config: Config,
    opts: CudaModelOptions,
    gpu: Arc<Gpu>,
    stream: Arc<CudaStream>,
    k: Kernels,
    embed_f: CudaFunction,
    /// `embed_cat2_<type>`: the MTP block's embedding and its input norms in one launch.
    embed_cat2_f: CudaFunction,
    embed: u64,
    output_norm: u64,
    output: DevLinear,
    layers: Vec<DevLayer>,
    sc: Scratch,
    pos: usize,
    /// Row of the logits buffer that holds the last token's logits.
    last_row: usize,
    graph: Option<Captured>,
    /// Kernel launches so far (a captured step counts as its launches once, at capture).
    launches: u64,
    /// Launches in one decode step (measured at the first step).
    step_launches: Option<u64>,
    /// Decode steps run so far, and the one to bracket with the CUDA profiler (`profile_step`).
    decode_steps: u64,
    profile_step: Option<u64>,
    /// Verify passes run so far, and the one to bracket with the profiler
    /// (`REDLITE_CUDA_PROFILE_VERIFY=N`: the N-th pass, counted from 0).
    verify_passes: u64,
    profile_verify: Option<u64>,
    /// Graph captures invalidated from outside so far (each tried again; see `capture`).
    captures_invalidated: u64,
    /// MTP drafts run so far, and the one to bracket with the profiler, enqueued eagerly
    /// (`REDLITE_CUDA_PROFILE_DRAFT=N`: the N-th draft, counted from 0).
    mtp_drafts: u64,
    profile_draft: Option<u64>,
    /// A graphed MTP draft stops after its first draft whose probability is below this, as the
    /// CPU's `--spec-mtp-min-prob` (`REDLITE_CUDA_MTP_MIN_PROB`, default 0: every draft kept;
    /// not yet measured on a GPU). The chain's launches still run (one graph); the verify
    /// pass gets fewer rows. Eager drafts (the first after a long prompt) keep every draft.
    mtp_min_prob: f32,
    /// NVTX ranges per layer while the profiled step is enqueued (loaded with `profile_step`).
    nvtx: Option<crate::nvtx::Nvtx>,
    /// The profiled step is being enqueued.
    in_profile: bool,
    /// Work units per lane the fused matvecs aim for (`mvf_parts`; tuning switch
    /// `REDLITE_CUDA_MVF_LANE_ITERS`, default 4: 168 tok/s against 156 with 2 and 140 with 1).
    mvf_lane_iters: usize,
    /// Consecutive rows per group of warps in `matvec_norm3` and `matvec_res`
    /// (`mvf_rows_from_env`); the lm_head takes one.
    mvf_rows: usize,
    res_rows: usize,
    /// Work units per lane for the residual matvecs (`matvec_res_*`, the output projections;
    /// `REDLITE_CUDA_RES_LANE_ITERS`, default `mvf_lane_iters`): one-token and verify calls alike,
    /// so their rows keep the same bits.
    res_lane_iters: usize,
    /// Tokens per tile of the token-tile matvecs for multi-token calls (`token_tile_from_env`; 0:
    /// by the call's tokens, `token_tile`).
    token_tile: usize,
    /// Prompts may use the GEMMs (`gemm_from_env`), and whether the call being enqueued does.
    gemm: bool,
    gemm_now: bool,
    /// Prompts through the GEMMs still take `dn_fused_seq` (`REDLITE_CUDA_DN_PROMPT_FUSED=1`).
    dn_fused_prompt: bool,
    /// Prompts' delta rule by `dn_delta_warp_<dk>` (`REDLITE_CUDA_DN_WARP=0`: `dn_delta_seq`).
    dn_warp: bool,
    /// Fewest cache positions per chunk of the decode attention split (`attn_split`):
    /// `REDLITE_CUDA_ATTN_MIN_CHUNK` (a tuning switch, by default [`ATTN_DEFAULT_MIN_CHUNK`], at
    /// least 4, rounded up to a multiple of 4).
    /// Larger chunks: fewer blocks and partial results.
    attn_min_chunk: usize,
    /// Chunks of the decode attention split at most (`REDLITE_CUDA_ATTN_SPLITS`, default: SMs /
    /// KV heads with `attn_split_gqa` (one wave of its one-block-per-SM grid), else
    /// [`ATTN_DEFAULT_SPLITS`]; at most the buffers' [`attn_splits`]): long contexts get longer
    /// chunks rather than more of them.
    attn_splits: usize,
    /// Decode attention by `attn_split_gqa` (warps over positions, each scoring every query head
    /// of its KV head; the shape must fit `ops::attn_split_gqa_fits`) instead of `attn_split`
    /// (a warp per query head): `Some(P)`, P positions per warp step (`REDLITE_CUDA_ATTN_GQA=P`,
    /// 2 or 4; 0 turns it off).
    attn_gqa: Option<usize>,
    /// Blocks a KV head's query heads take in the decode attention's split kernel (2 for
    /// `attn_split_gqa8xh3_h`, else 1).
    attn_head_blocks: usize,
    /// RoPE's cosines and sines from `rope_table`'s rows (`Scratch::rope_cs`, computed once at
    /// load) instead of computed in double by every `attn_qk_prep` block
    /// (`REDLITE_CUDA_ROPE_TABLE`, default on; the same bits).
    rope_table: bool,
    /// Prompts' attention on the tensor cores (`attn_prompt_mma_<hd>`; `REDLITE_CUDA_ATTN_MMA=0`:
    /// `attn_prompt`).
    attn_mma: bool,
    /// The same for the lm_head (`REDLITE_CUDA_HEAD_LANE_ITERS`, default 8: one warp per row of
    /// the Q6_K head, which took 0.19 ms per step where the 4 of the other matrices took 0.34).
    head_lane_iters: usize,
    /// The router matvec's `(lane_iters, rows per warp)`: `REDLITE_CUDA_ROUTER_LANE_ITERS` and
    /// `REDLITE_CUDA_ROUTER_ROWS` (tuning switches; default 4 and 1: four warps a 2,048-wide
    /// row, so that the fused route kernel's 320 router groups take the 513 rows in one round,
    /// +1.0 % decode in session 19 against 1, which session 7's separate router kernel had
    /// preferred). The fused kernel and the separate matvec use the same split, so that verify
    /// rows (separate) and decode steps (fused) get the same logits.
    router_split: (usize, usize),
    /// The router kernel (`RouterKernel::for_model`: the one-warp one unless
    /// `REDLITE_CUDA_ROUTER=block`) and its function.
    router: (CudaFunction, RouterKernel),
    /// Launches with programmatic dependent launch (`pdl_enter` in common.cu): a kernel may start
    /// while the one before it in the stream finishes, its blocks prefetching their weights until
    /// the earlier grid completes. On for compute capability 9.0 and newer unless
    /// `REDLITE_CUDA_PDL=0`. Decode steps and verify rows only (not calls through the GEMMs).
    pdl: bool,
    /// Q4_K products of the fused matvecs with 8-bit activations (`matvec_norm3_q8_q4_k`:
    /// dp4a on the input quantised per 32 values; `REDLITE_CUDA_Q8=0`: f32 activations).
    q8: bool,
    /// Rows per warp group of the one-token 8-bit kernel (`REDLITE_CUDA_Q8_ROWS`, 1 to
    /// `Q8_MAX_ROWS` = 16; default 4: 32 rows a block, the input staged once for all of them; 227.95
    /// tok/s against 220.19 with 8, 205.53 with 16 and 220.70 with 2 on the H200).
    q8_rows: usize,
    /// The output projections (`matvec_res`) with 8-bit activations too (`REDLITE_CUDA_Q8_RES=1`,
    /// off by default: 217.0 against 230.3 tok/s on the H200, the staging of a 4,096-wide input
    /// per block costs more than the dp4a saves), `REDLITE_CUDA_Q8_RES_ROWS` rows per warp group.
    q8_res: bool,
    q8_res_rows: usize,
    /// The MoE block's inputs as a q8 row written once, by `matvec_res`'s last block, beside `xn`
    /// (`Scratch::xq`): the routed IQ2_XXS gate/up through `moe_gate_up_tab_q8_iq2_xxs` (dp4a,
    /// `REDLITE_CUDA_Q8_MOE`, default on) and the shared expert's Q4_K gate/up through
    /// `matvec_q8x_q4_k` (no per-block staging; `REDLITE_CUDA_XQ_SHARED`, default on), and its
    /// down rows on the q8 row `swiglu_q8` writes beside `sa`.
    q8_moe: bool,
    xq_shared: bool,
    /// Q6_K products (the lm_head) on 8-bit activations too (`matvec_q8x_q6_k`,
    /// `matvec_norm3_{,tok_}q8_q6_k`: `dp4a` on the f32 kernel's lane layout;
    /// `REDLITE_CUDA_Q8_Q6K`, on by default since session 11: 290.35 / 290.10 tok/s against
    /// 284.81 / 283.65 on the H200; fixture step KL 2.8e-5 / 4.9e-5 / 2.6e-5, in bounds).
    q8_q6k: bool,
    /// A mixer's Q4_K input projections of a one-token-at-a-time call through `rms_norm_q8` (the
    /// norm and its q8 row once per token) and `matvec_q8x_q4_k`, instead of every block of
    /// `matvec_norm3_q8_q4_k` staging them (`REDLITE_CUDA_XQ_NORM`, default on).
    xq_norm: bool,
    /// Tokens per tile of `matvec_q8x_tok_*` (the 8-bit products of a call of several tokens:
    /// `rms_norm_q8` once per token, then the weights read once per tile with the q8 rows read
    /// in place; `REDLITE_CUDA_Q8X_TILE`, 1 to 8, default 8; 1 gives the session-10 path, the
    /// staging token tiles of `matvec_norm3_tok_q8_*`).
    q8x_tile: usize,
    /// Rows per warp group of `matvec_q8x_tok_*` (`REDLITE_CUDA_Q8X_TILE_ROWS`, 1 to 16, default 2:
    /// 8 verify rows 11.61 ms against 11.64 with 1 and 11.93 with 4 on the H200; the one-token
    /// kernel takes `q8_rows`).
    q8x_tile_rows: usize,
    /// The Q4_K products of q8 rows through `matvec_q8x_mma_q4_k` (their integer sums on the
    /// tensor cores, every output the same bits) for calls of at least `REDLITE_CUDA_Q8X_MMA`
    /// tokens (0: never; default 6: full-size verify of 6 / 7 / 8 / 12 / 16 rows −1.8 / −2.6 /
    /// −4.1 / −1.9 / −4.4 % on an H100, of 5 rows −0.9 %, of 2 / 4 rows +7.5 / +3.0 %; one token
    /// −13.6 % decode; session 46).
    q8x_mma: usize,
    /// The router and the output projections of a call of several tokens through the in-place
    /// token tiles `matvec3_x_tok_f32` and `matvec_res_tok_<type>` (`REDLITE_CUDA_X_TOK`, default
    /// on; off: the staging `matvec_norm3_tok_f32` and one `matvec_res` block row per token).
    x_tok: bool,
    /// f32 products without norm weights (the router and the shared expert's gate logit) of a
    /// one-token-at-a-time call read their input in place (`matvec3_x_f32`) instead of every block
    /// staging it (`REDLITE_CUDA_X_ROUTER`, default on).
    x_router: bool,
    /// A one-token call's router top-k inside the expert gate/up kernel's blocks (each block of
    /// the token redoes it: `moe_gate_up_route_q8q_iq2_xxs`) instead of a `moe_router_warp`
    /// launch before it (`REDLITE_CUDA_ROUTE_IN_GATE_UP`, default on). On the H200: decode with
    /// every expert resident 275.5 / 275.5 tok/s against 275.4 / 276.4 (48 launches fewer, but
    /// the fused kernel takes 20.3 µs a layer against 14.5 + 7.3), with `--memory 16GiB` (experts
    /// over PCIe) 174.3 / 173.8 against 167.7 / 169.4. Verify passes keep the separate top-k
    /// (8 rows: 12.60 against 11.62 ms).
    route_in_gate_up: bool,
    /// The routed gate/up kernel with a warp's two rows walked together
    /// (`moe_gate_up_route2_q8q_iq2_xxs`, the same bits; `REDLITE_CUDA_MOE_GU_PAIR=0` the one-row
    /// form): 303.73 / 301.76 against 300.88 / 300.15 tok/s on the H200.
    moe_gu_pair: bool,
    /// One-token steps without `norm_router`: the router's logits, the top-k and the routed gate/up
    /// in one launch with a grid barrier between the logits and the top-k
    /// (`moe_route_gate_up_q8q_iq2_xxs`, the same bits; `REDLITE_CUDA_ROUTE_FUSED=0`:
    /// `matvec3_x_f32` then `moe_gate_up_route2_q8q_iq2_xxs`).
    route_fused: bool,
    /// One-token steps: the router's logits and the shared expert's gate logit computed by the
    /// output projection's next norm (`res_norm_router`: `res_norm_q8` and `matvec3_x_f32` in one
    /// launch, the router weights loaded before its wait; the same bits), then the top-k and the
    /// routed gate/up without the fused route kernel's rows and grid barrier
    /// (`moe_gate_up_route2_q8q_iq2_xxs`). Default on since session 42 (H100: decode +2.4 %,
    /// 406.62 against 397.02 tok/s; +2.3 % at 32K); `REDLITE_CUDA_NORM_ROUTER=0`: the fused route
    /// kernel (`route_fused`).
    norm_router: bool,
    /// `res_norm_router`'s direct form: the router blocks compute yn at their own columns beside
    /// their sum of squares (no staging, no barrier before the rows) and `norm_slices` more blocks
    /// write the norm's slices. Default on since session 42 (H100: decode +5.7 %, 415.49 against
    /// 393.04 tok/s over the staging form; 32K +5.1 %; the same bits);
    /// `REDLITE_CUDA_NORM_ROUTER_DIRECT=0` the staging form.
    norm_router_direct: bool,
    /// The router launch `res_norm_router` takes for the layer being enqueued (set before its
    /// mixer when `norm_router` applies, taken by [`Self::matvec_residual`]).
    next_router: Option<NormRouter>,
    /// Whether the last `matvec_residual` wrote the router's logits (`res_norm_router`).
    logits_ready: bool,
    /// (kernel, grid size) → `grid_sync` counter index, in order of first use.
    grid_counters: Vec<(&'static str, u32)>,
    /// `dn_fused_seq` loads its state rows before waiting for the kernel ahead
    /// (`REDLITE_CUDA_DN_EARLY`, default on; the same bits).
    dn_early: bool,
    /// The fused DeltaNet core as `dn_fused_cols` (a V head's state columns over dv / 32 blocks,
    /// 128 at full size, a barrier per QK head before the gated norm) instead of `dn_fused_seq`
    /// (a QK head a block: 16): its launch `(grid, threads, shared bytes)`, when the shape has one,
    /// `REDLITE_CUDA_DN_COLS` is not 0 and every block fits the GPU at once (the barrier needs a
    /// head's blocks resident together). The same bits; default on since session 17 (+6.8 %
    /// against `dn_fused_seq` on the H200 once its spills were gone; 2.4 % slower with them).
    dn_cols: Option<(u32, u32, u32)>,
    /// Calls of several tokens (verify passes, short prompts) take `dn_fused_cols_rows` (the
    /// chunk's conv, gates, q/k norms and conv trace ahead of the recurrence, one barrier a
    /// token) instead of `dn_fused_cols` (`REDLITE_CUDA_DN_ROWS`, default on; the same bits).
    dn_rows: bool,
    /// The fused DeltaNet kernels load their conv weights and windows, gate parameters and norm
    /// weights before the wait (`early` bit 1; `REDLITE_CUDA_DN_PRE`): after it only the
    /// projections (qkv, ba, z) are read; the same bits.
    dn_pre: bool,
    /// The IQ2_XXS q8 expert kernels find expert e's parts at expert 0's + e · slot stride
    /// (`ExpertCache::direct_stride`: every expert resident) instead of loading the table entry
    /// after the ids (`REDLITE_CUDA_MOE_DIRECT`, default on: +0.8 % decode in session 14; off, and always when
    /// some experts live in host memory: the table).
    moe_direct: bool,
    /// `matvec_res`'s next norm (`xn` and its q8 row) by a kernel of its own (`res_norm_q8`)
    /// instead of its last block (`REDLITE_CUDA_RES_NORM_SPLIT=0`): 260.9 / 262.1 against 255.6 /
    /// 254.7 tok/s on the H200 (ncu: `matvec_res` 18.4 → 7.9 µs, the counting of its 512 blocks
    /// and the one-block tail gone).
    res_norm_split: bool,
    /// Timing diagnostics only: launches to leave out (`REDLITE_CUDA_SKIP`, comma-separated
    /// launch names such as `dn_fused_seq`, or `stage:name` / `stage:*` with stage `dn`, `attn`,
    /// `moe`, `shared` or `head`; `dn:z_rows` leaves the output gate's rows out of the DeltaNet
    /// in-projection launch; `!name` keeps a launch that another entry lists, as in `*,!embedding`).
    /// The outputs are garbage; the step time shows what each stage costs on the critical path of
    /// the replayed graph (ncu times each kernel alone).
    skip: Vec<String>,
    /// Timing diagnostics only: launches replaced by `noop_pdl` with the same grid and block
    /// (`REDLITE_CUDA_NOOP`, the names as for `skip`, or `*` for all): the step time of the
    /// launches without their work.
    noop: Vec<String>,
    /// The stage the launches being enqueued belong to (for `skip`).
    stage: &'static str,
    /// Blocks per row of the greedy `argmax` (`REDLITE_CUDA_ARGMAX_SLICES`, 1 to
    /// [`ARGMAX_SLICES`], the default).
    argmax_slices: usize,
    /// Blocks per token of the one-token norms `rms_norm_q8` and `res_norm_q8` (each sums all the
    /// squares and writes a slice of the q8 row; `REDLITE_CUDA_NORM_SLICES`, 1 to 64, default
    /// [`crate::ops::NORM_SLICES`]).
    norm_slices: usize,
    /// Whether the last `matvec_residual` wrote `xq` (not when it went through a GEMM).
    xq_fresh: bool,
    /// With `q8_moe`, the IQ2_XXS down projection on 8-bit activations as well
    /// (`moe_gate_up_tab_q8q_iq2_xxs` quantises each 32 rows' activations, then
    /// `moe_down_combine_tab_q8_iq2_xxs`; `REDLITE_CUDA_Q8_MOE_DOWN=0` turns it off: on the H200
    /// 255.4 / 256.5 tok/s against 250.3 / 248.9 without, 152.0 against 145.5 at 16 GiB lfu).
    q8_moe_down: bool,
    /// Rows per warp of the decode expert gate/up kernel (`moe_gate_up_tab`):
    /// `REDLITE_CUDA_MOE_ROWS` (1 to 8, default 1: more were slower); it takes what the grid leaves.
    moe_rows: u32,
    /// Warps per row asked of `moe_down_combine_tab` (`REDLITE_CUDA_MOE_DOWN_PARTS`, default 2;
    /// [`Self::moe_down_parts`] fits it to the kernel).
    moe_down_parts: usize,
    /// Tokens a block of the IQ2_XXS routed experts' token-tile kernels in calls of several tokens
    /// (verify rows, short prompts), gate/up and down: `REDLITE_CUDA_MOE_TOK=g:d` (g 1 ..
    /// [`MOE_TOK_GU_MAX`], d 1 .. [`MOE_TOK_DOWN_MAX`]; 0: the one-token kernels on a grid of
    /// tokens; default `0:8`, see [`moe_tok_tiles`]).
    moe_tok: (usize, usize),
    /// Rows a warp group of the Q4_K output projections' token tiles (`REDLITE_CUDA_RES_TOK_ROWS`:
    /// 1, 2, or 0 for the default [`res_tok_rows`]): 2 takes `matvec_res_tok2_q4_k` (each token's
    /// activations loaded once for two rows; the same bits).
    res_tok_rows: usize,
    /// The Q4_K output projections of calls of at least `REDLITE_CUDA_RES_XR` tokens through
    /// `matvec_res_xr_q4_k` (8 rows × 8 tokens a block, each unit's activations loaded once a
    /// block into registers; the same bits as the token tiles); 0: never. Default 2 (H100,
    /// session 47, full-size verify, three alternating rounds each: 3 rows −3.9 % against the
    /// two-row tiles and 2 rows even (run 7); at 4 / 8 / 16 rows the first form −1 / −8 / −6.6 %
    /// against the tiles (run 1), this form another −3.4 / −1.5 / −1.4 % (run 4)).
    res_xr: usize,
    /// The Q6_K head (one slice a row) of calls of at least `REDLITE_CUDA_HEAD_XR` tokens through
    /// `matvec_q8x_xr_q6_k` (16 rows × 8 tokens a block, each token's q8 values loaded once for
    /// four rows; the same bits as the token tiles); 0: never. Default 2 (H100, session 47, three
    /// alternating rounds: full-size verify of 3 / 4 / 6 / 8 / 16 rows −0.6 / −0.8 / −0.8 / −1.5 /
    /// −1.8 %, 2 rows even).
    head_xr: usize,
    /// The last verify pass, `(start position, rows)`, until `keep` or another call.
    verified: Option<(usize, usize)>,
    /// The routed experts: device slots, host copies, per-layer address tables.
    experts: ExpertCache,
    /// The MTP block (`CudaModelOptions::mtp` and a file that has one).
    mtp: Option<DevMtp>,
    /// Verify passes and MTP draft steps of up to [`SMALL_GRAPH_ROWS`] rows as CUDA graphs,
    /// captured at their first use per row count (`REDLITE_CUDA_SMALL_GRAPHS`, default on;
    /// with `graphs`, and with every expert resident for verify passes).
    small_graphs: bool,
    /// By (rows, greedy argmax included); captured at the [`VERIFY_GRAPH_AFTER`]-th pass of
    /// that many rows (`verify_uses`), so that a row count seen once or twice costs no capture.
    verify_graphs: HashMap<(usize, bool), CudaGraph>,
    verify_uses: HashMap<(usize, bool), u32>,
    /// `dn_restore`'s table (per DeltaNet layer: state, its trace, conv state, its trace) and
    /// its layers, when there are verify traces and the state sizes suit it (`keep`).
    dn_restore: Option<(u64, usize)>,
    side: MoeSide,
    /// Long prompts' dense products through cuBLAS ([`PromptBlas`]; `None`: the library is not
    /// there, `REDLITE_CUDA_CUBLAS=0`, or batches too small to use it).
    blas: Option<PromptBlas>,
    /// Why `blas` is `None`.
    blas_off: Option<String>,
    // Last: frees the device memory after everything that may point into it.
    arena: Arena,
}

fn model_err(e: ModelError) -> CudaError {
    CudaError::Invalid(e.to_string())
}

fn i32_of(v: usize, what: &str) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| CudaError::Invalid(format!("{what} = {v} exceeds a kernel int")))
}

fn blocks(n: usize, per: u32) -> u32 {
    n.div_ceil(per as usize).max(1) as u32
}

impl CudaModel {
    /// Open a GGUF file and upload it to `gpu`.
    pub fn load(
        gpu: Arc<Gpu>,
        path: impl AsRef<Path>,
        opts: CudaModelOptions,
    ) -> Result<CudaModel, CudaError> {
        let path = path.as_ref();
        let file = GgufFile::open(path)
            .map_err(|e| CudaError::Invalid(format!("opening {}: {e}", path.display())))?;
        CudaModel::from_gguf(gpu, Arc::new(file), opts)
    }

    /// Tokens processed so far (the position of the next one).
    pub fn pos(&self) -> usize {
        self.pos
    }

    /// The GPU the model is on.
    pub fn device_info(&self) -> &crate::DeviceInfo {
        &self.gpu.info
    }

    /// The phase sums of a `REDLITE_TRACE` build so far ([`Gpu::trace`]), after the model's stream has
    /// finished; `reset` zeroes them.
    pub fn trace(&self, reset: bool) -> Result<Vec<u64>, CudaError> {
        self.sync()?;
        self.gpu.trace(reset)
    }

    pub fn options(&self) -> &CudaModelOptions {
        &self.opts
    }

    /// How long prompts' dense products run, in words: through cuBLAS from how many tokens, or
    /// on the own kernels and why.
    pub fn prompt_gemms(&self) -> String {
        match (&self.blas, &self.blas_off) {
            (Some(b), _) => format!("prompt GEMMs through cuBLAS from {} tokens", b.min_tokens),
            (None, why) => format!(
                "prompt GEMMs on the own kernels ({})",
                why.as_deref().unwrap_or("cuBLAS off")
            ),
        }
    }

    /// Device memory the model holds (weights, caches, states, scratch), bytes.
    pub fn device_bytes(&self) -> usize {
        self.arena.bytes
    }

    /// The routed experts' cache (sizes, counters).
    pub fn expert_cache(&self) -> &ExpertCache {
        &self.experts
    }

    pub fn expert_cache_mut(&mut self) -> &mut ExpertCache {
        &mut self.experts
    }

    /// Kernel launches of one decode step (known after the first step).
    pub fn launches_per_step(&self) -> Option<u64> {
        self.step_launches
    }

    /// Kernel launches issued so far (graph replays not counted).
    /// Bracket decode step `step` (0 = the first `decode` call) with `cuProfilerStart` /
    /// `cuProfilerStop`, so `ncu --profile-from-start off` captures exactly that token's kernels
    /// (also set by the environment variable `REDLITE_CUDA_PROFILE_STEP`).
    /// NVTX ranges name each layer of that step when `libnvToolsExt` can be opened (with graphs
    /// on, kernels are enqueued only at the capture, so use no graphs to see the ranges); returns
    /// why when it cannot.
    pub fn set_profile_step(&mut self, step: Option<u64>) -> Result<(), String> {
        self.profile_step = step;
        if step.is_some() && self.nvtx.is_none() {
            self.nvtx = Some(crate::nvtx::Nvtx::load()?);
        }
        Ok(())
    }

    /// Move the sequence to position `pos` without running the tokens in between (their cache
    /// rows keep what they hold: zeros after loading, or an earlier sequence's keys and values).
    /// For timing decode at a long context without its prompt pass; the recurrent states are
    /// left as they are.
    pub fn skip_to(&mut self, pos: usize) -> Result<(), CudaError> {
        if pos >= self.opts.max_context {
            return Err(CudaError::Invalid(format!(
                "position {pos} is outside the {} positions allocated",
                self.opts.max_context
            )));
        }
        self.pos = pos;
        self.verified = None;
        Ok(())
    }

    pub fn launches(&self) -> u64 {
        self.launches
    }

    /// Graph captures that another thread's synchronisation invalidated so far (each one tried
    /// again, or its launches run without a graph).
    pub fn captures_invalidated(&self) -> u64 {
        self.captures_invalidated
    }

    /// Timing diagnostics (`bench decode`): the captured decode graph replayed `n` times back to
    /// back at the current position, without the step's round trip through the host (the token
    /// id up, the drawn id down, the host's bookkeeping): seconds a replay, or `None` without a
    /// graph or with a bounded expert cache (whose misses the host serves between steps). Each
    /// replay runs the step again on the same input, so the cache row is rewritten and the
    /// recurrent states advance; the sequence is cleared afterwards ([`Self::reset`]).
    pub fn time_graph_replays(&mut self, n: usize) -> Result<Option<f64>, CudaError> {
        if self.graph.is_none() || n == 0 || self.experts.bounded() {
            return Ok(None);
        }
        self.bind()?;
        self.sync()?;
        let t = std::time::Instant::now();
        if let Some(c) = &self.graph {
            for _ in 0..n {
                c.graph
                    .launch()
                    .map_err(|e| CudaError::driver("replaying the decode graph", e))?;
            }
        }
        self.sync()?;
        let secs = t.elapsed().as_secs_f64() / n as f64;
        self.reset()?;
        Ok(Some(secs))
    }

    /// Start a new sequence: position 0, recurrent states zeroed (KV entries are overwritten).
    pub fn reset(&mut self) -> Result<(), CudaError> {
        self.bind()?;
        for l in &self.layers {
            if let DevMixer::DeltaNet { conv_state, s, .. } = &l.mixer {
                let c = &self.config;
                let conv_bytes = 4 * (c.conv_kernel - 1) * c.dn_conv_channels();
                let s_bytes = 4 * c.dn_v_heads * c.dn_k_dim * c.dn_v_dim;
                for (p, n) in [(*conv_state, conv_bytes), (*s, s_bytes)] {
                    // SAFETY: `p` holds `n` bytes, ordered on the model's stream.
                    unsafe { cu::memset_d8_async(p, 0, n, self.stream.cu_stream()) }
                        .map_err(|e| CudaError::driver("clearing the recurrent state", e))?;
                }
            }
        }
        self.sync()?;
        self.pos = 0;
        self.verified = None;
        if let Some(m) = self.mtp.as_mut() {
            m.queue.reset();
        }
        Ok(())
    }

    /// Run `tokens` after what the sequence holds and return every token's logits.
    pub fn forward_logits(&mut self, tokens: &[u32]) -> Result<Vec<Vec<f32>>, CudaError> {
        let vocab = self.config.vocab;
        let mut out = Vec::with_capacity(tokens.len());
        for chunk in tokens.chunks(self.opts.max_batch) {
            self.run_chunk(chunk, Head::All)?;
            let mut flat = vec![0.0f32; chunk.len() * vocab];
            self.download(&mut flat, self.sc.logits)?;
            out.extend(flat.chunks_exact(vocab).map(|r| r.to_vec()));
        }
        Ok(out)
    }

    /// Run a prompt; only the last token's logits are computed (they stay on the device, see
    /// [`CudaModel::last_logits`] and [`CudaModel::sample_last`]).
    pub fn prefill(&mut self, tokens: &[u32]) -> Result<(), CudaError> {
        let n = tokens.len();
        let mut start = 0;
        while start < n {
            let end = (start + self.opts.max_batch).min(n);
            let head = if end == n { Head::Last } else { Head::None };
            self.run_chunk(&tokens[start..end], head)?;
            start = end;
        }
        Ok(())
    }

    /// The logits of the last token run.
    pub fn last_logits(&self) -> Result<Vec<f32>, CudaError> {
        let vocab = self.config.vocab;
        let mut row = vec![0.0f32; vocab];
        self.download(
            &mut row,
            self.sc.logits + (4 * self.last_row * vocab) as u64,
        )?;
        Ok(row)
    }

    /// Draw the next token from the last token's logits on the GPU (`u` uniform in [0, 1)).
    pub fn sample_last(&mut self, s: &GpuSampling, u: f32) -> Result<u32, CudaError> {
        self.bind()?;
        self.upload_u(u, s)?;
        let row = self.sc.logits + (4 * self.last_row * self.config.vocab) as u64;
        self.enqueue_sample(row, s)?;
        self.read_out()
    }

    /// One decode step: run `token` at the current position and draw the next one on the GPU
    /// (greedy, or top-k sampling with the uniform draw `u`). With graphs on, the step is
    /// captured at its first use (and again when the sampling settings change), then replayed.
    pub fn decode(&mut self, token: u32, s: &GpuSampling, u: f32) -> Result<u32, CudaError> {
        if !s.supported() {
            return Err(CudaError::Invalid(format!(
                "GPU sampling needs greedy decoding or top-k in 1..={MAX_SAMPLE_TOP_K} (got {})",
                s.top_k
            )));
        }
        self.bind()?;
        self.mtp_make_room(1)?;
        self.upload_input(&[token])?;
        self.upload_u(u, s)?;
        let profiled = self.profile_step == Some(self.decode_steps);
        self.decode_steps += 1;
        if profiled && self.nvtx.is_none() {
            // Ranges when the library is there; the step is profiled either way.
            self.nvtx = crate::nvtx::Nvtx::load().ok();
        }
        if profiled {
            self.profiler(true)?;
            self.in_profile = true;
        }
        if self.opts.graphs && self.graph.as_ref().is_none_or(|g| g.sampling != *s) {
            self.graph = None;
            let sampling = *s;
            let mut first = 0;
            let captured = self.capture(|m| {
                first = m.launches;
                m.enqueue_step(&sampling)
            })?;
            if let Some(graph) = captured {
                self.graph = Some(Captured { graph, sampling });
                self.step_launches = Some(self.launches - first);
            }
        }
        match &self.graph {
            Some(c) => c
                .graph
                .launch()
                .map_err(|e| CudaError::driver("replaying the decode graph", e))?,
            // Graphs off, or another thread kept invalidating the capture (the next step tries
            // again): the step's launches, run now.
            None => {
                let first = self.launches;
                self.enqueue_step(s)?;
                self.step_launches = Some(self.launches - first);
            }
        }
        if profiled {
            self.in_profile = false;
            self.profiler(false)?;
        }
        self.mtp_record(&[token], false)?;
        self.pos += 1;
        self.last_row = 0;
        self.verified = None;
        let id = self.read_out()?;
        self.experts.after_forward(&self.stream, 1)?;
        Ok(id)
    }
}

impl Drop for CudaModel {
    fn drop(&mut self) {
        // The graph and the stream go before the memory they use (the arena is the last field).
        self.graph = None;
        let _ = self.bind();
        let _ = self.sync();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_projection_tile_rows_by_call_length() {
        // Default: two rows a warp group up to 4 tokens; a setting of 1 or 2 holds for any length.
        assert_eq!(res_tok_rows(0, 2), 2);
        assert_eq!(res_tok_rows(0, 4), 2);
        assert_eq!(res_tok_rows(0, 5), 1);
        assert_eq!(res_tok_rows(0, 16), 1);
        assert_eq!(res_tok_rows(1, 2), 1);
        assert_eq!(res_tok_rows(2, 16), 2);
    }

    #[test]
    fn token_tiles_by_call_length() {
        // One token: no tile. Automatic: 2 up to 8 tokens, then 4; never more than the tokens or
        // than 48 KiB of f32 inputs.
        assert_eq!(token_tile(0, 1, 2048), 1);
        assert_eq!(token_tile(0, 4, 2048), 2);
        assert_eq!(token_tile(0, 8, 2048), 2);
        assert_eq!(token_tile(0, 9, 2048), 4);
        assert_eq!(token_tile(0, 64, 2048), 4);
        assert_eq!(token_tile(0, 3, 8192), 1);
        // A fixed tile (`REDLITE_CUDA_TOKEN_TILE`) whatever the length.
        assert_eq!(token_tile(4, 4, 2048), 4);
        assert_eq!(token_tile(4, 3, 2048), 3);
        assert_eq!(token_tile(1, 16, 2048), 1);
    }

    /// The integer value of `#define NAME value` in matvec.cu.
    fn matvec_define(name: &str) -> usize {
        let src = crate::kernels::SOURCES
            .iter()
            .find(|(f, _)| *f == "matvec.cu")
            .expect("matvec.cu is a kernel source")
            .1;
        let line = src
            .lines()
            .find_map(|l| l.strip_prefix(&format!("#define {name} ")))
            .unwrap_or_else(|| panic!("matvec.cu defines {name}"));
        line.trim().parse().expect("an integer define")
    }

    #[test]
    fn activations_in_registers_grids_match_the_kernels() {
        // The host sizes these kernels' grids: its block shapes must be the kernels'.
        assert_eq!(RES_XR_ROWS as usize, matvec_define("XR_ROWS"));
        assert_eq!(XR_TOKENS, matvec_define("XR_TOKENS"));
        let warps = matvec_define("MVF_WARPS");
        assert_eq!(HEAD_XR_ROWS as usize, warps / 2 * matvec_define("XQ_ROWS"));
    }

    #[test]
    fn tensor_core_products_shared_memory() {
        // 16 padded Q4_K rows, their scale quads, 8 padded q8 rows (ncu saw 12.93 KB at 512).
        assert_eq!(q8x_mma_smem(2048), Some(49_792));
        assert_eq!(q8x_mma_smem(512), Some(12_928));
        assert_eq!(q8x_mma_smem(4096), None);
    }

    /// `matvec_q8x_mma_q4_k`'s order of additions, here on the host: `warp_sum`'s butterfly (lane
    /// 0's value after v_L += v_{L^o} for o = 16 … 1) equals a binary counter over the lanes in
    /// bit-reversed order, cut into 8 runs of 4 leaves whose roots a second counter adds
    /// (`q8x_mma_push`), bit for bit, where a sequential sum does not.
    #[test]
    fn bit_reversed_counter_is_the_warp_butterfly() {
        fn push(stk: &mut [f32], v: &mut f32, i: usize) {
            for (b, s) in stk.iter_mut().enumerate() {
                if (i >> b) & 1 == 1 {
                    *v += *s; // left subtree + right (an f32 addition commutes)
                } else {
                    *s = *v;
                    return;
                }
            }
        }
        fn counter(leaves: impl Iterator<Item = f32>, levels: usize) -> f32 {
            let mut stk = vec![0.0f32; levels];
            let mut v = 0.0;
            for (i, leaf) in leaves.enumerate() {
                v = leaf;
                push(&mut stk, &mut v, i);
            }
            v
        }
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            // Values over many binades, so that the order of additions shows in the bits.
            let m = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            m * 2f32.powi((state % 24) as i32 - 12)
        };
        let mut sequential_differs = false;
        for _ in 0..2000 {
            let lanes: Vec<f32> = (0..32).map(|_| next()).collect();
            let mut v = lanes.clone();
            for o in [16, 8, 4, 2, 1] {
                v = (0..32).map(|l| v[l] + v[l ^ o]).collect();
            }
            let rev = |i: usize| (i as u32).reverse_bits() as usize >> 27;
            let roots: Vec<f32> = (0..8)
                .map(|run| counter((0..4).map(|i| lanes[rev(run * 4 + i)]), 2))
                .collect();
            let tree = counter(roots.into_iter(), 3);
            assert_eq!(tree.to_bits(), v[0].to_bits());
            sequential_differs |= lanes.iter().sum::<f32>().to_bits() != v[0].to_bits();
        }
        assert!(sequential_differs);
    }
}
