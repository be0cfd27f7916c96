//! Gated attention (`attention.cu`, `rope.cu`): RoPE, the KV write, the decode attention split
//! over the cache and its merge, the causal prompt kernels.

use super::*;

/// NeoX RoPE on `[tokens][heads][head_dim]`, token t at position `pos0 + t`.
pub fn rope_neox(
    gpu: &Gpu,
    x: &[f32],
    heads: usize,
    head_dim: usize,
    rope_dims: usize,
    pos0: usize,
    theta: f64,
) -> Result<Vec<f32>, CudaError> {
    let tokens = check_rows(x.len(), heads * head_dim, "rope")?;
    if rope_dims > head_dim || !rope_dims.is_multiple_of(2) {
        return Err(CudaError::Invalid(format!(
            "rope: {rope_dims} rotary dims of {head_dim}"
        )));
    }
    let mut xd = upload(gpu, x)?;
    let (hd, rd, p0) = (
        i32_arg(head_dim, "head_dim")?,
        i32_arg(rope_dims, "rope_dims")?,
        i32_arg(pos0, "pos")?,
    );
    launch!(
        gpu,
        gpu.func("rope_neox")?,
        "rope_neox",
        cfg((heads as u32, tokens as u32, 1), 64, 0),
        [&mut xd, &hd, &rd, &p0, &theta]
    )?;
    download(gpu, &xd)
}

/// Attention of one token over `n` cached positions: `q [heads][hd]`, caches `[n][nkv][hd]`.
#[allow(clippy::too_many_arguments)] // the kernel's own shape parameters
pub fn attn_decode(
    gpu: &Gpu,
    q: &[f32],
    kc: &[f32],
    vc: &[f32],
    heads: usize,
    nkv: usize,
    hd: usize,
    scale: f32,
) -> Result<Vec<f32>, CudaError> {
    let n = check_rows(kc.len(), nkv * hd, "attn k cache")?;
    if q.len() != heads * hd || vc.len() != kc.len() || !heads.is_multiple_of(nkv) {
        return Err(CudaError::Invalid("attn_decode: sizes".into()));
    }
    let (qd, kd, vd) = (upload(gpu, q)?, upload(gpu, kc)?, upload(gpu, vc)?);
    let mut scratch = alloc_poisoned::<f32>(gpu, heads * n)?;
    let mut o = alloc_poisoned::<f32>(gpu, heads * hd)?;
    let (ni, nkvi, hdi) = (i32_arg(n, "n")?, i32_arg(nkv, "nkv")?, i32_arg(hd, "hd")?);
    launch!(
        gpu,
        gpu.func("attn_decode")?,
        "attn_decode",
        cfg((heads as u32, 1, 1), 256, 0),
        [
            &qd,
            &kd,
            &vd,
            &mut scratch,
            &mut o,
            &ni,
            &nkvi,
            &hdi,
            &scale
        ]
    )?;
    download(gpu, &o)
}

/// Shapes of gated attention.
#[derive(Debug, Clone, Copy)]
pub struct AttnDims {
    pub heads: usize,
    pub nkv: usize,
    pub hd: usize,
    pub rope_dims: usize,
    pub theta: f64,
    pub eps: f32,
}

/// The attention kernel `name` for a KV cache of type `kv`: `name` for f32, `name_h` for f16
/// (the attention kernels take no other cache type).
pub fn kv_kernel(name: &str, kv: KvType) -> Result<String, CudaError> {
    match kv {
        KvType::F32 => Ok(name.to_string()),
        KvType::F16 => Ok(format!("{name}_h")),
        other => Err(CudaError::Invalid(format!(
            "a {other} KV cache on the GPU (the CUDA attention kernels take f32 or f16)"
        ))),
    }
}

/// A K or V cache on the device in the element type `kv` (f32, or f16 rounded to nearest even).
enum KvDev {
    F32(CudaSlice<f32>),
    F16(CudaSlice<u16>),
}

impl KvDev {
    fn upload(gpu: &Gpu, data: &[f32], kv: KvType) -> Result<KvDev, CudaError> {
        kv_kernel("", kv)?;
        Ok(if kv == KvType::F16 {
            let bits: Vec<u16> = data
                .iter()
                .map(|&x| redlite_model::kv_type::f32_to_f16(x))
                .collect();
            KvDev::F16(upload(gpu, &bits)?)
        } else {
            KvDev::F32(upload(gpu, data)?)
        })
    }

    fn address(&self, gpu: &Gpu) -> u64 {
        match self {
            KvDev::F32(b) => device_address(gpu, b),
            KvDev::F16(b) => device_address(gpu, b),
        }
    }

    /// The values as f32 (f16 widened exactly).
    fn download(&self, gpu: &Gpu) -> Result<Vec<f32>, CudaError> {
        match self {
            KvDev::F32(b) => download(gpu, b),
            KvDev::F16(b) => Ok(download(gpu, b)?
                .into_iter()
                .map(redlite_model::kv_type::f16_to_f32)
                .collect()),
        }
    }
}

/// `attn_qk_prep` on `n` tokens at positions `pos0..`: returns `(q, gate, k cache, v cache)`
/// with the caches `[ctx][nkv][hd]` (positions outside `pos0..pos0 + n` keep `kc0` / `vc0`);
/// RoPE's angles from `rope_table`'s rows when `table` (as the model runs it), else computed
/// in the kernel. The caches are of type `kv` on the device (`attn_qk_prep_h` for f16; `kc0`,
/// `vc0` rounded to it), returned as f32.
#[allow(clippy::too_many_arguments)]
#[allow(clippy::type_complexity)]
pub fn attn_qk_prep(
    gpu: &Gpu,
    qg: &[f32],
    kn: &[f32],
    vn: &[f32],
    q_norm: &[f32],
    k_norm: &[f32],
    kc0: &[f32],
    vc0: &[f32],
    pos0: usize,
    d: AttnDims,
    table: bool,
    kv: KvType,
) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>), CudaError> {
    let n = check_rows(qg.len(), d.heads * 2 * d.hd, "attn_qk_prep q")?;
    let ctx = check_rows(kc0.len(), d.nkv * d.hd, "attn_qk_prep cache")?;
    if kn.len() != n * d.nkv * d.hd
        || vn.len() != kn.len()
        || vc0.len() != kc0.len()
        || pos0 + n > ctx
        || d.hd > 512
        || q_norm.len() != d.hd
        || k_norm.len() != d.hd
    {
        return Err(CudaError::Invalid("attn_qk_prep: sizes".into()));
    }
    let (qgd, knd, vnd) = (upload(gpu, qg)?, upload(gpu, kn)?, upload(gpu, vn)?);
    let (qnd, knd2) = (upload(gpu, q_norm)?, upload(gpu, k_norm)?);
    let (kc, vc) = (KvDev::upload(gpu, kc0, kv)?, KvDev::upload(gpu, vc0, kv)?);
    let (kca, vca) = (kc.address(gpu), vc.address(gpu));
    let pos = upload(gpu, &[i32_arg(pos0, "pos")?])?;
    let mut q = alloc_poisoned::<f32>(gpu, n * d.heads * d.hd)?;
    let mut gate = alloc_poisoned::<f32>(gpu, n * d.heads * d.hd)?;
    let (hi, nkvi, hdi, rdi) = (
        i32_arg(d.heads, "heads")?,
        i32_arg(d.nkv, "nkv")?,
        i32_arg(d.hd, "hd")?,
        i32_arg(d.rope_dims, "rope dims")?,
    );
    // The table of every cache position, as the model keeps it.
    let half = d.rope_dims / 2;
    let cs = if table && half > 0 {
        let mut cs = alloc_poisoned::<f32>(gpu, 2 * ctx * half)?;
        let ci = i32_arg(ctx, "positions")?;
        launch!(
            gpu,
            gpu.func("rope_table")?,
            "rope_table",
            cfg((ctx as u32, half.div_ceil(32) as u32, 1), 32, 0),
            [&mut cs, &ci, &rdi, &d.theta]
        )?;
        Some(cs)
    } else {
        None
    };
    let cs_ptr = cs.as_ref().map_or(0u64, |c| device_address(gpu, c));
    let name = kv_kernel("attn_qk_prep", kv)?;
    launch!(
        gpu,
        gpu.func(&name)?,
        &name,
        cfg(((d.heads + d.nkv) as u32, n as u32, 1), 128, 0),
        [
            &qgd, &knd, &vnd, &mut q, &mut gate, &kca, &vca, &qnd, &knd2, &pos, &hi, &nkvi, &hdi,
            &rdi, &d.theta, &d.eps, &cs_ptr
        ]
    )?;
    Ok((
        download(gpu, &q)?,
        download(gpu, &gate)?,
        kc.download(gpu)?,
        vc.download(gpu)?,
    ))
}

/// Causal attention of `n` query tokens at positions `pos0..` (`q [n][heads][hd]`) over caches
/// `[ctx][nkv][hd]` that hold positions `0..pos0 + n`, on the device as `kv` (rounded to it).
#[allow(clippy::too_many_arguments)]
pub fn attn_causal(
    gpu: &Gpu,
    q: &[f32],
    kc: &[f32],
    vc: &[f32],
    pos0: usize,
    heads: usize,
    nkv: usize,
    hd: usize,
    scale: f32,
    kind: AttnKind,
    kv: KvType,
) -> Result<Vec<f32>, CudaError> {
    let n = check_rows(q.len(), heads * hd, "attn_causal q")?;
    if (kind == AttnKind::Prompt && !attn_prompt_fits(heads, nkv, hd))
        || (kind == AttnKind::PromptMma && attn_prompt_mma(heads, nkv, hd).is_none())
    {
        return Err(CudaError::Invalid("attn_prompt: sizes".into()));
    }
    let ctx = check_rows(kc.len(), nkv * hd, "attn_causal cache")?;
    if vc.len() != kc.len()
        || pos0 + n > ctx
        || !hd.is_multiple_of(32)
        || hd > 512
        || !heads.is_multiple_of(nkv)
    {
        return Err(CudaError::Invalid("attn_causal: sizes".into()));
    }
    let qd = upload(gpu, q)?;
    let (kcd, vcd) = (KvDev::upload(gpu, kc, kv)?, KvDev::upload(gpu, vc, kv)?);
    let (kd, vd) = (kcd.address(gpu), vcd.address(gpu));
    let pos = upload(gpu, &[i32_arg(pos0, "pos")?])?;
    let mut o = alloc_poisoned::<f32>(gpu, q.len())?;
    let (nkvi, hdi) = (i32_arg(nkv, "nkv")?, i32_arg(hd, "hd")?);
    let (ntok, headsi) = (i32_arg(n, "tokens")?, i32_arg(heads, "heads")?);
    if kind == AttnKind::PromptMma {
        let (name, grid, block, shared) =
            attn_prompt_mma(heads, nkv, hd).map_or(Default::default(), |f| f(n));
        let name = kv_kernel(name, kv)?;
        launch!(
            gpu,
            gpu.func(&name)?,
            &name,
            cfg(grid, block, shared),
            [&qd, &kd, &vd, &0u64, &mut o, &pos, &ntok, &headsi, &nkvi, &scale]
        )?;
    } else if kind == AttnKind::Prompt {
        let (grid, block, shared) = attn_prompt_launch(n, heads, nkv, hd);
        let name = kv_kernel("attn_prompt", kv)?;
        launch!(
            gpu,
            gpu.func(&name)?,
            &name,
            cfg(grid, block, shared),
            [&qd, &kd, &vd, &0u64, &mut o, &pos, &ntok, &headsi, &nkvi, &hdi, &scale]
        )?;
    } else {
        let name = kv_kernel("attn_causal", kv)?;
        launch!(
            gpu,
            gpu.func(&name)?,
            &name,
            cfg((heads as u32, n as u32, 1), 128, 0),
            [&qd, &kd, &vd, &0u64, &mut o, &pos, &nkvi, &hdi, &scale]
        )?;
    }
    download(gpu, &o)
}

/// Which causal attention kernel [`attn_causal`] runs: one block per head and token, a GQA group
/// per block (`attn_prompt`), or that on the tensor cores (`attn_prompt_mma_<hd>`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnKind {
    Causal,
    Prompt,
    PromptMma,
}

/// `attn_prompt_mma_<hd>` for these heads (head_dim 64, 128 or 256; `heads / nkv` dividing 32):
/// its name and its launch for `n` tokens `(grid, block, dynamic shared bytes)`, or `None`.
#[allow(clippy::type_complexity)]
pub fn attn_prompt_mma(
    heads: usize,
    nkv: usize,
    hd: usize,
) -> Option<impl Fn(usize) -> (&'static str, (u32, u32, u32), u32, u32)> {
    let name = match hd {
        64 => "attn_prompt_mma_64",
        128 => "attn_prompt_mma_128",
        256 => "attn_prompt_mma_256",
        _ => return None,
    };
    if !attn_prompt_fits(heads, nkv, hd) {
        return None;
    }
    let per_block = 32 / (heads / nkv);
    // Q [32][hd + 8], K [16][hd + 8], Vᵀ [hd][16 + 8] in f16.
    let shared = (2 * (32 * (hd + 8) + 16 * (hd + 8) + hd * 24)) as u32;
    Some(move |n: usize| {
        (
            name,
            (nkv as u32, n.div_ceil(per_block) as u32, 1),
            64,
            shared,
        )
    })
}

/// Whether `attn_prompt` takes these heads: `heads / nkv` query heads per KV head dividing 32,
/// head_dim a multiple of 32 up to 256.
pub fn attn_prompt_fits(heads: usize, nkv: usize, hd: usize) -> bool {
    nkv > 0
        && heads.is_multiple_of(nkv)
        && (32usize).is_multiple_of(heads / nkv)
        && hd.is_multiple_of(32)
        && hd <= 256
}

/// `attn_prompt`'s launch for `n` tokens: `(grid, block, dynamic shared bytes)`.
pub fn attn_prompt_launch(
    n: usize,
    heads: usize,
    nkv: usize,
    hd: usize,
) -> ((u32, u32, u32), u32, u32) {
    let per_block = 32 / (heads / nkv);
    (
        (nkv as u32, n.div_ceil(per_block) as u32, 1),
        256,
        (2 * 16 * hd * 4) as u32,
    )
}

/// Whether `attn_split_gqa` (warps over positions, every query head of a KV head per warp) takes
/// this attention shape: heads / nkv in {1, 2, 4, 8} and hd / 32 in {2, 4, 8}.
pub fn attn_split_gqa_fits(heads: usize, nkv: usize, hd: usize) -> bool {
    nkv > 0
        && heads.is_multiple_of(nkv)
        && matches!(heads / nkv, 1 | 2 | 4 | 8)
        && hd.is_multiple_of(32)
        && matches!(hd / 32, 2 | 4 | 8)
}

/// The `attn_split_gqa` kernel with `p` positions per warp step (2 or 4).
pub fn attn_split_gqa_kernel(p: usize) -> &'static str {
    if p >= 4 {
        "attn_split_gqa4"
    } else {
        "attn_split_gqa"
    }
}

/// Blocks a KV head's query heads take in the split kernel `name` (with or without its `_h`): 2
/// for `attn_split_gqa8xh3` (half the heads a block, so grid.x is twice the KV heads
/// and a block half the warps), else 1.
pub fn attn_split_head_blocks(name: &str) -> usize {
    match name.trim_end_matches("_h") {
        "attn_split_gqa8xh3" => 2,
        _ => 1,
    }
}

/// A split kernel's blocks across and threads a block, `(grid.x, block)`, for `heads` query heads
/// over `nkv` KV heads when a KV head's heads take `head_blocks` blocks: one warp a query head.
pub fn attn_split_block(heads: usize, nkv: usize, head_blocks: usize) -> (u32, u32) {
    let nkv = nkv.max(1);
    (
        (head_blocks * nkv) as u32,
        (32 * (heads / nkv) / head_blocks.max(1)) as u32,
    )
}

/// Chunks of a split kernel's one-wave grid: `per_sm` blocks an SM (its occupancy) on `sms` SMs
/// over `nkv` KV heads of `head_blocks` blocks each.
pub fn attn_one_wave_splits(per_sm: usize, sms: usize, nkv: usize, head_blocks: usize) -> usize {
    (per_sm.max(1) * sms / (nkv * head_blocks).max(1)).max(1)
}

/// The launch of split kernel `f` (named `name`) for `heads` query heads over `nkv` KV heads on
/// `sms` SMs, as the model runs it: `(grid.x, block threads, chunks)`, the chunks filling one wave
/// of the blocks an SM holds (its occupancy).
pub fn attn_split_wave(
    f: &cudarc::driver::CudaFunction,
    name: &str,
    heads: usize,
    nkv: usize,
    sms: usize,
) -> Result<(u32, u32, usize), CudaError> {
    let hb = attn_split_head_blocks(name);
    let (gx, threads) = attn_split_block(heads, nkv, hb);
    let per_sm = f
        .occupancy_max_active_blocks_per_multiprocessor(threads, 0, None)
        .map_err(|e| CudaError::driver("occupancy", e))?;
    Ok((
        gx,
        threads,
        attn_one_wave_splits(per_sm as usize, sms, nkv, hb),
    ))
}

/// Whether the split kernel `name` takes this shape: `attn_split_gqa8xh3` only head_dim 256
/// with 8 query heads a KV head; `attn_split_mma` head_dim 64, 128 or 256 with at most 8;
/// the others what [`attn_split_gqa_fits`] allows.
pub fn attn_split_takes(name: &str, heads: usize, nkv: usize, hd: usize) -> bool {
    if name.starts_with("attn_split_mma") {
        // The tensor-core forms: head_dim 64, 128 or 256, at most 8 query heads a KV head.
        return matches!(hd, 64 | 128 | 256)
            && nkv > 0
            && heads.is_multiple_of(nkv)
            && heads <= 8 * nkv;
    }
    attn_split_head_blocks(name) == 1 || (hd == 256 && nkv > 0 && heads == 8 * nkv)
}

/// Decode attention of `rows` tokens (q is `[rows][heads][hd]`), row t at `pos0 + t`, split over
/// the cache by the kernel `split` (`attn_split`, or where the shape fits [`attn_split_gqa_fits`]
/// `attn_split_gqa`, `attn_split_gqa4` or `attn_split_gqa4x`) into `splits` chunks, then
/// `attn_merge`, with the output gate when `gate` is given: `[rows][heads][hd]`. The caches are of
/// type `kv` on the device (the split kernel's `_h` form for f16; `kc`, `vc` rounded to it).
#[allow(clippy::too_many_arguments)]
pub fn attn_split_merge_with(
    gpu: &Gpu,
    split: &str,
    kv: KvType,
    q: &[f32],
    kc: &[f32],
    vc: &[f32],
    gate: Option<&[f32]>,
    pos0: usize,
    (heads, nkv, hd): (usize, usize, usize),
    scale: f32,
    (splits, min_chunk): (usize, usize),
) -> Result<Vec<f32>, CudaError> {
    let ctx = check_rows(kc.len(), nkv * hd, "attn_split cache")?;
    let rows = check_rows(q.len(), heads * hd, "attn_split q")?;
    if rows == 0
        || vc.len() != kc.len()
        || pos0 + rows > ctx
        || !hd.is_multiple_of(32)
        || hd > 512
        || !heads.is_multiple_of(nkv)
        || heads / nkv > 32
        || !(1..=512).contains(&splits)
        || gate.is_some_and(|g| g.len() != q.len())
    {
        return Err(CudaError::Invalid("attn_split: sizes".into()));
    }
    let qd = upload(gpu, q)?;
    let (kcd, vcd) = (KvDev::upload(gpu, kc, kv)?, KvDev::upload(gpu, vc, kv)?);
    let (kd, vd) = (kcd.address(gpu), vcd.address(gpu));
    let gd = upload(gpu, gate.unwrap_or(&[0.0]))?;
    let gate_ptr = if gate.is_some() {
        device_address(gpu, &gd)
    } else {
        0u64
    };
    let pos = upload(gpu, &[i32_arg(pos0, "pos")?])?;
    let mut part = alloc_poisoned::<f32>(gpu, rows * heads * splits * (hd + 2))?;
    let mut o = alloc_poisoned::<f32>(gpu, q.len())?;
    let (hi, nkvi, hdi) = (
        i32_arg(heads, "heads")?,
        i32_arg(nkv, "nkv")?,
        i32_arg(hd, "hd")?,
    );
    let (si, mci) = (i32_arg(splits, "splits")?, i32_arg(min_chunk, "min chunk")?);
    if split != "attn_split"
        && !(attn_split_gqa_fits(heads, nkv, hd) && attn_split_takes(split, heads, nkv, hd))
    {
        return Err(CudaError::Invalid(format!("{split}: shape")));
    }
    let kernel = kv_kernel(split, kv)?;
    let (gx, block) = attn_split_block(heads, nkv, attn_split_head_blocks(split));
    launch!(
        gpu,
        gpu.func(&kernel)?,
        &kernel,
        cfg((gx, splits as u32, rows as u32), block, 0),
        [&qd, &kd, &vd, &mut part, &pos, &hi, &nkvi, &hdi, &scale, &mci]
    )?;
    launch!(
        gpu,
        gpu.func("attn_merge")?,
        "attn_merge",
        cfg((heads as u32, hd.div_ceil(32) as u32, rows as u32), 256, 0),
        [&part, &gate_ptr, &mut o, &pos, &si, &hdi, &mci]
    )?;
    download(gpu, &o)
}
