//! Events named suspect for a handler (`suspects`, see [`field::SUSPECTS`]): a takeover found
//! a keyed run listed as started in a lane of a dead host and the event still unfanned, so the
//! run was handed out before its fan-out committed (which brings its document), which it never
//! did, and the host may have died of it. Nothing names that run to charge; the event's next
//! fan-out gives the delivery a document, suspect, for a claim, which records its start before
//! it runs, so that a crash loop is charged from its next death. This module only writes the
//! names, once the event is free; it never names a fanned out event. (A run without a
//! document is named in the takeover's own transaction instead, see `unstored::materialize`:
//! there the name is what keeps a late fan-out from listing it nowhere.)

use std::collections::BTreeMap;
use std::time::Duration;

use bson::{Bson, doc};

use super::MongoStore;
use crate::event::field;

/// How long a takeover waits for its writes before it leaves them to land on their own: less
/// than a claim gives a charge it tries again (`CHARGE_RETRY_WAIT`, 200 ms), so a held event
/// never makes such a retry fail.
const WAIT: Duration = Duration::from_millis(100);

/// Names each `(event, handler)`'s handler among the event's suspects while it is unfanned.
///
/// After the takeover's transaction, not in it: until the dead host's transaction is ended
/// (see `hosts`), it holds the event, and a write waits for it. The takeover waits for these
/// a moment, then leaves them to land when it ends (each applies only to an unfanned event).
pub(super) async fn name(store: &MongoStore, runs: Vec<(Bson, String)>) {
    if runs.is_empty() {
        return;
    }
    let mut by_handler: BTreeMap<String, Vec<Bson>> = BTreeMap::new();
    for (event, handler) in runs {
        by_handler.entry(handler).or_default().push(event);
    }
    let events = store.collections.events.clone();
    let mut writes = tokio::spawn(async move {
        for (handler, ids) in by_handler {
            let filter = doc! { field::ID: { "$in": ids }, field::FANNED_OUT_AT: Bson::Null };
            if let Err(error) = events.update_many(filter, doc! { "$addToSet": { field::SUSPECTS: &handler } }).await {
                tracing::warn!(%error, %handler, "naming the events of runs lost before their fan-out committed failed");
            }
        }
    });
    if tokio::time::timeout(WAIT, &mut writes).await.is_err() {
        tracing::debug!("a takeover's suspect events wait for a dead host's transaction; left to land on their own");
    }
}
