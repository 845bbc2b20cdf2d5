//! What a plugin hands the host, bounded before the host keeps, stores or repeats it: its
//! file (size, and that it is a WebAssembly binary at all), its subscriptions (how many, and
//! printable names), the failure reasons it returns, and how much of any of it an error may
//! quote. A plugin is untrusted: its words reach logs, documents and dead letters, so their
//! size is the operator's to bound, never the plugin's.
//!
//! This module owns those bounds. It must never load, compile or run anything.

use std::collections::BTreeSet;
use std::path::Path;

use super::Subscription;

/// The largest plugin file the host reads: a Python or JavaScript component with its
/// interpreter is tens of MiB.
pub const MAX_PLUGIN_FILE_BYTES: u64 = 256 << 20;

/// Reads a plugin file, refusing one over [`MAX_PLUGIN_FILE_BYTES`] (before reading it, where
/// its size is known) and one that is not a WebAssembly binary. A refusal never quotes the
/// content: the file may be anything an operator's directory holds, or a link to a secret.
pub fn read_plugin_file(path: &Path) -> Result<Vec<u8>, String> {
    let file = std::fs::File::open(path).map_err(|e| format!("cannot read it: {}", e.kind()))?;
    let size = file.metadata().map_err(|e| format!("cannot read it: {}", e.kind()))?.len();
    let over = |size: u64| format!("it is {size} bytes or more, over the {MAX_PLUGIN_FILE_BYTES} bytes a plugin file may have");
    if size > MAX_PLUGIN_FILE_BYTES {
        return Err(over(size));
    }
    // Some files say they are empty and are not (`/proc`): read no more than the limit.
    let mut bytes = Vec::with_capacity(size as usize);
    std::io::Read::read_to_end(&mut std::io::Read::take(file, MAX_PLUGIN_FILE_BYTES + 1), &mut bytes)
        .map_err(|e| format!("cannot read it: {}", e.kind()))?;
    if bytes.len() as u64 > MAX_PLUGIN_FILE_BYTES {
        return Err(over(bytes.len() as u64));
    }
    if !bytes.starts_with(b"\0asm") {
        return Err("it is not a WebAssembly binary (a component starts with the bytes \\0asm; its content is not shown)".into());
    }
    Ok(bytes)
}

/// `reason` as the host keeps it: at most `max` bytes, cut at a character boundary and saying
/// how long it was. A plugin's words are stored and repeated (in `lastError` and its dead
/// letter), so their size is the operator's to bound, never the plugin's.
pub(super) fn cut(reason: String, max: usize) -> String {
    if reason.len() <= max {
        return reason;
    }
    let note = format!(" [cut: {} bytes in all]", reason.len());
    let mut end = max.saturating_sub(note.len());
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{note}", &reason[..end])
}

/// The most handlers one plugin may subscribe (by default: the operator may set a plugin's
/// `handlers` up to [`MAX_HANDLERS_LIMIT`]), and event types one handler may: every claim
/// names the handlers a host serves, and every fan-out looks up each event's type.
pub const MAX_HANDLERS_PER_PLUGIN: usize = 100;
/// The most handlers an operator may let one plugin subscribe.
pub const MAX_HANDLERS_LIMIT: usize = 1_000;
pub const MAX_EVENT_TYPES_PER_HANDLER: usize = 100;

/// The longest event type a handler may subscribe (the events' own limit).
const MAX_EVENT_TYPE_CHARS: usize = 256;

/// A string a plugin handed over, as an error may quote it: its first 64 characters at most.
fn shown(text: &str) -> String {
    let head: String = text.chars().take(64).collect();
    if head.len() < text.len() { format!("{head:?}...") } else { format!("{head:?}") }
}

pub(super) fn validate_subscriptions(subscriptions: Vec<Subscription>, max_handlers: usize) -> Result<Vec<Subscription>, String> {
    if subscriptions.is_empty() {
        return Err("it subscribes no handler".to_string());
    }
    if subscriptions.len() > max_handlers {
        return Err(format!("it subscribes {} handlers, over the {max_handlers} it may (its `handlers` limit)", subscriptions.len()));
    }
    let printable = |text: &str, max: usize| !text.is_empty() && text.chars().count() <= max && !text.chars().any(char::is_control);
    let mut seen = BTreeSet::new();
    let mut result = Vec::with_capacity(subscriptions.len());
    for subscription in subscriptions {
        let handler = subscription.handler;
        if !printable(&handler, crate::store::MAX_HANDLER_CHARS) {
            return Err(format!("handler id {} must be 1-{} printable characters", shown(&handler), crate::store::MAX_HANDLER_CHARS));
        }
        if handler == crate::store::MALFORMED_EVENT_HANDLER {
            return Err(format!("handler id {handler:?} is reserved"));
        }
        if !seen.insert(handler.clone()) {
            return Err(format!("handler id {handler:?} is subscribed twice"));
        }
        let types = &subscription.event_types;
        if types.is_empty() || types.len() > MAX_EVENT_TYPES_PER_HANDLER {
            return Err(format!("handler {handler:?} must subscribe 1-{MAX_EVENT_TYPES_PER_HANDLER} event types"));
        }
        if let Some(bad) = types.iter().find(|t| !printable(t, MAX_EVENT_TYPE_CHARS)) {
            return Err(format!("handler {handler:?} subscribes event type {}: it must be 1-{MAX_EVENT_TYPE_CHARS} printable characters", shown(bad)));
        }
        result.push(Subscription { handler, event_types: subscription.event_types, transactional: subscription.transactional });
    }
    Ok(result)
}

#[cfg(test)]
mod tests {
    use super::{MAX_HANDLERS_PER_PLUGIN, cut, validate_subscriptions};
    use crate::plugin::Subscription;

    fn validate_subscriptions_default(subscriptions: Vec<Subscription>) -> Result<Vec<Subscription>, String> {
        validate_subscriptions(subscriptions, MAX_HANDLERS_PER_PLUGIN)
    }

    fn subscription(handler: &str, types: &[&str]) -> Subscription {
        Subscription {
            handler: handler.to_string(),
            event_types: types.iter().map(|t| t.to_string()).collect(),
            transactional: false,
        }
    }

    #[test]
    fn subscriptions_are_bounded_and_printable_and_errors_quote_little() {
        assert!(validate_subscriptions_default(vec![subscription("h", &["order.placed"])]).is_ok());
        let many: Vec<_> = (0..=MAX_HANDLERS_PER_PLUGIN).map(|n| subscription(&format!("h{n}"), &["t"])).collect();
        assert!(validate_subscriptions_default(many.clone()).unwrap_err().contains("101 handlers, over the 100"));
        assert!(validate_subscriptions(many, 101).is_ok(), "the operator's limit");
        for bad in ["a\0b", "line\nbreak", ""] {
            let error = validate_subscriptions_default(vec![subscription("h", &[bad])]).unwrap_err();
            assert!(error.contains("printable characters"), "{error}");
        }
        let types: Vec<String> = (0..101).map(|n| format!("t{n}")).collect();
        let types: Vec<&str> = types.iter().map(String::as_str).collect();
        assert!(validate_subscriptions_default(vec![subscription("h", &types)]).unwrap_err().contains("1-100 event types"));
        let huge = "x".repeat(1_000_000);
        let error = validate_subscriptions_default(vec![subscription(&huge, &["t"])]).unwrap_err();
        assert!(error.len() < 200, "{} bytes", error.len());
    }

    #[test]
    fn a_reason_is_cut_at_a_character_boundary_within_its_limit_and_says_how_long_it_was() {
        assert_eq!(cut("short".into(), 64), "short");
        let long = "é".repeat(1_000);
        let kept = cut(long.clone(), 101);
        assert!(kept.len() <= 101, "{}", kept.len());
        assert!(kept.ends_with(" [cut: 2000 bytes in all]"), "{kept}");
        assert!(long.starts_with(kept.trim_end_matches(" [cut: 2000 bytes in all]")));
    }
}
