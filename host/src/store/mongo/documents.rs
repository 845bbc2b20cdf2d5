//! Field names and conversions of the store's own MongoDB documents (deliveries, lanes,
//! completion history). Event documents belong to [`crate::event`].

use bson::oid::ObjectId;
use bson::{Bson, DateTime, Document, doc};

use super::super::claim::{Candidate, EventOf, HandOutOf, InFlight, LaneState};
use super::super::fan_out::{NewDelivery, id_text};
use super::super::{DeliveryStatus, DeliveryView, StoreError};
use crate::lane::LaneId;

pub(super) mod delivery {
    pub const ID: &str = "_id";
    pub const EVENT_ID: &str = "eventId";
    pub const EVENT_TYPE: &str = "eventType";
    pub const HANDLER: &str = "handler";
    pub const KEY: &str = "key";
    pub const SEQUENCE: &str = "sequence";
    /// The key of a handler that runs several of one key at once (see `NewDelivery::group`).
    pub const GROUP: &str = "group";
    /// Its priority, of a handler that takes priorities per event (see `NewDelivery::priority`).
    pub const PRIORITY: &str = "priority";
    pub const LANE_ID: &str = "laneId";
    /// The claim lane: `ready` (in the claim index), `parked` or `dead`.
    pub const LANE: &str = "lane";
    pub const STATUS: &str = "status";
    pub const ATTEMPTS: &str = "attempts";
    /// The claim generation; see [`crate::store::Lease`].
    pub const CLAIMS: &str = "claims";
    pub const DUE_AT: &str = "dueAt";
    pub const CREATED_AT: &str = "createdAt";
    pub const UPDATED_AT: &str = "updatedAt";
    pub const LAST_ERROR: &str = "lastError";
    /// Set when a host died while it was claimed ahead, unrecorded: it may have been running
    /// (see `Candidate::suspect`).
    pub const SUSPECT: &str = "suspect";
    /// When an operator last requeued it.
    pub const REQUEUED_AT: &str = "requeuedAt";
    /// A follower created parked: the delivery it was created behind (see
    /// `NewDelivery::behind`); removed when it is unparked.
    pub const BEHIND: &str = "behind";

    pub const READY: &str = "ready";
    pub const PARKED: &str = "parked";
    pub const DEAD: &str = "dead";
    pub const PENDING: &str = "pending";
}

pub(super) mod lane {
    pub const ID: &str = "_id";
    pub const OWNER: &str = "owner";
    pub const INSTANCE: &str = "instance";
    pub const LEASE_EXPIRES_AT: &str = "leaseExpiresAt";
    pub const EPOCH: &str = "epoch";
    pub const IN_FLIGHT: &str = "inFlight";
}

/// The fields of an entry of a lane's `inFlight` list: short, as every lane write rewrites the
/// whole list.
pub(super) mod entry {
    pub const DELIVERY: &str = "d";
    pub const CLAIMS: &str = "c";
    pub const HANDLER: &str = "h";
    pub const KEY: &str = "k";
    /// The event of a delivery handed out without a document.
    pub const EVENT: &str = "e";
    /// The fan-out that handed out a delivery without a document (its event's `fanOut`).
    pub const FAN_OUT: &str = "f";
    /// `false` for a delivery claimed ahead that has not started (absent: started).
    pub const STARTED: &str = "s";
    /// The event of a keyed delivery its fan-out handed out (see `Candidate::before_commit`).
    pub const BEFORE_COMMIT: &str = "b";
}

pub(super) mod history {
    pub const COMPLETED_AT: &str = "completedAt";
}

fn corrupt(what: &str, document: &Document) -> StoreError {
    StoreError::Corrupt(format!("{what}: {document}"))
}

pub(super) fn integer(document: &Document, field: &str) -> Option<i64> {
    match document.get(field)? {
        Bson::Int32(n) => Some(i64::from(*n)),
        Bson::Int64(n) => Some(*n),
        Bson::Double(n) if n.fract() == 0.0 => Some(*n as i64),
        _ => None,
    }
}

fn optional_string(document: &Document, field: &str) -> Option<String> {
    document.get_str(field).ok().map(str::to_string)
}

pub(super) fn new_delivery_document(new: &NewDelivery, now: DateTime) -> Document {
    let dead = new.dead_reason.is_some();
    let mut document = doc! {
        delivery::ID: new.id,
        delivery::EVENT_ID: new.event_id.clone(),
        delivery::EVENT_TYPE: &new.event_type,
        delivery::HANDLER: &new.handler,
        delivery::LANE_ID: i32::from(new.lane),
        delivery::LANE: if dead {
            delivery::DEAD
        } else if new.behind.is_some() {
            delivery::PARKED
        } else {
            delivery::READY
        },
        delivery::STATUS: if dead { delivery::DEAD } else { delivery::PENDING },
        delivery::ATTEMPTS: 0_i32,
        delivery::CLAIMS: 0_i64,
        delivery::DUE_AT: now,
        delivery::CREATED_AT: now,
    };
    if let Some(key) = &new.key {
        document.insert(delivery::KEY, key);
    }
    if let Some(sequence) = new.sequence {
        document.insert(delivery::SEQUENCE, sequence);
    }
    if let Some(group) = &new.group {
        document.insert(delivery::GROUP, group);
    }
    if let Some(priority) = new.priority {
        document.insert(delivery::PRIORITY, priority);
    }
    if let Some(behind) = new.behind {
        document.insert(delivery::BEHIND, behind);
    }
    if new.suspect {
        document.insert(delivery::SUSPECT, true);
    }
    if let Some(reason) = &new.dead_reason {
        document.insert(delivery::LAST_ERROR, reason);
        document.insert(delivery::UPDATED_AT, now);
    }
    document
}

/// The update that unparks a delivery: it leads its key now, so the delivery it was created
/// behind no longer matters (as the memory store clears it). Every unpark writes this.
pub(super) fn unparked() -> Document {
    doc! { "$set": { delivery::LANE: delivery::READY }, "$unset": { delivery::BEHIND: "" } }
}

pub(super) fn lane_id(document: &Document, field: &str) -> Result<LaneId, StoreError> {
    integer(document, field)
        .and_then(|n| LaneId::try_from(n).ok())
        .ok_or_else(|| corrupt("lane id out of range", document))
}

pub(super) fn candidate(document: &Document) -> Result<Candidate, StoreError> {
    Ok(Candidate {
        id: document.get_object_id(delivery::ID).map_err(|_| corrupt("delivery without ObjectId", document))?,
        event_id: id_text(document.get(delivery::EVENT_ID).unwrap_or(&Bson::Null)),
        handler: optional_string(document, delivery::HANDLER).ok_or_else(|| corrupt("delivery without handler", document))?,
        key: optional_string(document, delivery::KEY),
        group: optional_string(document, delivery::GROUP),
        priority: integer(document, delivery::PRIORITY).map(|n| n as i32),
        lane: lane_id(document, delivery::LANE_ID)?,
        due_at: *document.get_datetime(delivery::DUE_AT).map_err(|_| corrupt("delivery without dueAt", document))?,
        claims: integer(document, delivery::CLAIMS).unwrap_or(0),
        attempts: integer(document, delivery::ATTEMPTS).unwrap_or(0).clamp(0, i64::from(u32::MAX)) as u32,
        unstored: None,
        started: false,
        suspect: document.get_bool(delivery::SUSPECT).unwrap_or(false),
        before_commit: None,
    })
}

pub(super) fn in_flight_document(entry: &InFlight) -> Document {
    let mut document = doc! { entry::DELIVERY: entry.delivery, entry::CLAIMS: entry.claims, entry::HANDLER: &entry.handler };
    if let Some(key) = &entry.key {
        document.insert(entry::KEY, key);
    }
    if let Some(HandOutOf { event, fan_out }) = &entry.unstored {
        document.insert(entry::EVENT, event.clone());
        if let Some(fan_out) = fan_out {
            document.insert(entry::FAN_OUT, *fan_out);
        }
    }
    if !entry.started {
        document.insert(entry::STARTED, false);
    }
    if let Some(EventOf(event)) = &entry.before_commit {
        document.insert(entry::BEFORE_COMMIT, event.clone());
    }
    document
}

pub(super) fn lane_state(document: &Document) -> Result<LaneState, StoreError> {
    let in_flight = match document.get(lane::IN_FLIGHT) {
        Some(Bson::Array(entries)) => entries
            .iter()
            .filter_map(Bson::as_document)
            .map(|listed| {
                Ok(InFlight {
                    delivery: listed.get_object_id(entry::DELIVERY).map_err(|_| corrupt("in-flight entry without id", document))?,
                    claims: integer(listed, entry::CLAIMS).unwrap_or(0),
                    handler: optional_string(listed, entry::HANDLER).unwrap_or_default(),
                    key: optional_string(listed, entry::KEY),
                    unstored: listed.get(entry::EVENT).cloned().map(|event| HandOutOf {
                        event,
                        fan_out: listed.get_object_id(entry::FAN_OUT).ok(),
                    }),
                    started: listed.get_bool(entry::STARTED).unwrap_or(true),
                    before_commit: listed.get(entry::BEFORE_COMMIT).cloned().map(EventOf),
                })
            })
            .collect::<Result<Vec<_>, StoreError>>()?,
        _ => Vec::new(),
    };
    Ok(LaneState {
        id: lane_id(document, lane::ID)?,
        owner: optional_string(document, lane::OWNER),
        instance: optional_string(document, lane::INSTANCE),
        lease_expires_at: document.get_datetime(lane::LEASE_EXPIRES_AT).copied().unwrap_or(DateTime::from_millis(0)),
        epoch: integer(document, lane::EPOCH).unwrap_or(0),
        in_flight,
    })
}

pub(super) fn view(document: &Document) -> Result<DeliveryView, StoreError> {
    let id = document.get_object_id(delivery::ID).map_err(|_| corrupt("delivery without ObjectId", document))?;
    let status = match document.get_str(delivery::STATUS) {
        Ok(delivery::DEAD) => DeliveryStatus::Dead,
        _ => DeliveryStatus::Pending,
    };
    Ok(DeliveryView {
        id: id.to_hex(),
        event_id: id_text(document.get(delivery::EVENT_ID).unwrap_or(&Bson::Null)),
        event_type: optional_string(document, delivery::EVENT_TYPE).unwrap_or_default(),
        handler: optional_string(document, delivery::HANDLER).unwrap_or_default(),
        key: optional_string(document, delivery::KEY),
        sequence: integer(document, delivery::SEQUENCE),
        limit_key: optional_string(document, delivery::GROUP),
        priority: integer(document, delivery::PRIORITY).map(|n| n as i32),
        status,
        lane: optional_string(document, delivery::LANE).unwrap_or_default(),
        lane_id: lane_id(document, delivery::LANE_ID)?,
        attempts: integer(document, delivery::ATTEMPTS).unwrap_or(0).clamp(0, i64::from(u32::MAX)) as u32,
        due_at: document.get_datetime(delivery::DUE_AT).copied().unwrap_or(DateTime::from_millis(0)),
        created_at: document.get_datetime(delivery::CREATED_AT).copied().unwrap_or(DateTime::from_millis(0)),
        updated_at: document.get_datetime(delivery::UPDATED_AT).ok().copied(),
        last_error: optional_string(document, delivery::LAST_ERROR),
        running: false,
    })
}

/// A delivery's claim generation; see [`crate::store::Lease`].
pub(super) fn claims(document: &Document) -> i64 {
    integer(document, delivery::CLAIMS).unwrap_or(0)
}

/// A delivery at one claim generation.
pub(super) fn generation_filter(id: ObjectId, claims: i64) -> Document {
    doc! { delivery::ID: id, delivery::CLAIMS: claims }
}

/// A cursor batch size that returns `n` small documents in the first reply, so a batch costs
/// the same number of commands whatever its size.
pub(super) fn one_batch(n: usize) -> u32 {
    u32::try_from(n + 1).unwrap_or(u32::MAX)
}
