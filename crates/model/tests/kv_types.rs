//! KV cache element types (f32 | f16 | q8_0) on the oracle.
//!
//! * Attention over an f16 / Q8_0 cache stays within an error bound derived from the formats'
//!   precision (worked out in [`bound`]), checked on random caches against the same attention
//!   over the exact f32 keys and values.
//! * Speculative rollback (`begin_trace` / `keep`), snapshot / restore and truncation give, for
//!   every type, bit-for-bit the logits and caches of a run that never drafted.
//! * The default stays f32 (the exact-logit tests in `oracle_logits.rs` cover its values).

use std::path::PathBuf;

use redlite_model::backend::attention_two_pass;
use redlite_model::kv_type::Q8_0_BLOCK;
use redlite_model::state::{KvCache, LayerState, MtpState};
use redlite_model::{KvType, Mode, Model, SequenceState};

fn reference() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/reference"
    ))
}

/// Deterministic values in [−0.5, 0.5).
fn lcg(seed: u64) -> impl FnMut() -> f32 {
    let mut s = seed;
    move || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
    }
}

/// Unit roundoff of f16 (10 stored mantissa bits): rounding to nearest changes a value by at
/// most `|x|·2⁻¹¹`.
const F16_U: f32 = 1.0 / 2048.0;

/// The largest error one stored element of `kv_type` can have, for element `x` whose 32-value
/// Q8_0 block has maximum magnitude `amax`:
/// * f16: `|x|·u`.
/// * Q8_0: `x/d` (with `d = amax/127`) is rounded to an integer `q` (error ≤ `d/2`) and `d` is
///   stored in f16 (error ≤ `d·u`), so `|x − f16(d)·q| ≤ d/2 + |q|·d·u ≤ amax·(1/254 + u)`
///   (|q| ≤ 127); a second `u` covers the f32 roundings of `x/d` and `f16(d)·q`.
fn element_error(kv_type: KvType, x: f32, amax: f32) -> f32 {
    match kv_type {
        KvType::F32 => 0.0,
        KvType::F16 => x.abs() * F16_U,
        KvType::Q8_0 => amax * (1.0 / 254.0 + 2.0 * F16_U),
    }
}

/// Bound on `max_i |o_i − õ_i|` for one query head, where `o` is attention over exact keys and
/// values and `õ` over stored ones (f32 arithmetic otherwise):
/// * each score changes by at most `ε_j = scale · Σ_i |q_i|·err(k_ji)`; with every score moved by
///   at most `ε = max_j ε_j`, each softmax weight moves by a factor within `e^{±2ε}`, so
///   `Σ_j |p_j − p̃_j| ≤ e^{2ε} − 1`;
/// * `o − õ = Σ_j (p_j − p̃_j)·v_j + Σ_j p̃_j·(v_j − ṽ_j)`, bounded by
///   `(e^{2ε} − 1)·max|v| + max err(v)`;
/// * plus f32 rounding of the sums (`1e-5` relative, as the f32 online/two-pass comparison).
fn bound(kv_type: KvType, q: &[f32], keys: &[Vec<f32>], values: &[Vec<f32>], scale: f32) -> f32 {
    let errs = |row: &[f32]| -> Vec<f32> {
        row.chunks(Q8_0_BLOCK)
            .flat_map(|b| {
                let amax = b.iter().fold(0f32, |m, x| m.max(x.abs()));
                b.iter().map(move |&x| element_error(kv_type, x, amax))
            })
            .collect()
    };
    let eps = keys
        .iter()
        .map(|k| scale * q.iter().zip(errs(k)).map(|(a, e)| a.abs() * e).sum::<f32>())
        .fold(0f32, f32::max);
    let vmax = values.iter().flatten().fold(0f32, |m, x| m.max(x.abs()));
    let verr = values.iter().flat_map(|v| errs(v)).fold(0f32, f32::max);
    ((2.0 * eps).exp() - 1.0) * vmax + verr + 1e-5 * vmax
}

#[test]
fn attention_over_f16_and_q8_0_stays_within_the_format_bound() {
    let (n_heads, kv_heads, hd, n) = (4, 2, 64, 200);
    let scale = 1.0 / (hd as f32).sqrt();
    for kv_type in [KvType::F16, KvType::Q8_0] {
        let mut next = lcg(7);
        let mut exact = KvCache::new(kv_heads * hd);
        let mut stored = KvCache::with_type(kv_heads * hd, kv_type);
        let (mut keys, mut values) = (Vec::new(), Vec::new());
        for _ in 0..n {
            // Keys of RMS-normed size (|k| ~ √hd) with some larger outliers, values ~ ±1.
            let k: Vec<f32> = (0..kv_heads * hd)
                .map(|i| 3.0 * next() * if i % 17 == 0 { 4.0 } else { 1.0 })
                .collect();
            let v: Vec<f32> = (0..kv_heads * hd).map(|_| 2.0 * next()).collect();
            exact.push(&k, &v);
            stored.push(&k, &v);
            keys.push(k);
            values.push(v);
        }
        let q: Vec<f32> = (0..n_heads * hd).map(|_| 3.0 * next()).collect();
        let want = attention_two_pass(&q, &exact, n_heads, hd, scale);
        let got = attention_two_pass(&q, &stored, n_heads, hd, scale);
        let group = n_heads / kv_heads;
        for h in 0..n_heads {
            let g = h / group;
            let head = |rows: &[Vec<f32>]| -> Vec<Vec<f32>> {
                rows.iter()
                    .map(|r| r[g * hd..(g + 1) * hd].to_vec())
                    .collect()
            };
            let b = bound(
                kv_type,
                &q[h * hd..(h + 1) * hd],
                &head(&keys),
                &head(&values),
                scale,
            );
            let err = want[h * hd..(h + 1) * hd]
                .iter()
                .zip(&got[h * hd..(h + 1) * hd])
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(err <= b, "{kv_type} head {h}: error {err} > bound {b}");
            assert!(err > 0.0, "{kv_type}: the cache should not be exact");
        }
    }
}

/// The caches of every attention layer, for comparing states.
fn caches(s: &SequenceState) -> Vec<KvCache> {
    s.layers
        .iter()
        .filter_map(|l| match l {
            LayerState::Attention(kv) => Some(kv.clone()),
            LayerState::DeltaNet(_) => None,
        })
        .collect()
}

#[test]
fn rollback_snapshot_and_truncate_are_exact_for_every_kv_type() {
    let mut model = Model::load(reference().join("models/tiny-Q8_0.gguf")).unwrap();
    assert_eq!(model.kv_type(), KvType::F32, "f32 is the default");
    let prompt: Vec<u32> = (0..20).map(|i| 100 + 37 * i).collect();
    let accepted = [11u32, 12, 13];
    let rejected = [900u32, 901, 902, 903];
    let after = [14u32, 15, 16];
    for kv_type in KvType::ALL {
        model.set_kv_type(kv_type).unwrap();
        // The run that never drafted: prompt, the accepted tokens, then the continuation.
        let mut plain = model.new_state();
        model.forward(&mut plain, &prompt, Mode::Prefill).unwrap();
        model.forward(&mut plain, &accepted, Mode::Step).unwrap();
        let want = model.forward(&mut plain, &after, Mode::Step).unwrap();

        // Drafted: accepted + rejected tokens verified in one stepped pass, keep the accepted.
        let mut spec = model.new_state();
        model.forward(&mut spec, &prompt, Mode::Prefill).unwrap();
        let snap = spec.snapshot();
        spec.begin_trace();
        let drafted: Vec<u32> = accepted.iter().chain(&rejected).copied().collect();
        model.forward(&mut spec, &drafted, Mode::Step).unwrap();
        spec.keep(accepted.len()).unwrap();
        let got = model.forward(&mut spec, &after, Mode::Step).unwrap();
        assert!(got == want, "{kv_type}: rollback changed the logits");
        assert!(
            caches(&spec) == caches(&plain),
            "{kv_type}: rollback changed the KV caches"
        );

        // Snapshot / restore to the end of the prompt, then the same tokens again.
        spec.restore(&snap).unwrap();
        model.forward(&mut spec, &accepted, Mode::Step).unwrap();
        let again = model.forward(&mut spec, &after, Mode::Step).unwrap();
        assert!(again == want, "{kv_type}: restore changed the logits");

        // Truncate to the current position is a no-op; to 0 is a fresh state.
        let pos = spec.pos;
        spec.truncate(pos).unwrap();
        assert!(caches(&spec) == caches(&plain));
        spec.truncate(0).unwrap();
        assert!(caches(&spec) == caches(&model.new_state()));
        assert!(caches(&spec).iter().all(|kv| kv.kv_type() == kv_type));
    }
}

#[test]
fn q8_0_needs_whole_blocks_per_head() {
    assert!(KvType::Q8_0.check_head_dim(64).is_ok());
    assert!(KvType::Q8_0.check_head_dim(256).is_ok());
    let e = KvType::Q8_0.check_head_dim(48).unwrap_err().to_string();
    assert!(e.contains("multiple of 32"), "{e}");
    assert!(KvType::F16.check_head_dim(48).is_ok());
}

/// `KvCache::drop_front` keeps the newest rows as they were (every type), and an MTP state that
/// keeps its last slots counts the dropped ones: positions stay absolute, truncation is by slot.
#[test]
fn dropping_old_rows_keeps_the_new_ones_and_the_slot_count() {
    let width = 64;
    let mut next = lcg(7);
    let rows: Vec<(Vec<f32>, Vec<f32>)> = (0..10)
        .map(|_| {
            let k = (0..width).map(|_| next()).collect();
            let v = (0..width).map(|_| next()).collect();
            (k, v)
        })
        .collect();
    for kv_type in KvType::ALL {
        let mut full = KvCache::with_type(width, kv_type);
        for (k, v) in &rows {
            full.push(k, v);
        }
        let mut cut = full.clone();
        cut.drop_front(6);
        assert_eq!(cut.len(), 4, "{kv_type}");
        for j in 0..4 {
            assert_eq!(cut.key(j), full.key(6 + j), "{kv_type}: key {j}");
            assert_eq!(cut.value(j), full.value(6 + j), "{kv_type}: value {j}");
        }
    }
    let mut full = KvCache::new(width);
    for (k, v) in &rows {
        full.push(k, v);
    }
    let mut mtp = MtpState {
        kv: full.clone(),
        base: 0,
    };
    mtp.keep_last(20);
    assert_eq!((mtp.slots(), mtp.kv.len(), mtp.base), (10, 10, 0));
    mtp.keep_last(3);
    assert_eq!((mtp.slots(), mtp.kv.len(), mtp.base), (10, 3, 7));
    assert_eq!(mtp.kv.key(0), full.key(7));
    mtp.truncate(9);
    assert_eq!((mtp.slots(), mtp.kv.len()), (9, 2));
    mtp.truncate(2);
    assert_eq!(
        (mtp.slots(), mtp.kv.len()),
        (7, 0),
        "dropped slots do not come back"
    );
}
