//! What the operator's commands read and get back from a store: statistics per handler,
//! filtered pages of deliveries, and what a purge deleted. It owns these shapes and their
//! paging rules; it must never read or write a store itself.

use bson::DateTime;
use bson::oid::ObjectId;

use super::{DeliveryId, DeliveryStatus, StoreError};

/// What a purge deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PurgeReport {
    pub dead_deliveries: u64,
    pub history_records: u64,
    pub events: u64,
    /// Counters of keys none of whose events remain.
    pub key_counters: u64,
}

/// Counts of one handler's deliveries.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HandlerStatistics {
    pub handler: String,
    /// Unfinished and not running (parked ones included).
    pub pending: u64,
    /// Listed by a live lease.
    pub running: u64,
    /// Waiting in the parked lane behind an unfinished predecessor.
    pub parked: u64,
    pub dead: u64,
    /// Known only with completion history.
    pub completed: Option<u64>,
    /// Earliest due time of an unfinished delivery.
    pub oldest_due_at: Option<DateTime>,
}

/// A delivery's state as operators name it, for a [`DeliveryFilter`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listed {
    /// Unfinished: waiting, parked or running.
    Pending,
    /// Listed by a live lease: running, or claimed ahead of a run slot.
    Running,
    /// Waiting behind an unfinished delivery of its key.
    Parked,
    Dead,
}

impl Listed {
    pub fn parse(text: &str) -> Result<Self, String> {
        match text {
            "pending" => Ok(Self::Pending),
            "running" => Ok(Self::Running),
            "parked" => Ok(Self::Parked),
            "dead" => Ok(Self::Dead),
            other => Err(format!("status {:?} is none of pending, running, parked, dead", other.chars().take(32).collect::<String>())),
        }
    }

    /// `filter`, narrowed to this state.
    pub fn narrow(self, filter: DeliveryFilter) -> DeliveryFilter {
        let pending = Some(super::DeliveryStatus::Pending);
        match self {
            Self::Pending => DeliveryFilter { status: pending, ..filter },
            Self::Running => DeliveryFilter { status: pending, running: Some(true), ..filter },
            Self::Parked => DeliveryFilter { status: pending, parked: Some(true), ..filter },
            Self::Dead => DeliveryFilter { status: Some(super::DeliveryStatus::Dead), ..filter },
        }
    }

    /// The state of a listed delivery.
    pub fn of(view: &DeliveryView) -> Self {
        match (view.status, view.running, view.lane.as_str()) {
            (super::DeliveryStatus::Dead, _, _) => Self::Dead,
            (_, true, _) => Self::Running,
            (_, _, "parked") => Self::Parked,
            _ => Self::Pending,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Running => "running",
            Self::Parked => "parked",
            Self::Dead => "dead",
        }
    }
}

/// Filters for [`Administration::list_deliveries`](super::Administration::list_deliveries). Every field is matched as a literal string.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeliveryFilter {
    pub status: Option<DeliveryStatus>,
    pub handler: Option<String>,
    pub event_type: Option<String>,
    pub event_id: Option<String>,
    pub key: Option<String>,
    /// Listed by a live lease (running, or claimed ahead of a run slot), or not.
    pub running: Option<bool>,
    /// Waiting parked behind an unfinished delivery of its key, or not.
    pub parked: Option<bool>,
    /// Created before this.
    pub created_before: Option<DateTime>,
    /// Continue after this delivery id (the `next` of the previous page).
    pub after: Option<String>,
    /// Page size; 0 means 100. At most 1,000.
    pub limit: usize,
}

/// A delivery as operators see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliveryView {
    pub id: String,
    pub event_id: String,
    pub event_type: String,
    pub handler: String,
    pub key: Option<String>,
    pub sequence: Option<i64>,
    /// The key a handler limited per key counts it by (`per_key`), if it has one.
    pub limit_key: Option<String>,
    /// Its priority among its handler's deliveries, for a handler that takes priorities per
    /// event (`priority_from`).
    pub priority: Option<i32>,
    pub status: DeliveryStatus,
    /// `ready`, `parked` or `dead`.
    pub lane: String,
    pub lane_id: u8,
    pub attempts: u32,
    pub due_at: DateTime,
    pub created_at: DateTime,
    pub updated_at: Option<DateTime>,
    pub last_error: Option<String>,
    /// Listed by a live lease when it was read.
    pub running: bool,
}

/// One page of deliveries.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeliveryPage {
    pub deliveries: Vec<DeliveryView>,
    /// Pass as `after` to read the next page; `None` at the end.
    pub next: Option<String>,
}

impl DeliveryFilter {
    /// The page size to use: 0 means 100, and at most 1,000.
    pub(crate) fn page_limit(&self) -> usize {
        match self.limit {
            0 => 100,
            n => n.min(1_000),
        }
    }

    /// The parsed `after` cursor; anything but a delivery id is refused.
    pub(crate) fn after_id(&self) -> Result<Option<DeliveryId>, StoreError> {
        self.after
            .as_deref()
            .map(|after| {
                ObjectId::parse_str(after)
                    .map_err(|_| StoreError::InvalidArgument(format!("`after` {after:?} is not a delivery id")))
            })
            .transpose()
    }
}

impl DeliveryPage {
    /// A page from up to `limit + 1` deliveries read in id order: the extra one only says that
    /// there is a next page.
    pub(crate) fn from_overfetch(mut deliveries: Vec<DeliveryView>, limit: usize) -> Self {
        let next = if deliveries.len() > limit {
            deliveries.truncate(limit);
            deliveries.last().map(|d| d.id.clone())
        } else {
            None
        };
        Self { deliveries, next }
    }
}

/// What the store knows of one event: its document as stored (the host's marks included),
/// and, with completion history, which handlers completed it and when.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EventHistory {
    pub event: Option<bson::Document>,
    pub completions: Vec<(String, DateTime)>,
}

/// Who holds what: the live hosts and the 256 lanes, as operators see them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Membership {
    /// Each live host, until when its announcement holds.
    pub hosts: Vec<(String, DateTime)>,
    pub lanes: Vec<LaneView>,
}

/// One lane: its holder while its lease is live, until when, and how many deliveries it lists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaneView {
    pub lane: u8,
    pub holder: Option<String>,
    pub lease_expires_at: DateTime,
    pub epoch: i64,
    pub in_flight: usize,
}
