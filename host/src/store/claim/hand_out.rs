//! Hand-outs: a fan-out's new deliveries listed in lanes and leased as the fan-out commits
//! them, without a claim. It owns where they are listed (held lanes first; deliveries without
//! a document gathered into the fullest-room held lane) and what a failed hand-out leaves
//! behind for the next claim. It must never pick work a claim would not.

use super::*;

impl Claimer {
    /// Where a hand-out lists `fresh` deliveries (moving those without a document into held
    /// lanes, see [`gather_unstored`]): the records of the held lanes it writes, with the
    /// entries of their lists this instance settled left out, and the free lanes it takes.
    fn list_fresh(&self, held: &BTreeMap<LaneId, Held>, fresh: &mut [Fresh], until: DateTime) -> FreshLists {
        // A listed entry whose lease this instance settled runs no more, and is left out of
        // the list rewritten; so lanes that only hand-outs fill keep short lists.
        let issued = self.issued.lock().expect("issued leases");
        let unsettled = |entry: &&InFlight| issued.get(&entry.delivery).is_some_and(|i| i.lease.claims == entry.claims);
        let events_lanes = fresh.iter().map(|fresh| fresh.candidate.lane).collect();
        // Only into lanes of this host's share: those of another's run empty and go back.
        let assignment = self.assignment();
        let room = |lane: LaneId, listed: &Listed| assignment.is_mine(lane).then(|| listed.in_flight.iter().filter(unsettled).count());
        let gathered = gather_unstored(held, room, fresh);
        let mut by_lane: BTreeMap<LaneId, Vec<InFlight>> = BTreeMap::new();
        for Fresh { candidate, .. } in fresh.iter() {
            by_lane.entry(candidate.lane).or_default().push(candidate.in_flight());
        }
        let mut records = Vec::new();
        let mut to_take = Vec::new();
        for (lane, entries) in &by_lane {
            match held.get(lane) {
                Some(Held { epoch, known: Some(listed) }) => records.push(LaneRecord {
                    lane: *lane,
                    epoch: *epoch,
                    in_flight: listed.in_flight.iter().filter(unsettled).chain(entries).cloned().collect(),
                    lease_until: until,
                    takes_free_at: None,
                }),
                Some(Held { known: None, .. }) => {}
                None => to_take.push((*lane, entries.clone())),
            }
        }
        FreshLists { by_lane, records, to_take, events_lanes, gathered }
    }

    /// Hands out `fresh` deliveries of a fan-out while `write` writes them: lists them in
    /// their lanes' in-flight lists (lanes this instance holds, as it knows them, and free
    /// lanes that run nothing, which the list's write takes) beside the fan-out's first
    /// stage, each acknowledged once applied ([`LaneWrite::Applied`]). `write` is that stage,
    /// the one that makes the fan-out the only one of its events (in MongoDB, the mark), and
    /// resolves to the rest: whatever else it writes, and its commit, given the deliveries
    /// whose leases are issued (a store may leave those without a document, see
    /// [`Candidate::unstored`]; it writes every other one). The leases are issued
    /// once the commit is done, or, given `early`, as soon as the first stage and the lists
    /// are, and sent there, each with the word of the commit to come
    /// ([`ClaimedDelivery::before_commit`]). The way from a commit to its handler is then no
    /// durable write long, not a fan-out's and then a claim's.
    ///
    /// Returns what the commit returned and the deliveries handed out (not those sent early).
    /// Fresh deliveries it does not hand out (their lane is another instance's, or its list is
    /// unknown here, or a claim of this instance is under way and owns the lists, or, for keys'
    /// heads, a takeover was charged since the fan-out's `keys` were taken, see
    /// [`KeysBeforeRead`]) are left to a claim. A list written for a commit that then failed
    /// names deliveries that may not exist: harmless, since only issued leases count as running
    /// here, and the lanes are read again by the next claim.
    pub async fn hand_out<B: ClaimBackend, C, F>(
        &self,
        backend: &B,
        fresh: Vec<Fresh>,
        keys: &KeysBeforeRead,
        write: impl Future<Output = Result<C, StoreError>>,
        early: Option<&EarlyHandOuts>,
        now: DateTime,
    ) -> Result<HandedOut, StoreError>
    where
        C: FnOnce(&HashSet<DeliveryId>) -> F,
        F: Future<Output = Result<(), StoreError>>,
    {
        #[cfg(test)]
        self.held_up(HoldUp::HandOut).await;
        let none = HashSet::new();
        let mut held = match self.held.try_lock() {
            Ok(held) if !fresh.is_empty() => held,
            _ => {
                write.await?(&none).await?;
                return Ok(HandedOut { claimed: Vec::new(), sent_early: Vec::new() });
            }
        };
        let until = self.lease_until(now);
        let mut fresh = fresh;
        // Claims charge takeovers holding the lanes' lock, which this holds now.
        if self.charged_since(keys) {
            fresh.retain(|fresh| fresh.candidate.key.is_none());
        }
        let FreshLists { by_lane, records, to_take, events_lanes, .. } = self.list_fresh(&held, &mut fresh, until);
        // A key's head runs while its lane lists it: that list must survive a failover, or
        // another holder could run the key beside it (an unkeyed delivery run twice is what
        // at-least-once allows). And an operator's requeue of a lower sequence of its key that
        // the fan-out's snapshot missed makes it wait for a claim, as it would a claim's pick.
        let keyed: HashSet<DeliveryId> = fresh.iter().filter(|f| f.candidate.key.is_some()).map(|f| f.candidate.id).collect();
        let lane_write = if keyed.is_empty() { LaneWrite::Applied } else { LaneWrite::Durable };
        let recording = async {
            let record = async {
                if records.is_empty() { Ok(Vec::new()) } else { backend.record(&self.holder, &records, lane_write).await }
            };
            let take = async {
                if to_take.is_empty() { Ok(Vec::new()) } else { backend.take_listing(&to_take, &self.holder, now, until, lane_write).await }
            };
            let requeued = async {
                let window = DateTime::from_millis(now.timestamp_millis().saturating_sub(REQUEUE_RACE_WINDOW_MS));
                if keyed.is_empty() { Ok(false) } else { backend.requeued_since(window).await }
            };
            answered::all_three(record, take, requeued).await
        };
        let (written, recorded) = futures::join!(write, recording);
        let (commit, (flags, taken, requeued)) = match (written, recorded) {
            (Ok(commit), Ok(recorded)) => (commit, recorded),
            (written, recorded) => {
                // A first stage that succeeded goes on to its commit all the same: its
                // deliveries are left to a claim.
                let committed = match written {
                    Ok(commit) => commit(&none).await,
                    Err(error) => Err(error),
                };
                let taken = recorded.map(|(_, taken, _)| taken);
                let tried = Tried { records: &records, to_take: &to_take, events_lanes: &events_lanes };
                return self.after_failed_hand_out(backend, &mut held, tried, committed, taken).await;
            }
        };
        // What the leases will be issued for: the fresh deliveries of the lanes listed.
        let handed: HashSet<DeliveryId> = records
            .iter()
            .zip(&flags)
            .filter(|(_, ok)| **ok)
            .map(|(record, _)| record.lane)
            .chain(taken.iter().map(|(lane, _)| *lane))
            .flat_map(|lane| by_lane[&lane].iter().map(|entry| entry.delivery))
            .collect();
        // Issues the leases of what was listed, and knows those lanes' lists again.
        let issue_listed = |held: &mut BTreeMap<LaneId, Held>, records: Vec<LaneRecord>, before_commit: Option<&FanOutCommit>| {
            let mut listed: Vec<(LaneId, i64, Vec<InFlight>)> = Vec::new();
            for (record, ok) in records.into_iter().zip(flags) {
                if ok {
                    listed.push((record.lane, record.epoch, record.in_flight));
                } else {
                    held.remove(&record.lane);
                }
            }
            listed.extend(taken.iter().map(|(lane, epoch)| (*lane, *epoch, by_lane[lane].clone())));
            // Not issued, a listed delivery counts as running nowhere: a claim takes it.
            self.issue_listed(held, listed, &by_lane, fresh, |id| !(requeued && keyed.contains(id)), before_commit, now)
        };
        let Some(early) = early else {
            // Issued once committed: each lease names a delivery that exists.
            return match commit(&handed).await {
                Ok(()) => Ok(HandedOut { claimed: issue_listed(&mut held, records, None), sent_early: Vec::new() }),
                Err(error) => {
                    let taken = Ok(taken.clone());
                    let tried = Tried { records: &records, to_take: &to_take, events_lanes: &events_lanes };
                    self.after_failed_hand_out(backend, &mut held, tried, Err(error), taken).await
                }
            };
        };
        let (tell, commit_word) = FanOutCommit::channel();
        let claimed = issue_listed(&mut held, records, Some(&commit_word));
        // The lists are written: claims need not wait for the commit.
        drop(held);
        let sending: Vec<DeliveryId> = claimed.iter().map(|c| c.lease.delivery).collect();
        let (kept, sent_early) = if claimed.is_empty() {
            (Vec::new(), Vec::new())
        } else {
            // A dispatcher that stopped listening gets them with the report instead, each
            // still with the word of the commit.
            match early.send(claimed) {
                Ok(()) => (Vec::new(), sending),
                Err(unsent) => (unsent.0, Vec::new()),
            }
        };
        // Should the commit fail, what was sent is handed back as not run by whoever runs
        // it (the lists naming it are harmless: only issued leases count as running).
        let committed = commit(&handed).await;
        let _ = tell.send(Some(committed.is_ok()));
        committed?;
        Ok(HandedOut { claimed: kept, sent_early })
    }

    /// Hands out `fresh` deliveries, all of them or none, listing them *before* `mark` writes
    /// their fan-out. For a store whose fan-out is then no transaction (in MongoDB, the plain
    /// mark of a backlog batch, see `store/mongo/fan_out.rs`): a crash between the two leaves
    /// lists naming deliveries of unmarked events, which nothing runs or charges, and never a
    /// marked event that nothing lists.
    ///
    /// Returns `Ok(None)`, having marked nothing, when not every one of `fresh` fits in a lane
    /// this instance holds and knows the list of ([`gather_unstored`]), when a claim of this
    /// instance is under way (it owns the lists), or when a list could not be written (the
    /// next claim reads those lanes). Otherwise `mark` runs, and resolves to the deliveries
    /// whose events it marked (another fan-out may have marked some first); their leases are
    /// issued and sent to `early`, with word that their fan-out is done. Should `mark` fail, it
    /// may have marked any of them: all are sent as not run, and the dispatcher hands them
    /// back, which gives each whose event was marked its document (see
    /// [`Candidate::unstored`]). So too when a mark that landed late finds a list lost and
    /// cannot write it again ([`Claimer::lists_kept`]).
    pub async fn hand_out_listed_first<B: ClaimBackend, F>(
        &self,
        backend: &B,
        fresh: Vec<Fresh>,
        mark: impl FnOnce() -> F,
        early: &EarlyHandOuts,
        now: DateTime,
    ) -> Result<Option<Vec<DeliveryId>>, StoreError>
    where
        F: Future<Output = Result<HashSet<DeliveryId>, StoreError>>,
    {
        let Ok(mut held) = self.held.try_lock() else { return Ok(None) };
        let until = self.lease_until(now);
        let mut fresh = fresh;
        let FreshLists { by_lane, records, to_take, gathered, .. } = self.list_fresh(&held, &mut fresh, until);
        if fresh.is_empty() || gathered < fresh.len() || !to_take.is_empty() {
            return Ok(None);
        }
        match backend.record(&self.holder, &records, LaneWrite::Applied).await {
            Ok(flags) if flags.iter().all(|ok| *ok) => {}
            outcome => {
                if let Err(error) = outcome {
                    tracing::debug!(%error, "listing a hand-out before its mark failed; fanning out with a transaction");
                }
                for record in &records {
                    held.insert(record.lane, Held { epoch: record.epoch, known: None });
                }
                return Ok(None);
            }
        }
        let marking = std::time::Instant::now();
        let marked = match mark().await {
            Ok(ours) if marking.elapsed() >= SLOW_MARK => self.lists_kept(backend, &records).await.map(|()| ours),
            marked => marked,
        };
        // After a failed mark every one is issued, to be handed back as not run. Entries of
        // events another fan-out marked stay listed, unissued: they run nowhere, and the next
        // write of their list leaves them out.
        let issued_for = |delivery: &DeliveryId| marked.as_ref().map_or(true, |ours| ours.contains(delivery));
        let listed = records.into_iter().map(|record| (record.lane, record.epoch, record.in_flight)).collect();
        let (tell, commit) = FanOutCommit::channel();
        let _ = tell.send(Some(marked.is_ok()));
        let claimed = self.issue_listed(&mut held, listed, &by_lane, fresh, issued_for, Some(&commit), now);
        drop(held);
        let sent: Vec<DeliveryId> = claimed.iter().map(|c| c.lease.delivery).collect();
        if !claimed.is_empty() && early.send(claimed).is_err() {
            // The dispatcher stopped: its stop hands back what this instance holds.
            tracing::debug!(deliveries = sent.len(), "a hand-out found the dispatcher gone");
        }
        marked.map(|_| Some(sent))
    }

    /// After a mark that landed late ([`SLOW_MARK`]), makes sure the lists written before it
    /// still name what it hands out. They were acknowledged once applied: a failover between
    /// them and the mark (a primary killed) may have lost them while the mark landed on the
    /// next primary, and nothing would name those runs once this instance stopped rewriting
    /// its lists (its next claim does, durably). So they are read back, and one that lost its
    /// entries is written again, durably (the mark, earlier on the same primary, is then
    /// durable too). An error means a list could be neither confirmed nor written again: the
    /// caller hands every run back.
    async fn lists_kept<B: ClaimBackend>(&self, backend: &B, records: &[LaneRecord]) -> Result<(), StoreError> {
        let ids: Vec<LaneId> = records.iter().map(|record| record.lane).collect();
        let states = backend.lanes(&ids).await?;
        let kept = |record: &&LaneRecord| {
            states.iter().any(|state| {
                state.id == record.lane
                    && state.epoch == record.epoch
                    && state.held_by(&self.holder)
                    && record.in_flight.iter().all(|entry| state.in_flight.iter().any(|listed| listed.delivery == entry.delivery))
            })
        };
        let lost: Vec<LaneRecord> = records.iter().filter(|record| !kept(record)).cloned().collect();
        if lost.is_empty() {
            return Ok(());
        }
        tracing::warn!(lanes = lost.len(), "a hand-out's lane lists were lost after their write (a failover?); writing them again");
        match backend.record(&self.holder, &lost, LaneWrite::Durable).await? {
            flags if flags.iter().all(|ok| *ok) => Ok(()),
            _ => Err(StoreError::Raced("a lane whose hand-out list was lost was taken meanwhile".into())),
        }
    }

    /// Issues the leases of those of `fresh` that `issued_for` admits, in the lanes of `listed`
    /// (each with the epoch and the whole list written), before the fan-out's commit if
    /// `before_commit` is its word, and counts those lanes as held with these lists.
    #[allow(clippy::too_many_arguments)]
    fn issue_listed(
        &self,
        held: &mut BTreeMap<LaneId, Held>,
        listed: Vec<(LaneId, i64, Vec<InFlight>)>,
        by_lane: &BTreeMap<LaneId, Vec<InFlight>>,
        fresh: Vec<Fresh>,
        issued_for: impl Fn(&DeliveryId) -> bool,
        before_commit: Option<&FanOutCommit>,
        now: DateTime,
    ) -> Vec<ClaimedDelivery> {
        let until = self.lease_until(now);
        let mut events: HashMap<DeliveryId, (Candidate, EventRecord)> =
            fresh.into_iter().map(|Fresh { candidate, event }| (candidate.id, (candidate, event))).collect();
        let mut picks = Vec::new();
        for (lane, epoch, in_flight) in listed {
            for entry in by_lane.get(&lane).into_iter().flatten().filter(|entry| issued_for(&entry.delivery)) {
                if let Some((candidate, event)) = events.remove(&entry.delivery) {
                    picks.push((candidate, epoch, event));
                }
            }
            held.insert(lane, Held { epoch, known: Some(Listed { in_flight, lease_until: until }) });
        }
        self.issue_leases(picks, before_commit, now)
    }

    /// After a hand-out whose fan-out or lane writes failed: learns what it cannot know
    /// (the next claim reads every lane involved; a lane taken without this instance learning
    /// it is asked for) and reconciles. Lists written for a commit that failed name deliveries
    /// that were never inserted, harmless since only issued leases count as running; lists
    /// written without this instance learning it for a commit that happened name real
    /// deliveries, which the reconciliation moves on as for a claim.
    ///
    /// The held lanes among [`Tried::events_lanes`] are read again too, although the hand-out
    /// may have listed nothing there (see [`gather_unstored`]): the fan-out whose mark beat
    /// this one put its deliveries there, where only this instance can claim them (see
    /// [`Claimer::lanes_to_read`]).
    async fn after_failed_hand_out<B: ClaimBackend>(
        &self,
        backend: &B,
        held: &mut BTreeMap<LaneId, Held>,
        Tried { records, to_take, events_lanes }: Tried<'_>,
        committed: Result<(), StoreError>,
        taken: Result<Vec<(LaneId, i64)>, StoreError>,
    ) -> Result<HandedOut, StoreError> {
        for record in records {
            held.insert(record.lane, Held { epoch: record.epoch, known: None });
        }
        for lane in events_lanes {
            if let Some(lane) = held.get_mut(lane) {
                lane.known = None;
            }
        }
        // A lane taken without this instance learning it would otherwise stay its own,
        // unused, until its lease ran out.
        let learned = match &taken {
            Ok(taken) => Ok(taken.clone()),
            Err(_) => {
                let ids: Vec<LaneId> = to_take.iter().map(|(lane, _)| *lane).collect();
                backend.lanes(&ids).await.map(|states| {
                    states.iter().filter(|state| state.held_by(&self.holder)).map(|state| (state.id, state.epoch)).collect()
                })
            }
        };
        match learned {
            Ok(learned) => {
                for (lane, epoch) in learned {
                    held.insert(lane, Held { epoch, known: None });
                }
            }
            Err(error) => tracing::warn!(%error, "reading the lanes a failed hand-out may have taken failed"),
        }
        committed?;
        if let Err(error) = self.reconcile(backend).await {
            tracing::warn!(%error, "reconciling lanes after a failed hand-out failed");
        }
        taken.map(|_| HandedOut { claimed: Vec::new(), sent_early: Vec::new() })
    }
}

/// Where a hand-out lists its fresh deliveries (see [`Claimer::list_fresh`]).
struct FreshLists {
    /// The fresh deliveries' entries, by the lane that is to list them.
    by_lane: BTreeMap<LaneId, Vec<InFlight>>,
    /// The new lists of held lanes.
    records: Vec<LaneRecord>,
    /// Free lanes to take with these entries.
    to_take: Vec<(LaneId, Vec<InFlight>)>,
    /// Where the fresh deliveries' events place them, whichever lanes list them.
    events_lanes: BTreeSet<LaneId>,
    /// How many fresh deliveries without a document went to held lanes.
    gathered: usize,
}

/// What a failed hand-out tried to write, for [`Claimer::after_failed_hand_out`].
struct Tried<'a> {
    records: &'a [LaneRecord],
    to_take: &'a [(LaneId, Vec<InFlight>)],
    /// Where the fresh deliveries' events place them, whichever lanes list them.
    events_lanes: &'a BTreeSet<LaneId>,
}

/// How long a plain mark takes before its hand-out reads its lists back ([`Claimer::lists_kept`]).
/// The mark is sent as soon as the lists were acknowledged, so it reaches another primary
/// than theirs only once the client learned of one: after an election, which takes seconds
/// (`electionTimeoutMillis`, 10 s by default). A mark that took less landed where the lists
/// did, after them. Reading them back after every mark cost the unkeyed drain about 5 %
/// (measured), as did writing them durably in the first place.
const SLOW_MARK: std::time::Duration = std::time::Duration::from_millis(100);

/// The most entries a hand-out lets a list grow to in a held lane it gathers deliveries
/// without a document in (see [`gather_unstored`]). A record rewrites its lane's whole list,
/// so a list's length is paid at every write of it.
const GATHERED_PER_LANE: usize = 64;

/// Moves the unkeyed `fresh` deliveries without a document ([`Candidate::unstored`]) into
/// lanes this instance holds and knows the lists of, filling the one listing the fewest unsettled
/// entries (`unsettled`, `None` for a lane not to fill) first, up to [`GATHERED_PER_LANE`]
/// each; those that do not fit keep their event's lane. Returns how many it moved.
///
/// Such a delivery is bound to no lane: it is unkeyed, so no order binds it, and no document
/// says where it is; its lane entry only records that it runs, for a takeover or a check
/// (which give it its document, in its event's lane, see [`Candidate::unstored`]). Listed by
/// the lanes its events hash to, a hand-out wrote about one lane document for every
/// delivery, a quarter of `mongod`'s work in a drain; gathered, it writes one per
/// [`GATHERED_PER_LANE`] deliveries, and lanes another instance holds stop it less.
fn gather_unstored(held: &BTreeMap<LaneId, Held>, unsettled: impl Fn(LaneId, &Listed) -> Option<usize>, fresh: &mut [Fresh]) -> usize {
    let mut room: Vec<(usize, LaneId)> = held
        .iter()
        .filter_map(|(id, lane)| Some((unsettled(*id, lane.known.as_ref()?)?, *id)))
        .filter(|(listed, _)| *listed < GATHERED_PER_LANE)
        .collect();
    room.sort_unstable();
    let mut lanes = room.into_iter();
    let mut filling = lanes.next();
    let mut gathered = 0;
    // A keyed one stays in its key's lane, where its key's other deliveries are.
    for Fresh { candidate, .. } in fresh.iter_mut().filter(|fresh| fresh.candidate.unstored.is_some() && fresh.candidate.key.is_none()) {
        let Some((listed, lane)) = filling.as_mut() else { break };
        candidate.lane = *lane;
        gathered += 1;
        *listed += 1;
        if *listed >= GATHERED_PER_LANE {
            filling = lanes.next();
        }
    }
    gathered
}
