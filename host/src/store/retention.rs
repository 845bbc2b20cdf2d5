//! Retention rules shared by both stores' purge.

use bson::{Bson, DateTime, Document};

use super::PurgeOptions;
use crate::event::field;

/// Whether an event nothing references any more may be deleted under `options`.
///
/// An event not fanned out yet is never deleted (no handler has seen it), nor one whose
/// `handedOut` lists a handler (its delivery runs without a document). An event with a
/// completion is a deduplication record until `completed_before` passes its latest completion,
/// however old it is. An event that never had one (no subscribers, only dead letters) goes
/// once it was created before the earliest cutoff given.
pub(crate) fn event_expired(event: &Document, options: &PurgeOptions) -> bool {
    if !matches!(event.get(field::FANNED_OUT_AT), Some(Bson::DateTime(_))) {
        return false;
    }
    // A delivery handed out without a document of its own runs while its handler is listed.
    if matches!(event.get(field::HANDED_OUT), Some(Bson::Array(handlers)) if !handlers.is_empty()) {
        return false;
    }
    match event.get(field::COMPLETED_AT) {
        Some(Bson::DateTime(completed)) => options.completed_before.is_some_and(|cutoff| *completed < cutoff),
        _ => match (earliest_cutoff(options), event.get(field::CREATED_AT)) {
            (Some(cutoff), Some(Bson::DateTime(created))) => *created < cutoff,
            // A malformed event without a readable creation time goes at the first purge with
            // any cutoff: its dead letters carry what operators need.
            (Some(_), _) => true,
            (None, _) => false,
        },
    }
}

pub(crate) fn earliest_cutoff(options: &PurgeOptions) -> Option<DateTime> {
    match (options.dead_before, options.completed_before) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}
