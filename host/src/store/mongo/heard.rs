//! What a host's change stream heard: the events inserted since, kept (bounded in number, and
//! each under 1 MiB) for the next fan-out that hands out, and how often events may have been
//! missed. It must never decide anything: the fan-out checks every heard event in its
//! transaction and reads the collection whenever the stream may have missed some.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use bson::Document;

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
}

/// At most this many heard events are kept; more means a backlog, which reading serves.
const HEARD_MAX: usize = 256;

impl Default for Heard {
    fn default() -> Self {
        Self { events: Mutex::new(Vec::new()), misses: AtomicU64::new(1), read_through: AtomicU64::new(0) }
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

    /// Notes that a read which started when `misses` was `since` did or did not read to the
    /// end of the unfanned events.
    pub(super) fn read(&self, since: u64, to_the_end: bool) {
        if to_the_end {
            self.read_through.fetch_max(since, Ordering::SeqCst);
        } else {
            self.missed_some();
        }
    }
}
