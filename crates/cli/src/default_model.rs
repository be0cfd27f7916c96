//! Where the model comes from when `-m` is omitted: the demo model shipped in the repository,
//! `models/redlite-demo.gguf` (a small trained Qwen3-Next with an MTP block, see tools/train-demo/).

use std::path::{Path, PathBuf};

/// The shipped demo model, relative to the repository root.
pub const DEMO_MODEL: &str = "models/redlite-demo.gguf";

/// The model path to use: `given` when set; otherwise `$REDLITE_MODEL`; otherwise the demo model
/// found from the current directory, from the executable's folder upwards (target/release/redlite
/// → the repository root), or at the source tree this binary was built from.
#[allow(dead_code)] // used by the subcommands whose `-m` is optional
pub fn resolve_model(given: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    if let Some(p) = given {
        return Ok(p);
    }
    if let Some(p) = std::env::var_os("REDLITE_MODEL").filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(p));
    }
    let mut candidates = vec![PathBuf::from(DEMO_MODEL)];
    if let Ok(exe) = std::env::current_exe() {
        candidates.extend(exe.ancestors().skip(1).map(|d| d.join(DEMO_MODEL)));
    }
    candidates.push(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .join(DEMO_MODEL),
    );
    candidates.into_iter().find(|p| p.is_file()).ok_or_else(|| {
        anyhow::anyhow!(
            "no model given (-m FILE.gguf) and the demo model {DEMO_MODEL} was not found \
             (set REDLITE_MODEL or run from the repository root)"
        )
    })
}
