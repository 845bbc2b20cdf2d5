//! The free-lane search of the MongoDB store's claim ([`ClaimBackend::free_lanes_with_due_work`]):
//! which lanes nobody holds have due work of the claim's handlers, first in the claim's order
//! (the oldest work, or the highest priority). It reads lanes and the claim indexes, never
//! writes.
//!
//! [`ClaimBackend::free_lanes_with_due_work`]: crate::store::claim::ClaimBackend::free_lanes_with_due_work

use std::collections::HashMap;

use bson::{Bson, DateTime, Document, doc};
use futures::TryStreamExt;
use futures::future::try_join_all;

use super::MongoStore;
use super::documents::{self, delivery, entry, lane};
use crate::lane::{LaneId, MAX_LANES_PER_QUERY};
use crate::store::StoreError;
use crate::store::claim::{DueWork, MIN_ROWS_PER_LANE_QUERY, ReadOrder};

/// Up to `count` free lanes with due work of `handlers`, each with how much of it was seen;
/// about `wanted` rows are read (see the trait's contract).
pub(super) async fn free_lanes_with_due_work(
    store: &MongoStore,
    handlers: &[String],
    due: DueWork<'_>,
    count: usize,
    wanted: usize,
) -> Result<Vec<(LaneId, usize)>, StoreError> {
    let now = due.before;
    // Only the lanes that are not plainly free and idle come back: those held under a live
    // lease, and those listing anything in flight. Every lane has a document (setup seeds
    // them all), so the others are free with nothing listed: a search reads a few lane
    // documents, not all 256.
    let listed: HashMap<LaneId, Document> = store
        .collections
        .lanes
        .find(doc! { "$or": [
            { lane::OWNER: { "$ne": Bson::Null }, lane::LEASE_EXPIRES_AT: { "$not": { "$lt": now } } },
            { format!("{}.0", lane::IN_FLIGHT): { "$exists": true } },
        ] })
        .projection(doc! {
            lane::ID: 1,
            lane::OWNER: 1,
            lane::LEASE_EXPIRES_AT: 1,
            format!("{}.{}", lane::IN_FLIGHT, entry::EVENT): 1,
            format!("{}.{}", lane::IN_FLIGHT, entry::HANDLER): 1,
        })
        .batch_size(u32::from(crate::lane::LANE_COUNT) + 1)
        .await?
        .try_collect::<Vec<Document>>()
        .await?
        .into_iter()
        .map(|document| Ok((documents::lane_id(&document, lane::ID)?, document)))
        .collect::<Result<_, StoreError>>()?;
    let mut free = Vec::new();
    // Lanes whose last holder left deliveries without a document in flight: nothing in
    // the claim index shows that work, and it is the oldest there is (it was running).
    let mut lanes: Vec<(LaneId, usize)> = Vec::with_capacity(count);
    for id in 0..=LaneId::MAX {
        if due.exclude.contains(&id) {
            continue;
        }
        let Some(document) = listed.get(&id) else {
            free.push(i32::from(id));
            continue;
        };
        let owned = !matches!(document.get(lane::OWNER), None | Some(Bson::Null));
        let lapsed = document.get_datetime(lane::LEASE_EXPIRES_AT).is_ok_and(|until| *until < now);
        if owned && !lapsed {
            continue;
        }
        let stranded = match document.get(lane::IN_FLIGHT) {
            Some(Bson::Array(entries)) => entries
                .iter()
                .filter_map(Bson::as_document)
                .filter(|listed| {
                    listed.contains_key(entry::EVENT)
                        && listed.get_str(entry::HANDLER).is_ok_and(|h| handlers.iter().any(|x| x == h))
                })
                .count(),
            _ => 0,
        };
        if stranded > 0 && lanes.len() < count {
            lanes.push((id, stranded));
        } else {
            free.push(i32::from(id));
        }
    }
    // Most searches find little or nothing due: a host with spare run slots, a hot key's
    // lane the only busy one. One claim-index scan over all the free lanes answers those
    // (fewer rows than it may return: it saw every due row), where the merge below costs
    // `mongod` milliseconds per call whatever it finds.
    // This host's free lanes and other hosts' count work due by different times: each
    // group is read on its own, the groups at once.
    let (mine, others): (Vec<i32>, Vec<i32>) = free.iter().partition(|id| !due.others.contains(&(**id as LaneId)));
    let groups: Vec<(Vec<i32>, DateTime)> = [(mine, due.before), (others, due.before.min(due.others_before))]
        .into_iter()
        .filter(|(lanes, _)| !lanes.is_empty())
        .collect();
    let by_priority = due.order == ReadOrder::Priority;
    let due_in = |lanes: &[i32], before: DateTime| {
        let mut filter = doc! {
            delivery::LANE: delivery::READY,
            delivery::LANE_ID: { "$in": lanes },
            delivery::DUE_AT: { "$lte": before },
            delivery::HANDLER: { "$in": handlers },
        };
        match (by_priority, due.above) {
            (true, Some(above)) => filter.insert(delivery::PRIORITY, doc! { "$gt": above }),
            (true, None) => filter.insert(delivery::PRIORITY, doc! { "$exists": true }),
            (false, _) => None,
        };
        filter
    };
    let (order, index) = if by_priority {
        (doc! { delivery::PRIORITY: -1, delivery::DUE_AT: 1, delivery::ID: 1 }, super::setup::CLAIM_BY_PRIORITY)
    } else {
        (doc! { delivery::DUE_AT: 1, delivery::ID: 1 }, "claim")
    };
    let deliveries = &store.collections.deliveries;
    let read = |filter: Document, sorted: bool, limit: usize| {
        let order = order.clone();
        async move {
            let rows: Vec<Document> = deliveries
                .find(filter)
                .sort(if sorted { order } else { doc! {} })
                .projection(doc! { delivery::LANE_ID: 1, delivery::DUE_AT: 1, delivery::PRIORITY: 1, delivery::ID: 0 })
                .limit(limit as i64)
                .batch_size(super::documents::one_batch(limit))
                .hint(mongodb::options::Hint::Name(index.to_string()))
                .await?
                .try_collect()
                .await?;
            Ok::<_, StoreError>(rows)
        }
    };
    let few = try_join_all(groups.iter().map(|(lanes, before)| read(due_in(lanes, *before), false, MIN_ROWS_PER_LANE_QUERY))).await?;
    // Otherwise the oldest due entries of the group's lanes, read as a merge of one
    // claim-index scan per lane: the cost grows with the number of lanes and rows read,
    // never with the backlog. A lane with a deep old backlog can fill the rows alone; then
    // this round yields fewer lanes, and that lane has enough work for the claim anyway.
    let rows_wanted = (wanted * 2).clamp(MIN_ROWS_PER_LANE_QUERY, 1_000);
    let merged = groups.iter().zip(few).map(|((lanes, before), few)| async move {
        if few.len() < MIN_ROWS_PER_LANE_QUERY {
            return Ok::<_, StoreError>(few);
        }
        let chunks = try_join_all(lanes.chunks(MAX_LANES_PER_QUERY).map(|chunk| read(due_in(chunk, *before), true, rows_wanted)));
        Ok(chunks.await?.concat())
    });
    let chunks = try_join_all(merged).await?;
    // In the claim's order: the highest priority first (by priority), then the oldest.
    let mut oldest: Vec<(std::cmp::Reverse<i64>, DateTime, LaneId)> = Vec::new();
    for row in chunks.iter().flatten() {
        let due = *row.get_datetime(delivery::DUE_AT).map_err(|_| StoreError::Corrupt(format!("delivery {row}")))?;
        let priority = if by_priority { documents::integer(row, delivery::PRIORITY).unwrap_or(i64::MIN) } else { 0 };
        oldest.push((std::cmp::Reverse(priority), due, documents::lane_id(row, delivery::LANE_ID)?));
    }
    oldest.sort();
    for (_, _, lane) in oldest {
        match lanes.iter().position(|(id, _)| *id == lane) {
            Some(index) => lanes[index].1 += 1,
            None if lanes.len() < count => lanes.push((lane, 1)),
            None => {}
        }
    }
    Ok(lanes)
}
