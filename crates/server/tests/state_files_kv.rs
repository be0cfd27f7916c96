//! State files with every KV element type: a state saved with f16 / q8_0 caches loads back
//! bit-identical (and continues exactly), stores its caches in that type, and a server running
//! another KV type refuses the file.

use std::path::PathBuf;

use redlite_model::state::LayerState;
use redlite_model::{KvType, Mode, Model, SequenceState};
use redlite_server::persist::{decode, encode, Identity, StateFileError};

fn tiny() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/reference/models/tiny-Q8_0.gguf"
    ))
}

/// Every byte of a state: KV rows in their stored type, recurrent states as f32 bits.
fn state_bytes(s: &SequenceState) -> Vec<u8> {
    let mut out = (s.pos as u64).to_le_bytes().to_vec();
    for l in &s.layers {
        match l {
            LayerState::Attention(kv) => {
                out.push(kv.kv_type().code());
                out.extend(kv.keys().to_le_bytes());
                out.extend(kv.values().to_le_bytes());
            }
            LayerState::DeltaNet(d) => {
                out.extend(d.conv.iter().chain(&d.s).flat_map(|x| x.to_le_bytes()));
            }
        }
    }
    out
}

#[test]
fn state_files_keep_and_check_the_kv_type() {
    let mut model = Model::load(tiny()).unwrap();
    let ids: Vec<u32> = (0..64).map(|i| 50 + 13 * i).collect();
    let mut sizes = Vec::new();
    for kv_type in KvType::ALL {
        model.set_kv_type(kv_type).unwrap();
        let id = Identity::of(&model);
        assert_eq!(id.kv_type, kv_type.name());
        let mut state = model.new_state();
        model.forward(&mut state, &ids, Mode::Prefill).unwrap();
        let bytes = encode(&id, &ids, &state);
        sizes.push(bytes.len());

        let (got_ids, mut loaded) = decode(&bytes, &id, &model.new_state()).unwrap();
        assert_eq!(got_ids, ids);
        assert!(
            state_bytes(&loaded) == state_bytes(&state),
            "{kv_type}: state differs"
        );
        let next = model.forward(&mut state, &[7], Mode::Step).unwrap();
        let resumed = model.forward(&mut loaded, &[7], Mode::Step).unwrap();
        assert!(next == resumed, "{kv_type}: resumed logits differ");

        // A server with any other KV type refuses the file before reading the payload.
        for other in KvType::ALL.into_iter().filter(|t| *t != kv_type) {
            model.set_kv_type(other).unwrap();
            let e = decode(&bytes, &Identity::of(&model), &model.new_state()).unwrap_err();
            assert!(
                matches!(
                    e,
                    StateFileError::Mismatch {
                        what: "KV element type",
                        ..
                    }
                ),
                "{kv_type} file, {other} server: {e}"
            );
            assert!(e.to_string().contains(kv_type.name()), "{e}");
        }
    }
    // The KV part of the payload shrinks with the type: 64 positions × 1 attention layer ×
    // 2 (K, V) × 128 values = 16384 values at 4, 2 and 34/32 bytes (the header's type name is
    // one byte longer for q8_0).
    assert_eq!(sizes[0] - sizes[1], 16384 * 2);
    assert_eq!(sizes[0] + 1 - sizes[2], 16384 * 4 - 16384 / 32 * 34);
}
