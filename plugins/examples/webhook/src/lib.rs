//! POSTs every event as JSON to the URL in the granted `WEBHOOK_URL` environment variable,
//! through wasi:http (the operator must also grant the URL's host). 2xx completes; 429 and
//! 5xx retry, not before `Retry-After` when the server sends one; other answers are
//! unprocessable.

use relayhost_guest::prelude::*;
use wasi::http::outgoing_handler;
use wasi::http::types::{Fields, Method, OutgoingBody, OutgoingRequest, Scheme};

struct Webhook;

impl Plugin for Webhook {
    fn subscriptions() -> Vec<Subscription> {
        vec![Subscription::new("webhook", ["order.placed", "order.paid"])]
    }

    fn handle(event: Event, context: DeliveryContext) -> Result<(), Failure> {
        let url = std::env::var("WEBHOOK_URL").map_err(|_| Failure::unprocessable("WEBHOOK_URL is not granted"))?;
        let body = serde_json::json!({
            "id": event.id, "type": event.event_type, "key": event.key, "sequence": event.sequence,
            "attempt": context.attempt,
            "payload": serde_json::from_str::<serde_json::Value>(&event.payload).unwrap_or_default(),
        });
        let (status, retry_after) = post(&url, &event.id, body.to_string().as_bytes()).map_err(Failure::retry)?;
        match status {
            200..=299 => Ok(()),
            429 | 500..=599 => Err(match retry_after.and_then(|s| s.trim().parse::<i64>().ok()) {
                Some(seconds) => Failure::retry_at(format!("HTTP {status}"), now_ms() + seconds * 1_000),
                None => Failure::retry(format!("HTTP {status}")),
            }),
            _ => Err(Failure::unprocessable(format!("HTTP {status}"))),
        }
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

/// One POST; the status and the `Retry-After` header.
fn post(url: &str, idempotency_key: &str, body: &[u8]) -> Result<(u16, Option<String>), String> {
    let (scheme, rest) = url.split_once("://").ok_or_else(|| format!("{url} is not an absolute URL"))?;
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let headers = Fields::from_list(&[
        ("content-type".to_string(), b"application/json".to_vec()),
        ("idempotency-key".to_string(), idempotency_key.as_bytes().to_vec()),
    ])
    .map_err(|e| format!("{e:?}"))?;
    let request = OutgoingRequest::new(headers);
    let scheme = if scheme == "https" { Scheme::Https } else { Scheme::Http };
    request.set_method(&Method::Post).map_err(|()| "method")?;
    request.set_scheme(Some(&scheme)).map_err(|()| "scheme")?;
    request.set_authority(Some(authority)).map_err(|()| "authority")?;
    request.set_path_with_query(Some(if path.is_empty() { "/" } else { path })).map_err(|()| "path")?;
    let outgoing = request.body().map_err(|()| "body")?;
    {
        let stream = outgoing.write().map_err(|()| "body stream")?;
        for chunk in body.chunks(4096) {
            stream.blocking_write_and_flush(chunk).map_err(|e| format!("writing the body: {e:?}"))?;
        }
    }
    OutgoingBody::finish(outgoing, None).map_err(|e| format!("{e:?}"))?;
    let pending = outgoing_handler::handle(request, None).map_err(|e| format!("{e:?}"))?;
    pending.subscribe().block();
    let response = pending
        .get()
        .ok_or("no response")?
        .map_err(|()| "response taken twice")?
        .map_err(|e| format!("{e:?}"))?;
    let retry_after = response
        .headers()
        .get(&"retry-after".to_string())
        .first()
        .map(|value| String::from_utf8_lossy(value).into_owned());
    Ok((response.status(), retry_after))
}

relayhost_guest::export_plugin!(Webhook);
