//! API errors, rendered in the error shape of the API that was called.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

/// Which API's error shape to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Flavor {
    /// `{"error": {"message", "type", "param", "code"}}`
    #[default]
    OpenAi,
    /// `{"type": "error", "error": {"type", "message"}}`
    Anthropic,
}

/// An error answered to the client.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type` (`invalid_request_error`, `authentication_error`, `server_error`, ...).
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    pub flavor: Flavor,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            flavor: Flavor::OpenAi,
        }
    }

    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// A request field with a bad value.
    pub fn bad_param(param: &str, message: impl Into<String>) -> ApiError {
        let mut e = ApiError::bad_request(message);
        e.param = Some(param.to_string());
        e
    }

    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    pub fn unauthorized() -> ApiError {
        let mut e = ApiError::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "invalid or missing API key",
        );
        e.code = Some("invalid_api_key");
        e
    }

    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "not_found_error", message)
    }

    pub fn context_exceeded(prompt: usize, ctx: usize) -> ApiError {
        let mut e = ApiError::bad_request(format!(
            "the prompt has {prompt} tokens; the context holds {ctx} (prompt plus reply)"
        ));
        e.code = Some("context_length_exceeded");
        e
    }

    pub fn with_flavor(mut self, flavor: Flavor) -> ApiError {
        self.flavor = flavor;
        self
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        match self.flavor {
            Flavor::OpenAi => json!({
                "error": {
                    "message": self.message,
                    "type": self.kind,
                    "param": self.param,
                    "code": self.code,
                }
            }),
            Flavor::Anthropic => {
                let kind = match self.status.as_u16() {
                    401 => "authentication_error",
                    404 => "not_found_error",
                    413 => "request_too_large",
                    400..=499 => "invalid_request_error",
                    _ => "api_error",
                };
                json!({"type": "error", "error": {"type": kind, "message": self.message}})
            }
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status, self.message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}
