//! Where to find a model when the user gives none: `$REDLITE_MODEL`, else the demo model the
//! repository ships (`models/redlite-demo.gguf`), looked up from the working directory and from
//! the folders above the running executable (so `target/release/redlite` finds it too).

use std::path::{Path, PathBuf};

/// The demo model's path inside the repository.
pub const DEMO_MODEL: &str = "models/redlite-demo.gguf";

/// `given`, or the default model; an error says where it looked.
pub fn resolve_model(given: Option<&Path>) -> Result<PathBuf, String> {
    if let Some(p) = given {
        return Ok(p.to_path_buf());
    }
    if let Some(p) = std::env::var_os("REDLITE_MODEL") {
        return Ok(PathBuf::from(p));
    }
    let mut candidates = vec![PathBuf::from(DEMO_MODEL)];
    if let Ok(exe) = std::env::current_exe() {
        candidates.extend(exe.ancestors().skip(1).map(|dir| dir.join(DEMO_MODEL)));
    }
    candidates.iter().find(|p| p.is_file()).cloned().ok_or_else(|| {
        format!(
            "no model given (-m FILE) and the demo model {DEMO_MODEL} was not found \
             (looked in the working directory and above the executable; set REDLITE_MODEL to choose one)"
        )
    })
}
