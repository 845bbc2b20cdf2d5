//! Recorded HTTP: how a plugin's requests leave when a plugin is tried rather than deployed
//! (`relayhost test-plugin`, `relayhost replay`). Every request the grant allows is recorded
//! (method, URL, the first 4 KiB of its body) and answered from the fixtures given; one no
//! fixture answers is refused, unless sending is allowed, when it is sent as a host sends it
//! (the grant's checks included) and its status recorded. It owns the fixtures and the record,
//! shared by the runs of one try; it never decides whether a request is granted.

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use wasmtime_wasi_http::{Error, WasiBody};

/// The most of a request's body a record keeps.
const BODY_KEPT: usize = 4 * 1024;

/// An answer to requests of `method` (any, when `None`) to `url`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fixture {
    #[serde(default)]
    pub method: Option<String>,
    pub url: String,
    #[serde(default = "ok")]
    pub status: u16,
    #[serde(default)]
    pub body: String,
}

fn ok() -> u16 {
    200
}

/// How a recorded request was answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    Fixture(u16),
    Sent(u16),
    Refused(String),
}

/// One request a plugin made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recorded {
    pub method: String,
    pub url: String,
    pub body: String,
    pub answer: Answer,
}

/// The fixtures and the record of one try of a plugin; clones share them.
#[derive(Debug, Clone, Default)]
pub struct Recording {
    fixtures: Arc<Vec<Fixture>>,
    send_unanswered: bool,
    record: Arc<Mutex<Vec<Recorded>>>,
}

impl Recording {
    /// Answers from `fixtures`; sends what they do not answer only when `send_unanswered`.
    pub fn new(fixtures: Vec<Fixture>, send_unanswered: bool) -> Self {
        Self { fixtures: Arc::new(fixtures), send_unanswered, record: Arc::default() }
    }

    /// The requests recorded since the last call (a try runs one delivery at a time).
    pub fn take(&self) -> Vec<Recorded> {
        std::mem::take(&mut *self.record.lock().expect("the record"))
    }

    fn fixture_for(&self, method: &str, url: &str) -> Option<&Fixture> {
        let url = url.trim_end_matches('/');
        self.fixtures.iter().find(|f| f.url.trim_end_matches('/') == url && f.method.as_deref().is_none_or(|m| m.eq_ignore_ascii_case(method)))
    }

    /// Records a request the grant refused.
    pub(super) fn refused(&self, method: &str, url: &str, reason: &str) {
        let answer = Answer::Refused(format!("not granted: {reason}"));
        self.keep(Recorded { method: method.to_string(), url: url.to_string(), body: String::new(), answer });
    }

    fn keep(&self, request: Recorded) {
        self.record.lock().expect("the record").push(request);
    }

    /// Records `request` (granted already) and answers it from a fixture; `Ok(request)` back
    /// when it is to be sent, with what `answered` records of how it went.
    pub(super) async fn exchange(&self, request: http::Request<WasiBody>) -> Result<Exchanged, Error> {
        let (parts, body) = request.into_parts();
        let body = body.collect().await?.to_bytes();
        let (method, url) = (parts.method.to_string(), parts.uri.to_string());
        let shown = String::from_utf8_lossy(&body[..body.len().min(BODY_KEPT)]).into_owned();
        if let Some(fixture) = self.fixture_for(&method, &url) {
            self.keep(Recorded { method, url, body: shown, answer: Answer::Fixture(fixture.status) });
            let response = http::Response::builder()
                .status(fixture.status)
                .body(full(Bytes::from(fixture.body.clone())))
                .map_err(|_| Error::InternalError(Some("a fixture's status is not valid".into())))?;
            return Ok(Exchanged::Answered(response));
        }
        if !self.send_unanswered {
            let reason = "no fixture answers it, and nothing is sent without --allow-http".to_string();
            self.keep(Recorded { method, url, body: shown, answer: Answer::Refused(reason) });
            return Err(Error::HttpRequestDenied);
        }
        let request = http::Request::from_parts(parts, full(body));
        Ok(Exchanged::Send { request, sent: Sent { recording: self.clone(), method, url, body: shown } })
    }
}

/// What [`Recording::exchange`] made of a request.
pub(super) enum Exchanged {
    Answered(http::Response<WasiBody>),
    /// To send; say how it went with `sent`.
    Send { request: http::Request<WasiBody>, sent: Sent },
}

/// A request being sent, to record with its status.
pub(super) struct Sent {
    recording: Recording,
    method: String,
    url: String,
    body: String,
}

impl Sent {
    pub(super) fn answered(self, answer: Answer) {
        self.recording.keep(Recorded { method: self.method, url: self.url, body: self.body, answer });
    }
}

fn full(bytes: Bytes) -> WasiBody {
    Full::new(bytes).map_err(|never| match never {}).boxed_unsync()
}
