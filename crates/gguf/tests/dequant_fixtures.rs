//! Bit-exactness of the scalar dequantizers against the per-type block fixtures in
//! `shared/reference/quant/` (ggml's `to_float`, checked identical to gguf-py 0.19.0).
//! Values are compared as raw f32 bits, so NaN payloads and the sign of zero count.

mod common;

use common::{read, reference};
use redlite_gguf::quant::{dequantize, dequantize_to_vec, DequantError, GgmlType};

#[test]
fn every_fixture_type_is_bit_exact() {
    let dir = reference("quant");
    let index: serde_json::Value =
        serde_json::from_slice(&read(&dir.join("index.json"))).expect("index.json parses");
    let types = index["types"]
        .as_object()
        .expect("index.json has a types object");
    assert!(
        types.len() >= 19,
        "expected every type in index.json, got {}",
        types.len()
    );

    let mut failures = Vec::new();
    for (name, entry) in types {
        let ty = GgmlType::from_name(name).unwrap_or_else(|| panic!("unknown type {name}"));
        assert_eq!(
            entry["ggml_type_id"].as_u64(),
            Some(u64::from(ty.id())),
            "{name}"
        );
        assert_eq!(
            entry["block_bytes"].as_u64(),
            Some(ty.block_bytes() as u64),
            "{name}"
        );
        assert_eq!(
            entry["block_elems"].as_u64(),
            Some(ty.block_elems() as u64),
            "{name}"
        );

        let blocks = read(&dir.join(entry["blocks_file"].as_str().unwrap()));
        let expected = read(&dir.join(entry["f32_file"].as_str().unwrap()));
        let n_blocks = entry["n_blocks"].as_u64().unwrap() as usize;
        assert_eq!(
            blocks.len(),
            n_blocks * ty.block_bytes(),
            "{name} blocks size"
        );
        assert_eq!(
            expected.len(),
            n_blocks * ty.block_elems() * 4,
            "{name} f32 size"
        );

        let got = dequantize_to_vec(ty, &blocks).unwrap();
        let labels = entry["block_labels"].as_array();
        let mut mismatches = 0;
        for (i, (g, e)) in got.iter().zip(expected.chunks_exact(4)).enumerate() {
            let e = u32::from_le_bytes(e.try_into().unwrap());
            if g.to_bits() != e {
                if mismatches < 5 {
                    let block = i / ty.block_elems();
                    let label = labels
                        .and_then(|l| l.get(block.min(l.len().saturating_sub(1))))
                        .and_then(|l| l.as_str())
                        .unwrap_or("?");
                    eprintln!(
                        "{name}: element {i} (block {block}, {label}): got {g:e} ({:#010x}), \
                         expected {:e} ({e:#010x})",
                        g.to_bits(),
                        f32::from_bits(e)
                    );
                }
                mismatches += 1;
            }
        }
        if mismatches > 0 {
            failures.push(format!(
                "{name}: {mismatches} of {} values differ",
                got.len()
            ));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn block_functions_agree_with_dequantize() {
    // The public block functions are what faster kernels are tested against: check one directly.
    let dir = reference("quant");
    let blocks = read(&dir.join("Q4_K.blocks"));
    let all = dequantize_to_vec(GgmlType::Q4K, &blocks).unwrap();
    let mut one = [0.0f32; 256];
    redlite_gguf::quant::dequantize_block_q4_k(blocks[..144].try_into().unwrap(), &mut one);
    assert_eq!(
        one.map(f32::to_bits)[..],
        all[..256].iter().map(|v| v.to_bits()).collect::<Vec<_>>()[..]
    );
}

#[test]
fn wrong_lengths_are_typed_errors() {
    let mut out = vec![0.0f32; 256];
    // One byte short of a block.
    let err = dequantize(GgmlType::IQ2XXS, &[0u8; 65], &mut out).unwrap_err();
    assert!(
        matches!(
            err,
            DequantError::PartialBlock {
                len: 65,
                block_bytes: 66,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("IQ2_XXS"), "{err}");
    // Whole blocks but the output is too long.
    let err = dequantize(GgmlType::Q8_0, &[0u8; 34 * 4], &mut out).unwrap_err();
    assert!(
        matches!(
            err,
            DequantError::OutputLength {
                blocks: 4,
                expected: 128,
                got: 256,
                ..
            }
        ),
        "{err:?}"
    );
    // And too short.
    assert!(dequantize(GgmlType::F32, &[0u8; 8], &mut out[..1]).is_err());
    assert!(dequantize_to_vec(GgmlType::BF16, &[0u8; 5]).is_err());
}
