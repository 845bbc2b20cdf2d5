//! Operator actions on every delivery a filter matches, for the command line and the admin
//! API alike: count first, then act one delivery at a time (each its own fenced store
//! operation, so a bulk action never holds a lane or a key longer than one of them would).

use bson::DateTime;

use crate::dispatch::bury_by_operator;
use crate::store::{DeliveryFilter, DeliveryStatus, DeliveryView, Store, StoreError};

/// The most deliveries one bulk action reads; narrow the filters for more.
pub const MOST: usize = 100_000;

/// What a bulk action found and did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BulkReport {
    pub matched: usize,
    pub done: usize,
    /// The deliveries it could not change, with why (a lease, a race).
    pub refused: Vec<(String, String)>,
}

/// Every delivery `filter` matches, page by page (at most `most`).
pub async fn matching<S: Store>(store: &S, mut filter: DeliveryFilter, most: usize) -> Result<Vec<DeliveryView>, StoreError> {
    filter.limit = 1_000;
    let mut all = Vec::new();
    loop {
        let page = store.list_deliveries(&filter).await?;
        all.extend(page.deliveries);
        match page.next {
            Some(next) if all.len() < most => filter.after = Some(next),
            _ => {
                all.truncate(most);
                return Ok(all);
            }
        }
    }
}

/// Requeues the dead deliveries `filter` matches (its status is set to dead); with `act`
/// false, only counts them.
pub async fn requeue<S: Store>(store: &S, filter: DeliveryFilter, act: bool) -> Result<BulkReport, StoreError> {
    let found = matching(store, DeliveryFilter { status: Some(DeliveryStatus::Dead), ..filter }, MOST).await?;
    let mut report = BulkReport { matched: found.len(), ..BulkReport::default() };
    if act {
        for delivery in &found {
            match store.requeue(&delivery.id, DateTime::now()).await {
                Ok(()) => report.done += 1,
                Err(error) => report.refused.push((delivery.id.clone(), error.to_string())),
            }
        }
    }
    Ok(report)
}

/// Buries the pending deliveries `filter` matches that no live lease lists, each death
/// announced; with `act` false, only counts them. One whose lane is leased meanwhile is
/// refused, naming the host and until when.
pub async fn bury<S: Store>(store: &S, filter: DeliveryFilter, reason: &str, act: bool) -> Result<BulkReport, StoreError> {
    let filter = DeliveryFilter { status: Some(DeliveryStatus::Pending), running: Some(false), ..filter };
    let found = matching(store, filter, MOST).await?;
    let mut report = BulkReport { matched: found.len(), ..BulkReport::default() };
    if act {
        for delivery in &found {
            match bury_by_operator(store, &delivery.id, reason).await {
                Ok(_) => report.done += 1,
                Err(error) => report.refused.push((delivery.id.clone(), error.to_string())),
            }
        }
    }
    Ok(report)
}
