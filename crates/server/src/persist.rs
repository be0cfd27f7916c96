//! State files (`--state-dir`): cached conversations persisted across restarts.
//!
//! One file per conversation holds its token ids and the sequence state at its last aligned
//! checkpoint (KV caches up to that position and the recurrent state there):
//!
//! ```text
//! "RLSTATE\0"  magic, 8 bytes
//! u32 LE       header length
//! header       JSON: format version, model identity, backend, KV element type, layer layout,
//!              number of ids, checkpoint position
//! payload      ids (u32 LE each), then per layer: attention K and V (pos × width values each in
//!              the KV element type: f32 LE, f16 LE, or Q8_0 blocks of f16 LE scale + 32 i8)
//!              or DeltaNet conv history and delta-rule state (f32 LE)
//! u64 LE       FNV-1a checksum of everything before it
//! ```
//!
//! Files are written to a temporary name, synced and renamed into place, so a crash (even
//! `kill -9`) mid-write leaves either the old file or the new one. A file whose magic, checksum,
//! format version, model identity, backend, KV type or layer layout does not match is refused
//! with a message and never loaded.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use redlite_gguf::{fnv1a, FNV_OFFSET};
use redlite_model::state::{KvCache, KvRows, LayerState};
use redlite_model::{Backend, Config, LayerKind, Model, SequenceState};
use serde_json::{json, Value};

const MAGIC: &[u8; 8] = b"RLSTATE\0";
/// Version of the file layout; files of another version are refused.
pub const FORMAT_VERSION: u64 = 1;
const EXT: &str = "rls";

/// Why a state file was refused.
#[derive(Debug, thiserror::Error)]
pub enum StateFileError {
    // Transparent: the I/O error's own text, not repeated as a source in a context chain.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error("not a redlite state file (bad magic)")]
    BadMagic,
    #[error("file is truncated or its checksum does not match (corrupt or partly written)")]
    Checksum,
    #[error("bad header: {0}")]
    Header(String),
    #[error("{what} mismatch: file has {file}, this server has {ours}")]
    Mismatch {
        what: &'static str,
        file: String,
        ours: String,
    },
    #[error("payload size does not match the header")]
    Payload,
}

/// What a state file must match to be loaded.
#[derive(Debug, Clone)]
pub struct Identity {
    /// Hash of the GGUF header (metadata and tensor table), the file size and samples of the
    /// tensor data.
    pub model: String,
    pub backend: String,
    /// Layer kinds, `D` (DeltaNet) and `A` (attention).
    pub layout: String,
    pub kv_type: &'static str,
}

impl Identity {
    pub fn of<B: Backend>(model: &Model<B>) -> Identity {
        let f = &model.file;
        let bytes = f.bytes();
        let data = (f.data_offset() as usize).min(bytes.len());
        let mut h = fnv1a(&bytes[..data], FNV_OFFSET);
        h = fnv1a(&f.file_size().to_le_bytes(), h);
        let sample = 1 << 16;
        h = fnv1a(&bytes[data..(data + sample).min(bytes.len())], h);
        h = fnv1a(&bytes[bytes.len().saturating_sub(sample).max(data)..], h);
        Identity {
            model: format!("{h:016x}"),
            backend: model.backend.name().to_string(),
            layout: layout(&model.config),
            kv_type: model.kv_type().name(),
        }
    }
}

fn layout(cfg: &Config) -> String {
    cfg.layer_kinds
        .iter()
        .map(|k| match k {
            LayerKind::DeltaNet => 'D',
            LayerKind::Attention => 'A',
        })
        .collect()
}

/// The state directory.
pub struct StateStore {
    dir: PathBuf,
    identity: Identity,
    max_files: usize,
    counter: AtomicU64,
}

impl StateStore {
    /// Open (create) the directory and remove temporary files that a crashed writer left
    /// (one server per state directory).
    pub fn new(dir: &Path, identity: Identity, max_files: usize) -> std::io::Result<StateStore> {
        std::fs::create_dir_all(dir)?;
        for e in std::fs::read_dir(dir)?.filter_map(Result::ok) {
            let name = e.file_name();
            if name.to_string_lossy().contains(&format!(".{EXT}.tmp-")) {
                let _ = std::fs::remove_file(e.path());
            }
        }
        Ok(StateStore {
            dir: dir.to_path_buf(),
            identity,
            max_files: max_files.max(1),
            counter: AtomicU64::new(0),
        })
    }

    /// The file a conversation is stored in (named by a hash of its ids).
    fn path_for(&self, ids: &[u32]) -> PathBuf {
        let key: Vec<u8> = ids.iter().flat_map(|i| i.to_le_bytes()).collect();
        self.dir
            .join(format!("{:016x}.{EXT}", fnv1a(&key, FNV_OFFSET)))
    }

    /// Write a conversation (atomically: temp file, sync, rename), remove the file of the
    /// conversation it continues (`replaces`), then drop the oldest files beyond the limit.
    pub fn save(
        &self,
        ids: &[u32],
        state: &SequenceState,
        replaces: Option<&Path>,
    ) -> Result<PathBuf, StateFileError> {
        let bytes = encode(&self.identity, ids, state);
        let path = self.path_for(ids);
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        let tmp = path.with_extension(format!("{EXT}.tmp-{}-{n}", std::process::id()));
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&bytes)?;
            f.sync_all()?;
            std::fs::rename(&tmp, &path)?;
            if let Ok(d) = std::fs::File::open(&self.dir) {
                let _ = d.sync_all();
            }
            Ok(())
        };
        if let Err(e) = write() {
            let _ = std::fs::remove_file(&tmp);
            return Err(e.into());
        }
        if let Some(old) = replaces {
            if old != path {
                let _ = std::fs::remove_file(old);
            }
        }
        self.prune();
        Ok(path)
    }

    fn files(&self) -> Vec<(std::time::SystemTime, PathBuf)> {
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        let mut out: Vec<_> = rd
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.extension().and_then(|e| e.to_str()) == Some(EXT))
            .filter_map(|p| {
                let t = std::fs::metadata(&p).and_then(|m| m.modified()).ok()?;
                Some((t, p))
            })
            .collect();
        out.sort();
        out
    }

    fn prune(&self) {
        let files = self.files();
        if files.len() > self.max_files {
            for (_, p) in &files[..files.len() - self.max_files] {
                let _ = std::fs::remove_file(p);
            }
        }
    }

    /// Load every valid state file, newest last; refused files are reported on stderr and
    /// left alone.
    pub fn load_all(&self, fresh: &SequenceState) -> Vec<(Vec<u32>, SequenceState, PathBuf)> {
        let mut out = Vec::new();
        for (_, p) in self.files() {
            match read_file(&p, &self.identity, fresh) {
                Ok((ids, state)) => out.push((ids, state, p)),
                Err(e) => eprintln!("redlite: refusing state file {}: {e}", p.display()),
            }
        }
        out
    }
}

fn push_f32s(out: &mut Vec<u8>, v: &[f32]) {
    out.reserve(v.len() * 4);
    for x in v {
        out.extend_from_slice(&x.to_le_bytes());
    }
}

/// Serialize a conversation: `state` must be at a checkpoint (its KV caches `state.pos` long).
pub fn encode(identity: &Identity, ids: &[u32], state: &SequenceState) -> Vec<u8> {
    let header = json!({
        "format_version": FORMAT_VERSION,
        "model": identity.model,
        "backend": identity.backend,
        "layout": identity.layout,
        "kv_type": identity.kv_type,
        "n_ids": ids.len(),
        "pos": state.pos,
    })
    .to_string();
    let mut out = Vec::new();
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(header.len() as u32).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    for id in ids {
        out.extend_from_slice(&id.to_le_bytes());
    }
    for l in &state.layers {
        match l {
            LayerState::Attention(kv) => {
                out.extend_from_slice(&kv.keys().to_le_bytes());
                out.extend_from_slice(&kv.values().to_le_bytes());
            }
            LayerState::DeltaNet(d) => {
                push_f32s(&mut out, &d.conv);
                push_f32s(&mut out, &d.s);
            }
        }
    }
    let sum = fnv1a(&out, FNV_OFFSET);
    out.extend_from_slice(&sum.to_le_bytes());
    out
}

/// Read and check a state file against this server; `fresh` is an empty state of the model.
pub fn read_file(
    path: &Path,
    identity: &Identity,
    fresh: &SequenceState,
) -> Result<(Vec<u32>, SequenceState), StateFileError> {
    decode(&std::fs::read(path)?, identity, fresh)
}

fn mismatch(what: &'static str, file: &Value, ours: impl ToString) -> StateFileError {
    StateFileError::Mismatch {
        what,
        file: file.to_string(),
        ours: ours.to_string(),
    }
}

/// Check and decode the bytes of a state file.
pub fn decode(
    bytes: &[u8],
    identity: &Identity,
    fresh: &SequenceState,
) -> Result<(Vec<u32>, SequenceState), StateFileError> {
    if bytes.len() < 8 || &bytes[..8] != MAGIC {
        return Err(StateFileError::BadMagic);
    }
    if bytes.len() < 8 + 4 + 8 {
        return Err(StateFileError::Checksum);
    }
    let (body, sum) = bytes.split_at(bytes.len() - 8);
    let sum = u64::from_le_bytes(sum.try_into().expect("8 bytes"));
    if fnv1a(body, FNV_OFFSET) != sum {
        return Err(StateFileError::Checksum);
    }
    let hlen = u32::from_le_bytes(body[8..12].try_into().expect("4 bytes")) as usize;
    let header = body
        .get(12..12 + hlen)
        .ok_or_else(|| StateFileError::Header("header runs past the end".into()))?;
    let h: Value =
        serde_json::from_slice(header).map_err(|e| StateFileError::Header(e.to_string()))?;
    if h["format_version"] != json!(FORMAT_VERSION) {
        return Err(mismatch(
            "format version",
            &h["format_version"],
            FORMAT_VERSION,
        ));
    }
    if h["model"] != json!(identity.model) {
        return Err(mismatch("model", &h["model"], &identity.model));
    }
    if h["backend"] != json!(identity.backend) {
        return Err(mismatch("backend", &h["backend"], &identity.backend));
    }
    if h["kv_type"] != json!(identity.kv_type) {
        return Err(mismatch("KV element type", &h["kv_type"], identity.kv_type));
    }
    if h["layout"] != json!(identity.layout) {
        return Err(mismatch("layer layout", &h["layout"], &identity.layout));
    }
    let n_ids = h["n_ids"]
        .as_u64()
        .ok_or_else(|| StateFileError::Header("no n_ids".into()))? as usize;
    let pos = h["pos"]
        .as_u64()
        .ok_or_else(|| StateFileError::Header("no pos".into()))? as usize;
    if pos > n_ids {
        return Err(StateFileError::Header(format!(
            "position {pos} is past the {n_ids} ids"
        )));
    }
    let mut payload = Payload(&body[12 + hlen..]);
    let ids: Vec<u32> = payload
        .take(n_ids.checked_mul(4).ok_or(StateFileError::Payload)?)?
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect();
    let mut state = fresh.clone();
    state.reset();
    for l in &mut state.layers {
        match l {
            LayerState::Attention(kv) => {
                let t = kv.kv_type();
                let n =
                    t.bytes_for(pos.checked_mul(kv.width).ok_or(StateFileError::Payload)? as u64);
                let n = usize::try_from(n).map_err(|_| StateFileError::Payload)?;
                let k =
                    KvRows::from_le_bytes(t, payload.take(n)?).ok_or(StateFileError::Payload)?;
                let v =
                    KvRows::from_le_bytes(t, payload.take(n)?).ok_or(StateFileError::Payload)?;
                *kv = KvCache::from_rows(kv.width, k, v).map_err(|_| StateFileError::Payload)?;
            }
            LayerState::DeltaNet(d) => {
                d.conv = payload.f32s(d.conv.len())?;
                d.s = payload.f32s(d.s.len())?;
            }
        }
    }
    if !payload.0.is_empty() {
        return Err(StateFileError::Payload);
    }
    state.pos = pos;
    Ok((ids, state))
}

/// The unread rest of a state file's payload.
struct Payload<'a>(&'a [u8]);

impl<'a> Payload<'a> {
    /// The next `n` bytes.
    fn take(&mut self, n: usize) -> Result<&'a [u8], StateFileError> {
        if self.0.len() < n {
            return Err(StateFileError::Payload);
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }

    /// The next `n` f32 (LE).
    fn f32s(&mut self, n: usize) -> Result<Vec<f32>, StateFileError> {
        Ok(self
            .take(n.checked_mul(4).ok_or(StateFileError::Payload)?)?
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect())
    }
}

/// Checkpoints of a loaded state: just its own position.
pub fn snapshots_of(state: &SequenceState) -> BTreeMap<usize, redlite_model::Snapshot> {
    let mut m = BTreeMap::new();
    if state.pos > 0 {
        m.insert(state.pos, state.snapshot());
    }
    m
}
