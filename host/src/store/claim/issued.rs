//! The leases a `Claimer` issued and has not seen settled: the one function that issues a
//! lease, whatever the work came from ([`Claimer::issue_leases`]), what the record of issued
//! leases answers (whether a lease is current here, the event of one without a document), and
//! how leases settle. It must never write the store: the claim and the outcomes do.

use super::*;

/// A lease this instance handed out and has not seen settled.
#[derive(Debug, Clone)]
pub(super) struct Issued {
    pub(super) lease: Lease,
    /// The `now` of the claim that issued it.
    pub(super) at: DateTime,
    pub(super) key: Option<HandlerKey>,
    /// Its handler and [`Candidate::group`], if it has one.
    pub(super) group: Option<HandlerKey>,
    pub(super) unstored: Option<Unstored>,
}

/// An issued lease's delivery that has no document (see [`Candidate::unstored`]).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Unstored {
    pub event: HandOutOf,
    pub handler: String,
    /// Its event's ordering key, if it has one.
    pub key: Option<String>,
}

impl Claimer {
    /// Issues the leases of `picks`, each in its lane at the epoch given, counted as issued
    /// at `now` and handed out with its event: the one place a lease is made, whatever the
    /// work came from (a claim's picks, in named lanes or a search of free ones, or a
    /// fan-out's fresh batch, see [`Claimer::hand_out`]). `before_commit` is the word of the
    /// fan-out commit the leases were issued before, if they were (see
    /// [`ClaimedDelivery::before_commit`]).
    pub(super) fn issue_leases(
        &self,
        picks: impl IntoIterator<Item = (Candidate, i64, EventRecord)>,
        before_commit: Option<&FanOutCommit>,
        now: DateTime,
    ) -> Vec<ClaimedDelivery> {
        let mut issued = self.issued.lock().expect("issued leases");
        picks
            .into_iter()
            .map(|(pick, epoch, event)| {
                let lease = Lease { delivery: pick.id, lane: pick.lane, epoch, claims: pick.claims };
                let key = pick.handler_key();
                let group = pick.group.clone().map(|group| (pick.handler.clone(), group));
                let unstored = pick.unstored.map(|event| Unstored { event, handler: pick.handler.clone(), key: pick.key.clone() });
                issued.insert(pick.id, Issued { lease, at: now, key, group, unstored });
                ClaimedDelivery {
                    lease,
                    handler: pick.handler,
                    attempts: pick.attempts,
                    event,
                    started: pick.started,
                    suspect: pick.suspect,
                    before_commit: before_commit.cloned(),
                }
            })
            .collect()
    }

    /// Has `plan` keep to `per_key`, counting the keys ([`Candidate::group`]) of what runs in
    /// the held lanes `mine` as issued here: those lanes are the keys' only lanes. Nothing is
    /// counted when no handler has such a limit.
    pub(super) fn limit_keys(&self, plan: &mut Plan, per_key: &KeyLimits, mine: &BTreeMap<LaneId, HeldLane>) {
        if per_key.is_empty() {
            return;
        }
        let issued = self.issued.lock().expect("issued leases");
        let running = mine.values().flat_map(|lane| lane.running.iter()).filter_map(|entry| issued.get(&entry.delivery)?.group.clone());
        plan.limit_keys(per_key.clone(), running.collect());
    }

    /// Whether this instance issued exactly this lease and has not seen it settled. A lease
    /// it cannot have issued is refused without a database call.
    pub fn issued(&self, lease: &Lease) -> bool {
        self.issued.lock().expect("issued leases").get(&lease.delivery).map(|issued| &issued.lease) == Some(lease)
    }

    /// The event of an issued lease whose delivery has no document (see
    /// [`Candidate::unstored`]).
    pub fn unstored(&self, lease: &Lease) -> Option<Unstored> {
        let issued = self.issued.lock().expect("issued leases");
        issued.get(&lease.delivery).filter(|issued| issued.lease == *lease).and_then(|issued| issued.unstored.clone())
    }

    /// Counts `leases` as settled: they run no more, and their keys may have moved on.
    pub fn settled<'a>(&self, leases: impl IntoIterator<Item = &'a Lease>) {
        self.count_settled(leases, false);
    }

    /// Counts `leases` as completed by this instance: settled, and their deliveries gone.
    pub fn completed<'a>(&self, leases: impl IntoIterator<Item = &'a Lease>) {
        self.count_settled(leases, true);
    }

    fn count_settled<'a>(&self, leases: impl IntoIterator<Item = &'a Lease>, completed: bool) {
        let mut issued = self.issued.lock().expect("issued leases");
        let mut moved = Vec::new();
        for lease in leases {
            if issued.get(&lease.delivery).map(|issued| &issued.lease) == Some(lease) {
                if let Some(key) = issued.remove(&lease.delivery).and_then(|issued| issued.key) {
                    moved.push((key, lease.delivery));
                }
            }
        }
        drop(issued);
        if !completed {
            self.forget_heads(moved.iter().map(|(key, _)| key.clone()));
        }
        if !moved.is_empty() {
            let (keys, behind) = &mut *self.moved_keys.lock().expect("moved keys");
            for (key, delivery) in moved {
                keys.insert(key);
                behind.push(Settled { delivery, completed });
            }
        }
    }
}
