//! `redlite bench` smoke tests on the tiny Q4_K_M fixture with tiny sizes: every subcommand exits
//! 0 and prints its table (or valid JSON). Timings are never asserted.

mod common;

use std::process::Command;

use common::reference;
use serde_json::Value;

fn fixture() -> String {
    reference("models/tiny-Q4_K_M.gguf").display().to_string()
}

/// Runs `redlite bench ARGS` with a small bandwidth buffer; returns stdout.
fn bench(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_redlite"))
        .arg("bench")
        .args(args)
        .args(["--bw-mib", "16", "--bw-runs", "2"])
        .output()
        .expect("run redlite");
    assert!(
        out.status.success(),
        "redlite bench {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8")
}

#[test]
fn decode_table() {
    let m = fixture();
    for backend in ["cpu", "oracle"] {
        let out = bench(&[
            "decode",
            "-m",
            &m,
            "--backend",
            backend,
            "-n",
            "3",
            "-p",
            "4",
        ]);
        assert!(out.contains("memory read bandwidth"), "{out}");
        assert!(out.contains("tok/s") && out.contains("% bw"), "{out}");
        assert!(out.contains(backend), "{out}");
    }
}

#[test]
fn prefill_table() {
    let out = bench(&["prefill", "-m", &fixture(), "-p", "16", "-n", "1"]);
    assert!(out.contains("tok/s") && out.contains("tokens"), "{out}");
}

#[test]
fn kernel_table_for_the_file_and_a_type() {
    let out = bench(&[
        "kernel",
        "-m",
        &fixture(),
        "-n",
        "2",
        "--working-set-mib",
        "1",
    ]);
    for t in ["Q4_K", "Q6_K", "GB/s"] {
        assert!(out.contains(t), "{t} missing: {out}");
    }
    let out = bench(&[
        "kernel",
        "--type",
        "IQ2_XXS",
        "--shape",
        "64x512",
        "-n",
        "2",
        "--working-set-mib",
        "1",
        "--json",
    ]);
    let v: Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(v["kernels"][0]["type"], "IQ2_XXS");
    assert_eq!(v["kernels"][0]["rows"], 64);
    assert!(v["bandwidth"]["gbps"].as_f64().unwrap() > 0.0);
}

#[test]
fn errors_are_reported() {
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_redlite"))
            .arg("bench")
            .args(args)
            .output()
            .expect("run redlite")
    };
    // (`decode` without -m is not an error: it benches the shipped demo model.)
    for args in [
        &["kernel"][..],
        &["kernel", "--type", "Q9_K"][..],
        &["kernel", "--type", "Q4_K", "--shape", "12"][..],
        &["decode", "-m", "/nonexistent.gguf"][..],
        &["decode", "-m", "x", "--backend", "tpu"][..],
    ] {
        let out = run(args);
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("error"), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}
