//! The filters and updates of lane documents that the claim primitives (`lanes.rs`) send: a
//! free lane, taking one, and the records of lanes a holder holds. Pure: it builds documents
//! and never sends them.

use bson::{Bson, DateTime, Document, doc};

use super::documents::{in_flight_document, lane};
use crate::lane::LaneId;
use crate::store::claim::{Holder, InFlight, LaneRecord};

/// The filter of lane `id` while nobody holds it under a live lease at `now`.
pub(super) fn free_lane(id: LaneId, now: DateTime) -> Document {
    doc! {
        lane::ID: i32::from(id),
        "$or": [{ lane::OWNER: Bson::Null }, { lane::LEASE_EXPIRES_AT: { "$lt": now } }],
    }
}

/// The update that makes `holder` a lane's owner until `until`, at the next epoch, and lists
/// `in_flight` in it if given.
pub(super) fn take_lane(holder: &Holder, until: DateTime, in_flight: Option<&[InFlight]>) -> Document {
    let mut set = doc! { lane::OWNER: &holder.owner, lane::INSTANCE: &holder.instance, lane::LEASE_EXPIRES_AT: until };
    if let Some(in_flight) = in_flight {
        set.insert(lane::IN_FLIGHT, in_flight.iter().map(in_flight_document).collect::<Vec<Document>>());
    }
    doc! { "$set": set, "$inc": { lane::EPOCH: 1_i64 } }
}

/// A record that also takes its lane (see [`LaneRecord::takes_free_at`]).
pub(super) fn take_statement(holder: &Holder, record: &LaneRecord, now: DateTime) -> Document {
    let mut filter = free_lane(record.lane, now);
    filter.insert(lane::EPOCH, record.epoch - 1);
    filter.insert(lane::IN_FLIGHT, doc! { "$size": 0 });
    doc! { "q": filter, "u": take_lane(holder, record.lease_until, Some(&record.in_flight)) }
}

/// The records of lanes the holder holds, all in one statement: each lane is matched at its
/// record's epoch and gets its record's list, with its lease extended to the record's end.
/// `mongod` plans every statement of a write command on its own, and the 256 lane documents
/// share a page, so a statement per lane cost about three times the writes themselves
/// (measured: a hand-out writes a lane for most of its deliveries). The values are looked up
/// by the lane's position in `ids`; the lists are literals, so an entry's strings (event ids,
/// keys) are never read as field paths.
///
/// One lane's record (a hand-out of one event: the way from a commit to its handler) is a
/// plain update instead, which `mongod` runs without evaluating a pipeline: about 0.1 ms less
/// latency, measured (`docs/performance.md`).
pub(super) fn held_statement(holder: &Holder, records: &[&LaneRecord]) -> Option<Document> {
    if records.is_empty() {
        return None;
    }
    if let [record] = records {
        return Some(doc! {
            "q": { lane::ID: i32::from(record.lane), lane::OWNER: &holder.owner, lane::INSTANCE: &holder.instance, lane::EPOCH: record.epoch },
            "u": {
                "$set": { lane::IN_FLIGHT: record.in_flight.iter().map(in_flight_document).collect::<Vec<Document>>() },
                "$max": { lane::LEASE_EXPIRES_AT: record.lease_until },
            },
        });
    }
    let ids: Vec<i32> = records.iter().map(|record| i32::from(record.lane)).collect();
    let epochs: Vec<i64> = records.iter().map(|record| record.epoch).collect();
    let untils: Vec<DateTime> = records.iter().map(|record| record.lease_until).collect();
    let lists: Vec<Vec<Document>> =
        records.iter().map(|record| record.in_flight.iter().map(in_flight_document).collect()).collect();
    let of_lane = |values: Bson| doc! { "$arrayElemAt": [values, { "$indexOfArray": [&ids, format!("${}", lane::ID)] }] };
    Some(doc! {
        "q": {
            lane::ID: { "$in": &ids },
            lane::OWNER: &holder.owner,
            lane::INSTANCE: &holder.instance,
            "$expr": { "$eq": [format!("${}", lane::EPOCH), of_lane(Bson::from(epochs))] },
        },
        "u": [{
            "$set": {
                lane::IN_FLIGHT: of_lane(Bson::from(doc! { "$literal": lists })),
                lane::LEASE_EXPIRES_AT: { "$max": [format!("${}", lane::LEASE_EXPIRES_AT), of_lane(Bson::from(untils))] },
            },
        }],
        "multi": true,
    })
}
