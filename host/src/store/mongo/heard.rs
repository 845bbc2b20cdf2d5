//! What a host's change stream heard: the events inserted since, kept (bounded in number, and
//! each under 1 MiB) for the next fan-out that hands out, and how often events may have been
//! missed. It must never decide anything: the fan-out checks every heard event in its
//! transaction and reads the collection whenever the stream may have missed some.
//!
//! A keyed event needs its key's lower unfanned events in its batch. The heard ones are all of
//! them when nothing was missed since a read that reached the end of the unfanned events
//! under the same split of the lanes ([`Heard::complete_under`]): every event of a key is in
//! its key's lane, so a split that changed may have left a lower one unfanned that an earlier
//! fan-out dropped from the heard ones as another host's.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use bson::Document;

use crate::store::assignment::Assignment;

/// Events the change stream reported inserted, kept for the next fan-out that hands out, so
/// that it need not read them (see `fan_out::run`). A hint only: that fan-out's transaction checks
/// that every one is still unfanned, and reads the collection instead if not.
#[derive(Debug)]
pub(super) struct Heard {
    events: Mutex<Vec<Document>>,
    /// Times unfanned events may have been left that the stream will not report: the host
    /// started, the stream reopened without its history, more were heard than are kept, a
    /// fan-out failed or read a full batch.
    misses: AtomicU64,
    /// The most misses a fan-out that read everything unfanned had seen when it started
    /// reading: while it trails `misses`, reading is needed.
    read_through: AtomicU64,
    /// The split of the lanes the last such read was made under.
    read_under: Mutex<Option<Assignment>>,
}

/// At most this many heard events are kept; more means a backlog, which reading serves.
const HEARD_MAX: usize = 256;

impl Default for Heard {
    fn default() -> Self {
        Self {
            events: Mutex::new(Vec::new()),
            misses: AtomicU64::new(1),
            read_through: AtomicU64::new(0),
            read_under: Mutex::new(None),
        }
    }
}

impl Heard {
    pub fn push(&self, event: Document) {
        let mut events = self.events.lock().expect("heard events");
        if events.len() < HEARD_MAX {
            events.push(event);
        } else {
            events.clear();
            self.missed_some();
        }
    }

    /// How many times events may have been missed so far.
    pub(super) fn misses(&self) -> u64 {
        self.misses.load(Ordering::SeqCst)
    }

    /// Events may have been committed, or left unfanned, that the stream will never report.
    pub fn missed_some(&self) {
        self.misses.fetch_add(1, Ordering::SeqCst);
    }

    pub(super) fn take(&self) -> Vec<Document> {
        std::mem::take(&mut *self.events.lock().expect("heard events"))
    }

    pub(super) fn behind(&self) -> bool {
        self.read_through.load(Ordering::SeqCst) < self.misses.load(Ordering::SeqCst)
    }

    /// Whether the heard events are every unfanned event of this host's lanes under `split`
    /// but those fanned out since: nothing was missed since a read that reached the end under
    /// the same split (see the module doc). Asked after the events were taken.
    pub(super) fn complete_under(&self, split: &Assignment) -> bool {
        let read_under = self.read_under.lock().expect("read under");
        !self.behind() && read_under.as_ref() == Some(split)
    }

    /// Notes that a read which started when `misses` was `since`, under the split `under`
    /// (taken before `since`), did or did not read to the end of the unfanned events.
    pub(super) fn read(&self, since: u64, under: Assignment, to_the_end: bool) {
        if to_the_end {
            let mut read_under = self.read_under.lock().expect("read under");
            if since >= self.read_through.load(Ordering::SeqCst) {
                *read_under = Some(under);
            }
            self.read_through.fetch_max(since, Ordering::SeqCst);
        } else {
            self.missed_some();
        }
    }
}
