//! Backfill: a handler added later gets the older events it never had, through the one
//! fan-out. An event is reopened (its `fannedOutAt` taken away) only when it is fanned out,
//! of one of the handler's types, does not list the handler among those it ever had a delivery
//! for, and has no delivery handed out without a document just now (the next mark would
//! rewrite its `handedOut`). The next fan-outs then plan, as for any event, one delivery per
//! subscribed handler it does not list, in per-key order and bounded batches, beside live
//! traffic; the event lists the handler once marked, so it is never reopened for it again.
//!
//! This module owns which events a backfill may reopen and which wait ([`backfill_of`], the
//! same rule for both stores; MongoDB's filter says it in `mongo/operations.rs`). It never
//! writes a delivery.

use bson::{Bson, DateTime, Document};

use crate::event::field;

/// What a backfill of `handler` over `types` from `since` makes of an event (see the module
/// doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Backfill {
    /// Reopened for the fan-out.
    Reopen,
    /// It would be reopened, but a delivery of it runs without a document just now: it waits
    /// for that run to end.
    Wait,
    /// Not the backfill's: another type, older than `since`, not fanned out yet, or it lists
    /// the handler.
    Leave,
}

/// What a backfill of `handler` over `types` from `since` makes of `event`.
pub(crate) fn backfill_of(event: &Document, handler: &str, types: &[String], since: Option<DateTime>) -> Backfill {
    let fanned = matches!(event.get(field::FANNED_OUT_AT), Some(Bson::DateTime(_)));
    let of_type = event.get_str(field::TYPE).is_ok_and(|t| types.iter().any(|wanted| wanted == t));
    let listed = matches!(event.get(field::HANDLERS), Some(Bson::Array(handlers)) if handlers.iter().any(|h| h.as_str() == Some(handler)));
    let handed_out = matches!(event.get(field::HANDED_OUT), Some(Bson::Array(handlers)) if !handlers.is_empty());
    let recent = since.is_none_or(|since| event.get_datetime(field::CREATED_AT).is_ok_and(|at| *at >= since));
    match fanned && of_type && !listed && recent {
        false => Backfill::Leave,
        true if handed_out => Backfill::Wait,
        true => Backfill::Reopen,
    }
}

/// Whether a backfill of `handler` over `types` from `since` may reopen `event`.
pub(crate) fn may_reopen(event: &Document, handler: &str, types: &[String], since: Option<DateTime>) -> bool {
    backfill_of(event, handler, types, since) == Backfill::Reopen
}

#[cfg(test)]
mod tests {
    use bson::doc;

    use super::*;

    #[test]
    fn an_event_with_a_delivery_handed_out_without_a_document_waits_and_a_listed_handler_never_reopens() {
        let at = DateTime::from_millis(1_000);
        let event = |extra: Document| {
            let mut event = doc! { "_id": "e", "type": "t", "createdAt": at, "fannedOutAt": at, "handlers": ["old"] };
            event.extend(extra);
            event
        };
        let types = ["t".to_string()];
        assert!(may_reopen(&event(doc! {}), "new", &types, None));
        assert!(may_reopen(&event(doc! { "handedOut": [] }), "new", &types, Some(at)));
        assert_eq!(backfill_of(&event(doc! { "handedOut": ["old"] }), "new", &types, None), Backfill::Wait, "its mark would rewrite handedOut");
        assert!(!may_reopen(&event(doc! {}), "old", &types, None), "listed");
        assert!(!may_reopen(&event(doc! {}), "new", &["u".to_string()], None), "another type");
        assert!(!may_reopen(&event(doc! {}), "new", &types, Some(DateTime::from_millis(1_001))), "older than since");
        let mut unfanned = event(doc! {});
        unfanned.remove("fannedOutAt");
        assert!(!may_reopen(&unfanned, "new", &types, None), "not fanned out yet");
    }
}
