//! `redlite-server`: an HTTP server for coding agents.
//!
//! - OpenAI API: `POST /v1/chat/completions` (streaming or not, tool calls), `POST /v1/completions`,
//!   `GET /v1/models`; Anthropic API: `POST /v1/messages` (text, `tool_use` / `tool_result`,
//!   SSE events), `POST /v1/messages/count_tokens`; `GET /health`, `GET /metrics` (Prometheus).
//! - One model worker thread runs one generation at a time; requests queue in front of it and a
//!   client that disconnects cancels its generation.
//! - Prefix-state reuse across turns (see [`cache`] and [`worker`]): a conversation that extends
//!   a recent one resumes from an aligned checkpoint instead of recomputing its prompt, with
//!   results bit-identical to computing it fresh.
//! - A web chat page at `/` (streaming).
//! - Every malformed request gets a 4xx JSON error in the API's error shape; unknown fields are
//!   ignored.
//!
//! ```no_run
//! # async fn f() -> anyhow::Result<()> {
//! let model = redlite_model::Model::load("model.gguf")?;
//! let server = redlite_server::start(model, redlite_server::ServerOptions::default()).await?;
//! println!("listening on {}", server.addr());
//! server.wait().await;
//! # Ok(()) }
//! ```

pub mod anthropic;
pub mod cache;
pub mod error;
pub mod metrics;
pub mod openai;
pub mod persist;
pub mod toolcall;
pub mod worker;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use anyhow::{Context, Result};
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use redlite_model::{Backend, Model};
use redlite_tokenizer::chat_template::ChatTemplate;
use redlite_tokenizer::tokenizer::Tokenizer;
use tokio::sync::oneshot;

use crate::error::{ApiError, Flavor};
use crate::metrics::Metrics;
use crate::worker::{WorkerHandle, WorkerOptions};

/// Server settings.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    pub host: String,
    /// 0 picks a free port.
    pub port: u16,
    /// When set, API requests need `Authorization: Bearer KEY` or `x-api-key: KEY`.
    pub api_key: Option<String>,
    /// Context size (default: the model's, capped at 32768).
    pub ctx: Option<usize>,
    /// Model id reported by the API (default: the GGUF `general.name`, else `redlite`).
    pub model_name: Option<String>,
    /// Largest accepted request body.
    pub max_body_bytes: usize,
    /// Tokens per prefill forward call.
    pub prefill_batch: usize,
    /// Checkpoint spacing inside a conversation (besides each turn's end).
    pub checkpoint_interval: usize,
    /// Conversations kept in the prefix cache.
    pub cache_entries: usize,
    /// Memory budget of the prefix cache.
    pub cache_bytes: usize,
    /// Replay these replies (each a text, special tokens parsed) instead of sampling, one per
    /// request in order; afterwards the model samples again. For tests.
    pub replay: Vec<String>,
    /// Persist prefix states in this directory across restarts.
    pub state_dir: Option<std::path::PathBuf>,
    /// Speculative decoding (its mode is the default of requests that do not set `spec`).
    pub spec: redlite_engine::speculative::SpecConfig,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            host: "127.0.0.1".into(),
            port: 8080,
            api_key: None,
            ctx: None,
            model_name: None,
            max_body_bytes: 32 << 20,
            prefill_batch: 512,
            checkpoint_interval: 4096,
            cache_entries: 4,
            cache_bytes: 8 << 30,
            replay: Vec::new(),
            state_dir: None,
            spec: Default::default(),
        }
    }
}

/// What the handlers share.
pub struct AppState {
    pub worker: WorkerHandle,
    pub tokenizer: Arc<Tokenizer>,
    pub template: Option<ChatTemplate>,
    pub model_name: String,
    pub api_key: Option<String>,
    pub ctx: usize,
    pub metrics: Arc<Metrics>,
    /// Unix time of the server start (the `created` of responses).
    pub created: u64,
    counter: AtomicU64,
}

impl AppState {
    /// A fresh response id with this prefix.
    pub fn next_id(&self, prefix: &str) -> String {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        format!("{prefix}-{:x}{n:06x}", self.created)
    }
}

/// A running server.
pub struct Server {
    addr: SocketAddr,
    worker: WorkerHandle,
    shutdown: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl Server {
    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Serve until the process ends.
    pub async fn wait(self) {
        let _keep = self.shutdown;
        let _ = self.task.await;
    }

    /// Stop accepting connections and wait for the open ones to finish, then for the worker to
    /// finish its queue (including writing state files).
    pub async fn shutdown(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        let _ = self.task.await;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
        while self.worker.queue_depth() > 0 && std::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }
}

/// Build the router for a model: starts the worker thread.
pub fn build<B: Backend + 'static>(model: Model<B>, opts: &ServerOptions) -> Result<Router> {
    Ok(build_app(model, opts)?.0)
}

fn build_app<B: Backend + 'static>(
    model: Model<B>,
    opts: &ServerOptions,
) -> Result<(Router, WorkerHandle)> {
    if opts.spec.mode == redlite_engine::speculative::SpecMode::Mtp && !model.has_mtp() {
        anyhow::bail!("--spec mtp: this model has no MTP block (use lookup or both)");
    }
    let file = model.file.clone();
    let tokenizer = Arc::new(Tokenizer::from_gguf(&file).context("building the tokenizer")?);
    let template = match ChatTemplate::from_gguf(&file) {
        Ok(t) => Some(t),
        Err(e) => {
            eprintln!("warning: no usable chat template ({e}); /v1/chat/completions is off");
            None
        }
    };
    let model_name = opts.model_name.clone().unwrap_or_else(|| {
        file.get_str("general.name")
            .map(str::to_string)
            .unwrap_or_else(|_| "redlite".to_string())
    });
    let ctx = opts
        .ctx
        .unwrap_or(model.config.context_length.min(32768))
        .max(2);
    let metrics = Arc::new(Metrics::default());
    let worker = worker::spawn(
        model,
        tokenizer.clone(),
        WorkerOptions {
            ctx,
            prefill_batch: opts.prefill_batch,
            checkpoint_interval: opts.checkpoint_interval,
            cache_entries: opts.cache_entries,
            cache_bytes: opts.cache_bytes,
            replay: opts.replay.clone(),
            state_dir: opts.state_dir.clone(),
            spec: opts.spec.clone(),
        },
        metrics.clone(),
    )
    .context("starting the model worker thread")?;
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let state = Arc::new(AppState {
        worker,
        tokenizer,
        template,
        model_name,
        api_key: opts.api_key.clone(),
        ctx,
        metrics,
        created,
        counter: AtomicU64::new(0),
    });
    let worker = state.worker.clone();
    Ok((router(state, opts.max_body_bytes), worker))
}

fn router(state: Arc<AppState>, max_body: usize) -> Router {
    let api = Router::new()
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/completions", post(openai::completions))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/v1/models", get(openai::models))
        .route("/models", get(openai::models))
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), auth));
    Router::new()
        .route("/", get(index))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .merge(api)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(max_body))
        .layer(tower_http::catch_panic::CatchPanicLayer::custom(
            |_: Box<dyn std::any::Any + Send>| {
                ApiError::internal("internal error while handling the request").into_response()
            },
        ))
        .with_state(state)
}

/// Start serving on `opts.host:opts.port`.
pub async fn start<B: Backend + 'static>(model: Model<B>, opts: ServerOptions) -> Result<Server> {
    let (app, worker) = build_app(model, &opts)?;
    let listener = tokio::net::TcpListener::bind((opts.host.as_str(), opts.port))
        .await
        .with_context(|| format!("binding {}:{}", opts.host, opts.port))?;
    let addr = listener.local_addr()?;
    let (tx, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let serve = axum::serve(listener, app).with_graceful_shutdown(async move {
            let _ = rx.await;
        });
        if let Err(e) = serve.await {
            eprintln!("server error: {e}");
        }
    });
    Ok(Server {
        addr,
        worker,
        shutdown: Some(tx),
        task,
    })
}

fn flavor_of(path: &str) -> Flavor {
    if path.starts_with("/v1/messages") {
        Flavor::Anthropic
    } else {
        Flavor::OpenAi
    }
}

async fn auth(
    State(app): State<Arc<AppState>>,
    headers: HeaderMap,
    req: Request,
    next: Next,
) -> Response {
    if let Some(key) = &app.api_key {
        let bearer = headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        let x_key = headers.get("x-api-key").and_then(|v| v.to_str().ok());
        if bearer != Some(key.as_str()) && x_key != Some(key.as_str()) {
            app.metrics.errors.fetch_add(1, Ordering::Relaxed);
            return ApiError::unauthorized()
                .with_flavor(flavor_of(req.uri().path()))
                .into_response();
        }
    }
    next.run(req).await
}

/// The web chat page.
async fn index() -> Response {
    axum::response::Html(include_str!("../web/index.html")).into_response()
}

async fn health(State(app): State<Arc<AppState>>) -> Response {
    Json(serde_json::json!({
        "status": "ok",
        "model": app.model_name,
        "queue_depth": app.worker.queue_depth(),
    }))
    .into_response()
}

async fn metrics_text(State(app): State<Arc<AppState>>) -> Response {
    (
        [("content-type", "text/plain; version=0.0.4")],
        app.metrics.render(app.worker.queue_depth()),
    )
        .into_response()
}

async fn not_found(req: Request) -> Response {
    ApiError::not_found(format!(
        "no route for {} {}",
        req.method(),
        req.uri().path()
    ))
    .with_flavor(flavor_of(req.uri().path()))
    .into_response()
}

async fn method_not_allowed(req: Request) -> Response {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        format!("{} is not allowed on {}", req.method(), req.uri().path()),
    )
    .with_flavor(flavor_of(req.uri().path()))
    .into_response()
}

/// Serve until Ctrl-C (or SIGTERM), on a runtime of its own: the entry point for the CLI.
pub fn run_blocking<B: Backend + 'static>(model: Model<B>, opts: ServerOptions) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        let server = start(model, opts).await?;
        eprintln!("redlite: listening on http://{}", server.addr());
        shutdown_signal().await;
        eprintln!("redlite: shutting down");
        server.shutdown().await;
        Ok(())
    })
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
