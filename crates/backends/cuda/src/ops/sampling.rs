//! The draw (`sampling.cu`): the argmax and on-device top-k sampling.

use super::*;

/// Index of the largest value of each row of `n` (lowest index on ties), each row cut into
/// `slices` blocks (1 or more).
pub fn argmax(gpu: &Gpu, x: &[f32], n: usize, slices: usize) -> Result<Vec<i32>, CudaError> {
    let rows = check_rows(x.len(), n, "argmax")?;
    let xd = upload(gpu, x)?;
    let mut out = alloc_poisoned::<i32>(gpu, rows)?;
    let mut part = alloc_poisoned::<f32>(gpu, 2 * slices * rows)?;
    let mut counter = upload(gpu, &vec![0u32; rows])?;
    let ni = i32_arg(n, "n")?;
    launch!(
        gpu,
        gpu.func("argmax")?,
        "argmax",
        cfg((slices as u32, rows as u32, 1), 256, 0),
        [&xd, &ni, &mut out, &mut part, &mut counter]
    )?;
    download(gpu, &out)
}

/// On-device sampling of each row of `vocab` logits with the draw `u[row]`.
#[allow(clippy::too_many_arguments)]
pub fn sample_topk(
    gpu: &Gpu,
    logits: &[f32],
    vocab: usize,
    k: usize,
    temperature: f32,
    top_p: f32,
    min_p: f32,
    u: &[f32],
) -> Result<Vec<i32>, CudaError> {
    let rows = check_rows(logits.len(), vocab, "sample_topk")?;
    if k == 0
        || k > 64
        || k > vocab
        || u.len() != rows
        || temperature.is_nan()
        || temperature <= 0.0
    {
        return Err(CudaError::Invalid(
            "sample_topk: k, draws or temperature".into(),
        ));
    }
    let (ld, ud) = (upload(gpu, logits)?, upload(gpu, u)?);
    let mut out = alloc_poisoned::<i32>(gpu, rows)?;
    let (vi, ki, inv_t) = (
        i32_arg(vocab, "vocab")?,
        i32_arg(k, "k")?,
        1.0 / temperature,
    );
    launch!(
        gpu,
        gpu.func("sample_topk")?,
        "sample_topk",
        cfg((rows as u32, 1, 1), 1024, 0),
        [&ld, &vi, &ki, &inv_t, &top_p, &min_p, &ud, &mut out]
    )?;
    download(gpu, &out)
}
