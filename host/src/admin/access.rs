//! Who may use the admin API and the dashboard, and what they share: the state every
//! request reads (`AdminApi`), and the check that lets a request through with the admin
//! token, as a bearer token or as a signed-in browser's cookie of its digest, compared in
//! constant time. It knows no route: `api` and `dashboard` build on it.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde_json::json;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::config::RetentionConfig;
use crate::dispatch::{DispatcherCounters, KnownHandlers};
use crate::plugin::PluginRegistry;
use crate::store::mongo::MongoStore;

/// The cookie a signed-in browser carries: the hex SHA-256 of the token.
pub(super) const COOKIE: &str = "relayhost_admin";

/// What the API reads and acts on.
#[derive(Clone)]
pub struct AdminApi {
    pub store: Arc<MongoStore>,
    pub plugins: Arc<PluginRegistry>,
    pub known: Arc<KnownHandlers>,
    pub counters: Arc<DispatcherCounters>,
    pub retention: RetentionConfig,
}

/// The API as served: what it reads, and the digest of the token it accepts.
#[derive(Clone)]
pub(super) struct Served {
    pub(super) api: AdminApi,
    token_digest: [u8; 32],
}

impl Served {
    pub(super) fn new(api: AdminApi, token_digest: [u8; 32]) -> Self {
        Self { api, token_digest }
    }

    /// Whether `digest` is the token's, compared in constant time.
    pub(super) fn accepts(&self, digest: &[u8; 32]) -> bool {
        bool::from(digest.ct_eq(&self.token_digest))
    }
}

/// Lets a request through only with the right bearer token, or a signed-in browser's cookie
/// (see `dashboard`); a browser without one is sent to sign in, anyone else gets 401.
pub(super) async fn authenticated(State(served): State<Served>, request: Request, next: Next) -> Response {
    let headers = request.headers();
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "))
        .map(|token| <[u8; 32]>::from(Sha256::digest(token.trim().as_bytes())));
    let cookie = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(';'))
        .filter_map(|pair| pair.trim().strip_prefix(COOKIE)?.strip_prefix('='))
        .find_map(|digest| <[u8; 32]>::try_from(hex::decode(digest).ok()?).ok());
    if bearer.or(cookie).is_some_and(|digest| served.accepts(&digest)) {
        return next.run(request).await;
    }
    if request.uri().path() == "/" || request.uri().path().starts_with("/dashboard") {
        return axum::response::Redirect::to("/login").into_response();
    }
    let mut response = failure(StatusCode::UNAUTHORIZED, "a valid `Authorization: Bearer <admin token>` header is required");
    response.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    response
}

/// An error as the API answers it: JSON naming the problem.
pub(super) fn failure(status: StatusCode, message: &str) -> Response {
    (status, Json(json!({ "error": message }))).into_response()
}
