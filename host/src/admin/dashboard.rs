//! The dashboard: server-rendered HTML pages on the admin API's listener, no script. One
//! page shows each handler's backlog (pending, running, parked, dead, completed, served by,
//! how long the oldest has waited), this host's throughput since the last look, the dead
//! letters with their reasons and requeue buttons, what waits longest with bury buttons, the
//! plugins and every refused file with its reason, and the lanes each live host holds.
//!
//! Signing in (`/login`) takes the admin token and sets a cookie holding its SHA-256 digest
//! (`HttpOnly`, `SameSite=Strict`, so no other site's form can post with it); the API's
//! check accepts that cookie as it accepts the bearer token. Every text shown is escaped.

use crate::store::{Administration, Hosts};
use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::Instant;

use axum::Form;
use axum::extract::{Path, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{Html, IntoResponse, Redirect, Response};
use bson::DateTime;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::access::{COOKIE, Served};
use crate::dispatch::{DispatcherCounters, bury_by_operator};
use crate::store::{DeliveryFilter, DeliveryStatus, Listed};

/// This host's completions at the last look, for the throughput since.
pub(super) static LAST_LOOK: Mutex<Option<(Instant, u64)>> = Mutex::new(None);

/// `text` safe inside HTML text and attribute values.
pub(super) fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c if c.is_control() => out.extend(c.escape_default()),
            c => out.push(c),
        }
    }
    out
}

fn page(title: &str, body: &str) -> Html<String> {
    Html(format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{title}</title><style>\
         body{{font:14px system-ui,sans-serif;margin:1.5em;color:#222}}table{{border-collapse:collapse;margin:.5em 0 1.5em}}\
         th,td{{border:1px solid #ccc;padding:.25em .6em;text-align:left;vertical-align:top}}th{{background:#f3f3f3}}\
         .warn{{color:#a40}}.dead{{color:#b00}}form{{display:inline}}button{{cursor:pointer}}</style></head>\
         <body><h1>{title}</h1>{body}</body></html>",
        title = escape(title)
    ))
}

fn shown(at: DateTime) -> String {
    at.try_to_rfc3339_string().unwrap_or_default()
}

pub(super) async fn login_form() -> Html<String> {
    page(
        "relayhost: sign in",
        "<form method=\"post\" action=\"/login\"><label>Admin token <input type=\"password\" name=\"token\" id=\"token\" \
         autocomplete=\"current-password\"></label> <button type=\"submit\" id=\"sign-in\">Sign in</button></form>",
    )
}

#[derive(Deserialize)]
pub(super) struct Login {
    token: String,
}

pub(super) async fn login(State(served): State<Served>, Form(login): Form<Login>) -> Response {
    let digest: [u8; 32] = Sha256::digest(login.token.trim().as_bytes()).into();
    if !served.accepts(&digest) {
        return (StatusCode::UNAUTHORIZED, page("relayhost: sign in", "<p class=\"dead\">That is not the admin token.</p><p><a href=\"/login\">Again</a></p>"))
            .into_response();
    }
    let cookie = format!("{COOKIE}={}; HttpOnly; SameSite=Strict; Path=/", hex::encode(digest));
    let mut response = Redirect::to("/").into_response();
    response.headers_mut().insert(header::SET_COOKIE, HeaderValue::from_str(&cookie).expect("a cookie of hex"));
    response
}

pub(super) async fn overview(State(served): State<Served>) -> Response {
    let api = &served.api;
    let now = DateTime::now();
    let store = &api.store;
    let dead_filter = DeliveryFilter { status: Some(DeliveryStatus::Dead), limit: 50, ..DeliveryFilter::default() };
    let waiting_filter = Listed::Pending.narrow(DeliveryFilter { running: Some(false), limit: 20, ..DeliveryFilter::default() });
    let read = tokio::try_join!(
        store.statistics(now),
        store.unfanned_events(),
        store.list_deliveries(&dead_filter),
        store.list_deliveries(&waiting_filter),
        store.membership(now),
    );
    let (statistics, unfanned, dead, waiting, membership) = match read {
        Ok(all) => all,
        Err(error) => return (StatusCode::SERVICE_UNAVAILABLE, page("relayhost", &format!("<p class=\"dead\">{}</p>", escape(&error.to_string())))).into_response(),
    };
    let registry = api.known.known().map(|known| (*known).clone()).unwrap_or_default();
    let mut body = String::new();

    // This host's throughput since the last look at this page.
    let completed = DispatcherCounters::get(&api.counters.completed);
    let throughput = {
        let mut last = LAST_LOOK.lock().expect("last look");
        let rate = last.map(|(at, before)| completed.saturating_sub(before) as f64 / at.elapsed().as_secs_f64().max(0.001));
        *last = Some((Instant::now(), completed));
        rate
    };
    let _ = write!(
        body,
        "<p>This host completed {completed} deliveries since it started{}; {unfanned} events wait to be fanned out.</p>",
        throughput.map_or(String::new(), |rate| format!(", {rate:.1}/s since the last look"))
    );

    body.push_str("<h2>Handlers</h2><table id=\"handlers\"><tr><th>handler</th><th>pending</th><th>running</th><th>parked</th><th>dead</th><th>completed</th><th>oldest waiting since</th><th>served by</th></tr>");
    for s in &statistics {
        let record = registry.iter().find(|r| r.handler == s.handler);
        let served = match record {
            Some(r) if r.served_by.is_empty() && r.active() => format!("<span class=\"warn\">no host since {}</span>", escape(&shown(r.last_seen))),
            Some(r) => format!("{} host(s)", r.served_by.len()),
            None => "-".to_string(),
        };
        let _ = write!(
            body,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td class=\"dead\">{}</td><td>{}</td><td>{}</td><td>{served}</td></tr>",
            escape(&s.handler),
            s.pending,
            s.running,
            s.parked,
            s.dead,
            s.completed.map_or("-".to_string(), |c| c.to_string()),
            s.oldest_due_at.map_or("-".to_string(), |at| escape(&shown(at))),
        );
    }
    body.push_str("</table>");

    body.push_str("<h2>Dead letters</h2><table id=\"dead\"><tr><th>delivery</th><th>handler</th><th>event</th><th>attempts</th><th>reason</th><th></th></tr>");
    for d in &dead.deliveries {
        let _ = write!(
            body,
            "<tr><td>{id}</td><td>{}</td><td>{} ({})</td><td>{}</td><td class=\"dead\">{}</td><td><form method=\"post\" action=\"/dashboard/deliveries/{id}/requeue\">\
             <button type=\"submit\" id=\"requeue-{id}\">Requeue</button></form></td></tr>",
            escape(&d.handler),
            escape(&d.event_id),
            escape(&d.event_type),
            d.attempts,
            escape(d.last_error.as_deref().unwrap_or("")),
            id = escape(&d.id),
        );
    }
    body.push_str("</table>");

    body.push_str("<h2>Waiting longest</h2><table id=\"waiting\"><tr><th>delivery</th><th>handler</th><th>event</th><th>key</th><th>due</th><th>last error</th><th></th></tr>");
    for d in &waiting.deliveries {
        let _ = write!(
            body,
            "<tr><td>{id}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td><form method=\"post\" action=\"/dashboard/deliveries/{id}/bury\">\
             <button type=\"submit\" id=\"bury-{id}\">Bury</button></form></td></tr>",
            escape(&d.handler),
            escape(&d.event_id),
            escape(d.key.as_deref().unwrap_or("")),
            escape(&shown(d.due_at)),
            escape(d.last_error.as_deref().unwrap_or("")),
            id = escape(&d.id),
        );
    }
    body.push_str("</table>");

    body.push_str("<h2>Plugins</h2><table id=\"plugins\"><tr><th>plugin</th><th>version</th><th>handlers</th></tr>");
    for plugin in api.plugins.plugins() {
        let handlers: Vec<String> = plugin.subscriptions.iter().map(|s| escape(&s.handler)).collect();
        let _ = write!(body, "<tr><td>{}</td><td>{}</td><td>{}</td></tr>", escape(&plugin.name), escape(&plugin.content_hash[..12]), handlers.join(", "));
    }
    body.push_str("</table>");
    let refusals = api.plugins.refusals();
    if !refusals.is_empty() {
        body.push_str("<h3>Refused files</h3><table id=\"refused\"><tr><th>file</th><th>why</th></tr>");
        for (file, why) in &refusals {
            let _ = write!(body, "<tr><td>{}</td><td class=\"warn\">{}</td></tr>", escape(file), escape(why));
        }
        body.push_str("</table>");
    }

    body.push_str("<h2>Hosts and lanes</h2><table id=\"hosts\"><tr><th>host</th><th>announced until</th><th>lanes held</th><th>deliveries listed</th></tr>");
    for (host, until) in &membership.hosts {
        let held: Vec<_> = membership.lanes.iter().filter(|l| l.holder.as_deref() == Some(host.as_str())).collect();
        let listed: usize = held.iter().map(|l| l.in_flight).sum();
        let _ = write!(body, "<tr><td>{}</td><td>{}</td><td>{}</td><td>{listed}</td></tr>", escape(host), escape(&shown(*until)), held.len());
    }
    body.push_str("</table>");
    page("relayhost", &body).into_response()
}

/// After an action: back to the overview, saying what happened.
fn done(outcome: Result<String, String>) -> Response {
    match outcome {
        Ok(message) => page("relayhost", &format!("<p id=\"outcome\">{}</p><p><a href=\"/\">Back</a></p>", escape(&message))).into_response(),
        Err(message) => (StatusCode::CONFLICT, page("relayhost", &format!("<p id=\"outcome\" class=\"dead\">{}</p><p><a href=\"/\">Back</a></p>", escape(&message))))
            .into_response(),
    }
}

pub(super) async fn requeue(State(served): State<Served>, Path(id): Path<String>) -> Response {
    done(served.api.store.requeue(&id, DateTime::now()).await.map(|()| format!("Requeued {id}: it runs again.")).map_err(|e| e.to_string()))
}

pub(super) async fn bury(State(served): State<Served>, Path(id): Path<String>) -> Response {
    done(bury_by_operator(&*served.api.store, &id, "buried from the dashboard").await.map(|_| format!("Buried {id}.")).map_err(|e| e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn everything_shown_is_escaped() {
        assert_eq!(escape("<script>alert('x')</script> & \"q\""), "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt; &amp; &quot;q&quot;");
        assert_eq!(escape("line\r\nbreak\u{1b}"), "line\\r\\nbreak\\u{1b}");
    }
}
