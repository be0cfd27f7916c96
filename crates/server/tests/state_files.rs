//! `--state-dir`: prefix states persist across restarts, resume bit-identically, and anything
//! corrupt, partial or made for another model is refused and never loaded.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use redlite_model::Model;
use redlite_server::persist::{read_file, Identity, StateFileError};
use serde_json::{json, Value};

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("redlite-state-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn state_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().and_then(|e| e.to_str()) == Some("rls"))
        .collect();
    v.sort();
    v
}

fn conversation() -> (Value, Value) {
    let user = heldout(1500);
    let t1 = json!({"messages": [{"role": "user", "content": user}],
                    "max_tokens": 8, "temperature": 0, "return_token_ids": true});
    let t2 = |reply: &str| {
        json!({"messages": [{"role": "user", "content": user},
                            {"role": "assistant", "content": reply},
                            {"role": "user", "content": "And then?"}],
               "max_tokens": 8, "temperature": 0, "return_token_ids": true})
    };
    (t1, t2("REPLY"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn state_survives_restart_and_bad_files_are_refused() {
    let dir = temp_dir("restart");
    let c = client();
    let (t1, mut t2) = conversation();

    // Server 1 answers turn 1 and writes its state.
    let mut opts = options();
    opts.state_dir = Some(dir.clone());
    let (s1, base) = start(opts.clone()).await;
    let (status, r1) = post(&c, &format!("{base}/v1/chat/completions"), &t1).await;
    assert_eq!(status, 200, "{r1}");
    s1.shutdown().await;
    let files = state_files(&dir);
    assert_eq!(files.len(), 1, "{files:?}");
    let reply = r1["choices"][0]["message"]["content"].as_str().unwrap();
    t2["messages"][1]["content"] = json!(reply);

    // Server 2 (a restart) resumes turn 2 from the file.
    let (s2, base) = start(opts.clone()).await;
    let (status, r2) = post(&c, &format!("{base}/v1/chat/completions"), &t2).await;
    assert_eq!(status, 200, "{r2}");
    let cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    let prompt = r2["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(
        cached >= 256 && prompt - cached <= 64 + 30,
        "cached {cached} of {prompt}"
    );
    s2.shutdown().await;

    // ... bit-identical to a server computing the same ids from scratch.
    let (s3, base) = start(options()).await;
    let (_, f) = post(
        &c,
        &format!("{base}/v1/completions"),
        &json!({"prompt": r2["redlite"]["prompt_token_ids"], "max_tokens": 8, "temperature": 0,
                "return_token_ids": true}),
    )
    .await;
    assert_eq!(f["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(f["redlite"]["logits_fnv"], r2["redlite"]["logits_fnv"]);
    assert_eq!(
        f["redlite"]["completion_token_ids"],
        r2["redlite"]["completion_token_ids"]
    );
    s3.shutdown().await;

    // The files on disk: checks against this model, and refusals.
    let model = Model::load(TINY).unwrap();
    let id = Identity::of(&model);
    let fresh = model.new_state();
    let files = state_files(&dir);
    assert!(!files.is_empty());
    let good = std::fs::read(&files[0]).unwrap();
    assert!(read_file(&files[0], &id, &fresh).is_ok());

    let bad = dir.join("bad.bin");
    // Truncated at many points (a write cut short by kill -9 never becomes a .rls file, but
    // even if one did it must not load).
    for cut in [0, 4, 8, 13, 100, good.len() / 2, good.len() - 1] {
        std::fs::write(&bad, &good[..cut]).unwrap();
        let e = read_file(&bad, &id, &fresh).unwrap_err();
        assert!(
            matches!(e, StateFileError::BadMagic | StateFileError::Checksum),
            "cut {cut}: {e}"
        );
    }
    // A flipped bit anywhere.
    for at in [9, 40, good.len() / 3, good.len() - 3] {
        let mut b = good.clone();
        b[at] ^= 0x10;
        std::fs::write(&bad, &b).unwrap();
        assert!(read_file(&bad, &id, &fresh).is_err(), "flip at {at}");
    }
    // Another model (same architecture, other quantization) or backend.
    let other = Model::load(TINY.replace("Q8_0", "Q4_K_M")).unwrap();
    let e = read_file(&files[0], &Identity::of(&other), &other.new_state()).unwrap_err();
    assert!(
        matches!(e, StateFileError::Mismatch { what: "model", .. }),
        "{e}"
    );
    let mut id2 = id.clone();
    id2.backend = "cpu".into();
    let e = read_file(&files[0], &id2, &fresh).unwrap_err();
    assert!(e.to_string().contains("backend mismatch"), "{e}");
    std::fs::remove_file(&bad).unwrap();

    // A server over a directory holding a corrupt file and a stray temp file loads nothing
    // from them and computes the prompt in full.
    let mut corrupt = good.clone();
    let n = corrupt.len();
    corrupt[n / 2] ^= 1;
    std::fs::write(&files[0], &corrupt).unwrap();
    std::fs::write(dir.join("0000.rls.tmp-1-0"), &good[..n / 2]).unwrap();
    let (s4, base) = start(opts.clone()).await;
    let (status, r4) = post(&c, &format!("{base}/v1/chat/completions"), &t2).await;
    assert_eq!(status, 200, "{r4}");
    assert_eq!(r4["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(r4["redlite"]["logits_fnv"], r2["redlite"]["logits_fnv"]);
    s4.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}
