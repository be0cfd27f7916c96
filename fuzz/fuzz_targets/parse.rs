//! Fuzz target: the GGUF parser must never panic, hang or over-allocate on any input. Every file
//! it accepts must be fully usable (all accessors, every tensor's data) and survive a writer round
//! trip: writing it back and re-reading it succeeds and writing again gives the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use redlite_gguf::{GgufFile, GgufWriter};

fuzz_target!(|data: &[u8]| {
    let Ok(f) = GgufFile::from_bytes(data) else {
        return;
    };
    let _ = format!("{f:?}");
    for (k, v) in f.metadata() {
        assert!(f.get(k).is_some());
        let _ = v.to_string();
        let _ = v.type_name();
        let _ = f.get_u32(k);
        let _ = f.get_i64(k);
        let _ = f.get_f32(k);
        let _ = f.get_str(k);
        let _ = f.get_bool(k);
        let _ = f.get_str_array(k);
        let _ = f.get_i32_array(k);
        let _ = f.get_u32_array(k);
        let _ = f.get_f32_array(k);
        let _ = f.get_bool_array(k);
        let _ = f.get_opt_u32(k).map_err(|e| e.to_string());
    }
    let _ = f.architecture();
    for t in f.tensors() {
        assert_eq!(f.tensor_data(t).len() as u64, t.n_bytes);
        assert!(f.tensor(&t.name).is_some());
        let _ = (t.n_rows(), t.row_bytes());
    }

    // Round trip (skipped for huge alignments, whose padding alone could be gigabytes).
    if f.alignment() > 1 << 16 {
        return;
    }
    let w = GgufWriter::from_file(&f).expect("an accepted file is writable");
    let bytes = w.to_bytes().expect("write to memory");
    let g = GgufFile::from_bytes(bytes.as_slice()).expect("written file parses");
    assert_eq!(g.metadata().len(), f.metadata().len());
    assert_eq!(g.tensors().len(), f.tensors().len());
    let again = GgufWriter::from_file(&g).unwrap().to_bytes().unwrap();
    assert!(again == bytes, "second write differs");
});
