//! One claim, phase by phase, over the `Claimer`'s record: finish the takeovers whose charge
//! failed; read what runs in the lanes it holds (and unpark what may move); take over lanes
//! whose holder died, charging what had started; scan the held lanes into a [`Plan`] (the
//! lanes it did not reach get their turn once a second); take free lanes with due work (other
//! hosts' once stale), oldest work first once a second, while the held lanes left idle are
//! handed back; record the picks in their lanes, hand back the lanes left idle since and read
//! the picks' events at once; bury picks whose event is gone; park what waits behind a busy
//! key and give back what a requeue overtook; issue the leases.
//! It must never decide backoff or attempt limits.

use super::*;

impl Claimer {
    /// One claim of up to `capacity` deliveries of `handlers` (see the module doc for its
    /// phases); claims of one instance never overlap (the caller holds `held`'s lock).
    pub(super) async fn claim_serialized<B: ClaimBackend>(
        &self,
        backend: &B,
        held: &mut BTreeMap<LaneId, Held>,
        handlers: &[String],
        search: LaneSearch<'_>,
        capacity: Capacity,
        now: DateTime,
    ) -> Result<Vec<ClaimedDelivery>, StoreError> {
        let until = self.lease_until(now);
        // What runs where: the lanes held, what of theirs still runs, the lanes taken over.
        let waiting = self.finish_failed_charges(backend, now).await;
        let Running { mut mine, left_over, mut heads } = self.read_what_runs(backend, held, handlers, &search, &waiting, now).await?;
        let taken = self.take(backend, held, &left_over, now, until).await?;
        adopt(held, &mut mine, taken);
        // A takeover or a settling may have given a lower sequence than a head known a document.
        self.drop_forgotten_heads(&mut heads, false);

        // Pick: due work of the held lanes under the per-key rules, then of free lanes.
        let mut plan = Plan::new(capacity.total, &capacity.rooms, mine.values().flat_map(|lane| lane.running.iter()));
        self.limit_keys(&mut plan, &capacity.per_key, &mine);
        plan.heads.extend(heads.into_iter().map(|(key, head)| (key, Some(head))));
        // Taken for the claim (claims of an instance never overlap) and put back, with what it
        // learned, when it succeeds; a failed claim only costs the next one some lookups.
        plan.known_heads = std::mem::take(&mut *self.known_heads.lock().expect("known heads"));
        self.drop_forgotten_heads(&mut plan.known_heads, false);
        plan.priorities = capacity.priorities.clone();
        // Handlers of a higher priority go first, in the held lanes and then in free ones: a
        // lower priority's work in a held lane never takes the places of a higher one's in a
        // free lane. Without priorities, one tier of every handler.
        let tiers = capacity.priorities.tiers(handlers);
        let (last, higher) = tiers.split_last().expect("one tier at least");
        for tier in higher {
            if plan.full() {
                break;
            }
            self.pick_in_held_lanes(backend, &mut plan, &mine, tier, now).await?;
            let tried: BTreeSet<LaneId> = mine.keys().chain(&waiting).copied().collect();
            self.take_free_lanes(backend, held, &mut mine, &mut plan, tried, tier, &search, now, until).await?;
        }
        // Filled by a higher tier, the last looks for nothing (not even older work, which
        // would take the higher tiers' places).
        let last: &[String] = if !higher.is_empty() && plan.full() { &[] } else { last };
        self.pick_in_held_lanes(backend, &mut plan, &mine, last, now).await?;
        let tried: BTreeSet<LaneId> = mine.keys().chain(&waiting).copied().collect();
        // Held lanes that run nothing and where the scan picked nothing are handed back while
        // free lanes are searched (the search leaves them alone): an idle host's poll then
        // waits for one round trip less.
        let idle: Vec<(LaneId, i64)> = mine
            .iter()
            .filter(|(id, lane)| lane.takes_free_at.is_none() && lane.running.is_empty() && !plan.picks.iter().any(|p| p.lane == **id))
            .map(|(id, lane)| (*id, lane.epoch))
            .collect();
        mine.retain(|id, _| !idle.iter().any(|(lane, _)| lane == id));
        let hand_back = async { if idle.is_empty() { Ok(()) } else { backend.hand_back(&self.holder, &idle, now).await } };
        let take_free = self.take_free_lanes(backend, held, &mut mine, &mut plan, tried, last, &search, now, until);
        let (handed_back, taken_free) = futures::join!(hand_back, take_free);
        if handed_back.is_ok() {
            held.retain(|id, _| !idle.iter().any(|(lane, _)| lane == id));
        }
        handed_back?;
        taken_free?;

        // Record the picks, sort out what cannot run or must wait, issue the leases.
        let written = self.record(backend, held, &mine, &mut plan, capacity, now, until).await?;
        let runnable = self.sort_out(backend, held, &mine, &mut plan, written, now).await?;
        let mut known = plan.into_known_heads();
        self.drop_forgotten_heads(&mut known, true);
        *self.known_heads.lock().expect("known heads") = known;
        let picks = runnable.into_iter().map(|(pick, event)| {
            let epoch = mine[&pick.lane].epoch;
            (pick, epoch, event)
        });
        Ok(self.issue_leases(picks, None, now))
    }

    /// The lanes this instance still holds, and what of theirs still runs (as its last claim
    /// left them, or read where that is unknown), with the lanes the search names; unparking
    /// goes meanwhile (it touches only parked deliveries), and the keys of leases that ended
    /// unseen are unparked after it. A named lane that is free and runs nothing is taken by
    /// the record write itself, conditional on its epoch not having moved: its due work can be
    /// read before, since nobody can claim from it without moving the epoch.
    async fn read_what_runs<B: ClaimBackend>(
        &self,
        backend: &B,
        held: &mut BTreeMap<LaneId, Held>,
        handlers: &[String],
        search: &LaneSearch<'_>,
        waiting: &BTreeSet<LaneId>,
        now: DateTime,
    ) -> Result<Running, StoreError> {
        let named: Vec<LaneId> = match *search {
            LaneSearch::Only(lanes) => lanes.iter().copied().filter(|lane| !held.contains_key(lane)).collect(),
            LaneSearch::FreeWithDueWork => Vec::new(),
        };
        // Taken for the claim: a successful one leaves every lane it still holds known again.
        let known: BTreeMap<LaneId, HeldLane> = held
            .iter_mut()
            .filter_map(|(id, lane)| {
                let Listed { in_flight, lease_until } = lane.known.take()?;
                Some((*id, HeldLane { epoch: lane.epoch, running: in_flight, takes_free_at: None, lease_until }))
            })
            .collect();
        let unknown = held.keys().filter(|id| !known.contains_key(id)).copied();
        let read_ids: Vec<LaneId> = unknown.chain(named.iter().copied()).collect();
        let holder = &self.holder;
        let running_in_held = async {
            let mut mine = known;
            let mut left_over = Vec::new();
            let states = if read_ids.is_empty() { Vec::new() } else { backend.lanes(&read_ids).await? };
            for state in states {
                if waiting.contains(&state.id) {
                    continue;
                }
                if held.get(&state.id).map(|lane| lane.epoch) == Some(state.epoch) && state.held_by(holder) {
                    let lane = HeldLane {
                        epoch: state.epoch,
                        running: state.in_flight,
                        takes_free_at: None,
                        lease_until: state.lease_expires_at,
                    };
                    mine.insert(state.id, lane);
                } else if named.contains(&state.id) && (state.owner.is_none() || state.lease_expires_at < now) {
                    if state.in_flight.is_empty() {
                        let lane =
                            HeldLane { epoch: state.epoch + 1, running: Vec::new(), takes_free_at: Some(now), lease_until: now };
                        mine.insert(state.id, lane);
                    } else {
                        // A takeover: what its owner left in flight is charged before anything
                        // of it is read.
                        left_over.push(state.id);
                    }
                }
            }
            // An entry whose lease this instance settled (or never issued) runs no more: only
            // the unsettled ones count, and only the older ones need the database's word.
            let trusted_since = DateTime::from_millis(now.timestamp_millis().saturating_sub(UNSETTLED_TRUSTED_FOR_MS));
            let unsettled: HashMap<(DeliveryId, i64), bool> = self
                .issued
                .lock()
                .expect("issued leases")
                .values()
                .map(|i| ((i.lease.delivery, i.lease.claims), i.at >= trusted_since))
                .collect();
            let mut current = HashSet::new();
            let mut to_check = Vec::new();
            for entry in mine.values().flat_map(|lane| lane.running.iter()) {
                match unsettled.get(&(entry.delivery, entry.claims)) {
                    Some(true) => {
                        current.insert(entry.delivery);
                    }
                    Some(false) => to_check.push(entry.clone()),
                    None => {}
                }
            }
            if !to_check.is_empty() {
                current.extend(backend.current(&to_check).await?);
            }
            Ok::<_, StoreError>((mine, current, left_over))
        };
        let scope = self.unpark_scope(now);
        let unpark = async {
            match &scope {
                Some(scope) => backend.unpark(handlers, scope).await,
                None => Ok(HashMap::new()),
            }
        };
        // The heads unparking found spare the scan a lookup of each of those keys (they are
        // the keys that just moved, whose next deliveries this claim is most likely to see).
        let ((mut mine, current, left_over), mut heads) = match answered::both(running_in_held, unpark).await {
            Ok(read) => read,
            Err(error) => {
                self.unpark_later(scope);
                return Err(error);
            }
        };
        held.retain(|id, _| waiting.contains(id) || mine.get(id).is_some_and(|lane| lane.takes_free_at.is_none()));
        for lane in mine.values_mut() {
            lane.running.retain(|entry| current.contains(&entry.delivery));
        }
        // Leases that ended without this instance seeing it: their keys may have moved on, so
        // what waits parked behind them is unparked before the scan.
        let ended: Vec<HandlerKey> = {
            let mut issued = self.issued.lock().expect("issued leases");
            let ended = issued.iter().filter(|(id, _)| !current.contains(id)).filter_map(|(_, i)| i.key.clone()).collect();
            issued.retain(|id, _| current.contains(id));
            ended
        };
        if !ended.is_empty() {
            let scope = Unpark::Keys { keys: ended, behind: Vec::new() };
            match backend.unpark(handlers, &scope).await {
                Ok(found) => heads.extend(found),
                Err(error) => {
                    self.unpark_later(Some(scope));
                    return Err(error);
                }
            }
        }
        Ok(Running { mine, left_over, heads })
    }

    /// Records the picks in their lanes (one conditional write per lane with new picks, or
    /// whose lease is past half), hands back the lanes that run nothing and reads the picks'
    /// events, all at once: a failure in any of them fails the claim, and the reconciliation
    /// undoes what was recorded.
    #[allow(clippy::too_many_arguments)]
    async fn record<B: ClaimBackend>(
        &self,
        backend: &B,
        held: &mut BTreeMap<LaneId, Held>,
        mine: &BTreeMap<LaneId, HeldLane>,
        plan: &mut Plan,
        capacity: Capacity,
        now: DateTime,
        until: DateTime,
    ) -> Result<Written, StoreError> {
        let mut records = Vec::new();
        let mut idle = Vec::new();
        // The first picks (the plan holds them from the highest priority down) take the free
        // run slots; the others are listed as claimed ahead.
        for (slot, pick) in plan.picks.iter_mut().enumerate() {
            pick.started = slot < capacity.run_now;
        }
        // A lane that runs something and picked nothing new keeps its list and lease as
        // written (entries settled since are harmless there: a takeover charges only those
        // still at their listed generation), unless its lease is running out.
        let lease_ms = i64::try_from(self.lease_duration.as_millis()).unwrap_or(i64::MAX);
        let refresh_before = DateTime::from_millis(now.timestamp_millis().saturating_add(lease_ms / 2));
        for (lane_id, lane) in mine {
            let mut in_flight = lane.running.clone();
            let before = in_flight.len();
            in_flight.extend(plan.picks.iter().filter(|pick| pick.lane == *lane_id).map(Candidate::in_flight));
            let picked = in_flight.len() > before;
            match (in_flight.is_empty(), lane.takes_free_at) {
                // Never taken, so nothing to hand back.
                (true, Some(_)) => {}
                (true, None) => idle.push((*lane_id, lane.epoch)),
                (false, None) if !picked && lane.lease_until > refresh_before => {
                    if let Some(held) = held.get_mut(lane_id) {
                        held.known = Some(Listed { in_flight, lease_until: lane.lease_until });
                    }
                }
                (false, takes_free_at) => records.push(LaneRecord {
                    lane: *lane_id,
                    epoch: lane.epoch,
                    in_flight,
                    lease_until: until,
                    takes_free_at,
                }),
            }
        }
        // Counted as held before the write: should its reply be lost, the next claim finds out
        // from the lane itself whether the take happened.
        for record in records.iter().filter(|record| record.takes_free_at.is_some()) {
            held.insert(record.lane, Held { epoch: record.epoch, known: None });
        }
        let mut event_ids: Vec<String> = plan.picks.iter().map(|pick| pick.event_id.clone()).collect();
        event_ids.sort();
        event_ids.dedup();
        let record = async {
            if records.is_empty() { Ok(Vec::new()) } else { backend.record(&self.holder, &records, LaneWrite::Durable).await }
        };
        let hand_back = async { if idle.is_empty() { Ok(()) } else { backend.hand_back(&self.holder, &idle, now).await } };
        let events = async { if event_ids.is_empty() { Ok(HashMap::new()) } else { backend.events(&event_ids).await } };
        let (recorded, (), events) = answered::all_three(record, hand_back, events).await?;
        Ok(Written { records, recorded, idle, events })
    }

    /// What of the recorded picks runs: those whose event is gone or unreadable are buried,
    /// those of lanes lost or never taken are forgotten, what waits behind a busy key is
    /// parked and what a racing requeue overtook is given back.
    async fn sort_out<B: ClaimBackend>(
        &self,
        backend: &B,
        held: &mut BTreeMap<LaneId, Held>,
        mine: &BTreeMap<LaneId, HeldLane>,
        plan: &mut Plan,
        written: Written,
        now: DateTime,
    ) -> Result<Vec<(Candidate, EventRecord)>, StoreError> {
        let Written { records, recorded, idle, events } = written;
        let mut runnable = self.bury_unrunnable(backend, std::mem::take(&mut plan.picks), &events, now).await?;
        let mut lost_lanes = HashSet::new();
        for (record, ok) in records.iter().zip(&recorded) {
            if !ok {
                lost_lanes.insert(record.lane);
                held.remove(&record.lane);
            } else if let Some(lane) = held.get_mut(&record.lane) {
                lane.known = Some(Listed { in_flight: record.in_flight.clone(), lease_until: record.lease_until });
            }
        }
        // Lanes named but not taken, and lanes another claimer took meanwhile, are none of
        // this claim's business any more: what it saw blocked there was judged by what this
        // instance ran there, which may be stale.
        let untaken: HashSet<LaneId> = mine
            .iter()
            .filter(|(id, lane)| lane.takes_free_at.is_some() && !held.contains_key(id))
            .map(|(id, _)| *id)
            .chain(lost_lanes.iter().copied())
            .collect();
        plan.forget_lanes(&untaken);
        for (lane, _) in &idle {
            held.remove(lane);
        }

        runnable.retain(|(pick, _)| !lost_lanes.contains(&pick.lane));
        // What it parks, and what a requeue overtook, waits for its key's next settling.
        self.note_awaited(plan.parked_keys());
        let (kept, overtaken) = park_and_give_back_overtaken(backend, plan, runnable, now).await?;
        self.note_awaited(overtaken);
        Ok(kept)
    }

    /// A takeover whose charge failed is finished first. Charging again changes nothing
    /// already charged (the charge applies at the listed generation only), and charging after
    /// the lane changed hands again is the charge its new owner would make. It is tried at
    /// most once a second, for a moment (see `CHARGE_RETRY_INTERVAL_MS`); while it still cannot
    /// be made, its lanes sit this claim out: they are returned.
    async fn finish_failed_charges<B: ClaimBackend>(&self, backend: &B, now: DateTime) -> BTreeSet<LaneId> {
        let uncharged: Vec<(LaneId, i64, InFlight)> = self.uncharged.lock().expect("uncharged").clone();
        let mut waiting = BTreeSet::new();
        if !uncharged.is_empty() && !self.charge_retry.due(now) {
            waiting.extend(uncharged.iter().map(|(lane, _, _)| *lane));
        } else if !uncharged.is_empty() {
            let entries: Vec<InFlight> = uncharged.iter().map(|(_, _, entry)| entry.clone()).collect();
            self.forget_heads(entries.iter().filter_map(|entry| Some((entry.handler.clone(), entry.key.clone()?))));
            match self.charge(backend, &entries, now, CHARGE_RETRY_WAIT).await {
                Ok(()) => self.uncharged.lock().expect("uncharged").clear(),
                Err(error) => {
                    waiting.extend(uncharged.iter().map(|(lane, _, _)| *lane));
                    if self.charge_warning.due(now) {
                        tracing::warn!(
                            %error,
                            lanes = ?waiting,
                            "lanes taken over still wait for their previous holder's deliveries to be charged; trying again every second",
                        );
                    }
                }
            }
        }
        waiting
    }

    /// Picks `handlers`' due work of the held lanes: this host's share first, then older work
    /// of lanes the scan did not reach (at most once a second), then what waited past stale
    /// in held lanes of another live host's share (the split moved them, see
    /// `crate::store::assignment`): those get no other new work, so they run empty and go
    /// back, and their host takes them.
    async fn pick_in_held_lanes<B: ClaimBackend>(
        &self,
        backend: &B,
        plan: &mut Plan,
        mine: &BTreeMap<LaneId, HeldLane>,
        handlers: &[String],
        now: DateTime,
    ) -> Result<(), StoreError> {
        if handlers.is_empty() {
            return Ok(());
        }
        let assignment = self.assignment();
        let (lanes, theirs): (Vec<LaneId>, Vec<LaneId>) = mine.keys().copied().partition(|lane| assignment.is_mine(*lane));
        let unread = scan(backend, plan, &lanes, handlers, now).await?;
        // Older work goes before younger only where age is the order.
        let by_age = plan.read_order(handlers) == ReadOrder::Due;
        if by_age && plan.full() && !unread.is_empty() && self.unread_lanes_check.due(now) {
            older_work_of_unread_lanes(backend, plan, unread, handlers).await?;
        }
        if !theirs.is_empty() && !plan.full() {
            scan(backend, plan, &theirs, handlers, self.stale_before(now)).await?;
        }
        Ok(())
    }

    /// Free lanes with due work, taken and scanned into `plan` while it is not full (only when
    /// the claim searches free lanes at all); `tried` are the lanes it looked at already.
    ///
    /// Held lanes can fill a claim on their own with work younger than what waits in lanes
    /// nobody holds: a lane kept busy by a steady stream would then keep the others waiting
    /// for as long as the stream lasts. At most once a second (it costs a query), free lanes
    /// with work due before the claim's youngest pick are taken and scanned for that work,
    /// which takes the place of the youngest picks. Read by priority, at every claim the held
    /// lanes filled, free lanes with work above its lowest pick are taken and scanned the same
    /// way. Then more lanes, in growing rounds (4, 8, 16, ... or as many as the due work seen
    /// in them says the batch still needs, if more).
    #[allow(clippy::too_many_arguments)]
    async fn take_free_lanes<B: ClaimBackend>(
        &self,
        backend: &B,
        held: &mut BTreeMap<LaneId, Held>,
        mine: &mut BTreeMap<LaneId, HeldLane>,
        plan: &mut Plan,
        mut tried: BTreeSet<LaneId>,
        handlers: &[String],
        search: &LaneSearch<'_>,
        now: DateTime,
        until: DateTime,
    ) -> Result<(), StoreError> {
        if !matches!(search, LaneSearch::FreeWithDueWork) || handlers.is_empty() {
            return Ok(());
        }
        // Free lanes of other live hosts are theirs to take (see `crate::store::assignment`):
        // taking them would only race them for their own fan-outs' deliveries. Their work
        // counts only once it waited past stale.
        let assignment = self.assignment();
        let others: BTreeSet<LaneId> = (0..=LaneId::MAX).filter(|lane| !assignment.is_mine(*lane)).collect();
        let others_before = self.stale_before(now);
        let order = plan.read_order(handlers);
        // What goes before the picks the held lanes gave: work due before the youngest pick
        // (up to half the claim), or of a priority above the lowest pick's (up to all of it).
        let first_elsewhere = match order {
            ReadOrder::Due if plan.full() && self.fairness_check.due(now) => plan
                .youngest_due()
                .map(|youngest| (DateTime::from_millis(youngest.timestamp_millis() - 1), None, (plan.limit / 2).max(1))),
            ReadOrder::Priority if plan.full() => plan.lowest_priority(handlers).map(|lowest| (now, Some(lowest), plan.limit)),
            _ => None,
        };
        if let Some((before, above, most)) = first_elsewhere {
            let due = DueWork { exclude: &tried, before, others: &others, others_before, order, above };
            let first = backend.free_lanes_with_due_work(&plan.open_handlers(handlers), due, FAIRNESS_LANES, most).await?;
            if !first.is_empty() {
                let lanes: Vec<LaneId> = first.iter().map(|(lane, _)| *lane).collect();
                tried.extend(lanes.iter().copied());
                let taken = self.take(backend, held, &lanes, now, until).await?;
                let new_lanes = adopt(held, mine, taken);
                self.forget_heads_in(plan);
                // By priority, the scan puts each row that ranks higher in the lowest pick's place.
                if order == ReadOrder::Due {
                    plan.make_room(first.iter().map(|(_, due)| due).sum::<usize>().min(most));
                }
                scan(backend, plan, &new_lanes, handlers, before).await?;
            }
        }
        // More lanes, in growing rounds (4, 8, 16, ... or as many as the due work seen in them
        // says the batch still needs, if more), while the batch is not full.
        let mut round = 4;
        while !plan.full() {
            // Only for what it may still pick: lanes with work of handlers out of room alone
            // are left free.
            let open = plan.open_handlers(handlers);
            let missing = plan.missing(&open);
            if missing == 0 {
                break;
            }
            let due = DueWork { exclude: &tried, before: now, others: &others, others_before, order, above: None };
            let found = backend.free_lanes_with_due_work(&open, due, MAX_LANES_PER_QUERY, missing).await?;
            if found.is_empty() {
                break;
            }
            let mut seen = 0;
            let free: Vec<LaneId> = found
                .iter()
                .enumerate()
                .take_while(|(taken, (_, due))| {
                    let more = *taken < round || seen < missing;
                    seen += due;
                    more
                })
                .map(|(_, (lane, _))| *lane)
                .collect();
            tried.extend(free.iter().copied());
            if free.iter().any(|lane| others.contains(lane)) {
                tracing::debug!(lanes = ?free, "taking other hosts' free lanes whose work waited past stale");
            }
            let taken = self.take(backend, held, &free, now, until).await?;
            let new_lanes = adopt(held, mine, taken);
            self.forget_heads_in(plan);
            scan(backend, plan, &new_lanes, handlers, now).await?;
            // The answer named every free lane with due work (fewer lanes than asked for, and
            // fewer rows than any of its reads could return) and all of them were tried: a
            // further round would only find that out again, at the cost of another query.
            let rows_seen: usize = found.iter().map(|(_, due)| due).sum();
            if found.len() < MAX_LANES_PER_QUERY && rows_seen < MIN_ROWS_PER_LANE_QUERY && free.len() == found.len() {
                break;
            }
            round = (round * 2).min(MAX_LANES_PER_QUERY);
        }
        Ok(())
    }

    /// The picks whose event was read, with it; a pick whose event is gone or unreadable can
    /// never run: it is buried (which also moves its claim generation on, so its lane entry no
    /// longer counts as running), and its key moves on like that of any other burial.
    async fn bury_unrunnable<B: ClaimBackend>(
        &self,
        backend: &B,
        picks: Vec<Candidate>,
        events: &HashMap<String, Document>,
        now: DateTime,
    ) -> Result<Vec<(Candidate, EventRecord)>, StoreError> {
        let mut unrunnable = Vec::new();
        let mut buried_keys = Vec::new();
        let mut runnable = Vec::new();
        for pick in picks {
            let reason = match events.get(&pick.event_id).map(EventRecord::from_document) {
                Some(Ok(event)) => {
                    runnable.push((pick, event));
                    continue;
                }
                Some(Err(error)) => format!("event document is malformed: {error}"),
                None => "event document is missing".to_string(),
            };
            buried_keys.extend(pick.handler_key());
            unrunnable.push((pick.id, pick.claims, reason));
        }
        if !unrunnable.is_empty() {
            backend.bury_unrunnable(&unrunnable, now).await?;
        }
        self.moved_keys.lock().expect("moved keys").0.extend(buried_keys);
        Ok(runnable)
    }
}

/// Parks everything `plan` saw blocked behind an unfinished predecessor: left ready, it would
/// be read again by every claim for as long as its key is busy, and a lane handed back would
/// be taken again for nothing. Each delivery is parked once and unparked once, when it becomes
/// its key's head. Best effort: a failure here costs the next claims some reading but never
/// strands a key.
///
/// At once, the picks a requeue overtook are given back, uncharged: a requeue racing the
/// claim can have put an earlier delivery of a picked key back in front of it. Requeues are
/// operator actions, so a window of a minute covers clock skew between hosts at the cost of
/// rare re-checks. Returns the picks kept, and the keys of those given back.
async fn park_and_give_back_overtaken<B: ClaimBackend>(
    backend: &B,
    plan: &mut Plan,
    mut runnable: Vec<(Candidate, EventRecord)>,
    now: DateTime,
) -> Result<(Vec<(Candidate, EventRecord)>, Vec<HandlerKey>), StoreError> {
    let to_park = plan.to_park();
    let park = async {
        if !to_park.is_empty() {
            if let Err(error) = backend.park(&to_park).await {
                tracing::warn!(%error, count = to_park.len(), "parking blocked deliveries failed");
            }
        }
    };

    // The check and the parking go at once: a claim that parks pays no round trip more.
    let keyed: Vec<HandlerKey> =
        runnable.iter().filter_map(|(pick, _)| pick.handler_key()).collect();
    let window = DateTime::from_millis(now.timestamp_millis() - REQUEUE_RACE_WINDOW_MS);
    let requeued = async { if keyed.is_empty() { Ok(false) } else { backend.requeued_since(window).await } };
    let ((), requeued) = futures::join!(park, requeued);
    let mut overtaken_keys = Vec::new();
    if requeued? {
        let heads = backend.key_heads(&keyed).await?;
        let (keep, overtaken): (Vec<_>, Vec<_>) = runnable.into_iter().partition(|(pick, _)| match &pick.key {
            Some(key) => heads.get(&(pick.handler.clone(), key.clone())) == Some(&pick.id),
            None => true,
        });
        if !overtaken.is_empty() {
            let back: Vec<(DeliveryId, i64)> = overtaken.iter().map(|(pick, _)| (pick.id, pick.claims)).collect();
            backend.give_back(&back).await?;
            overtaken_keys.extend(overtaken.iter().filter_map(|(pick, _)| pick.handler_key()));
        }
        runnable = keep;
        for key in keyed {
            let head = heads.get(&key).copied();
            plan.heads.insert(key, head);
        }
    }
    Ok((runnable, overtaken_keys))
}

/// What runs in the lanes a claim holds, as [`Claimer::read_what_runs`] found it.
struct Running {
    mine: BTreeMap<LaneId, HeldLane>,
    /// Free lanes named by the search whose last holder left work in flight: a takeover.
    left_over: Vec<LaneId>,
    /// Keys' heads that unparking found.
    heads: HashMap<HandlerKey, DeliveryId>,
}

/// What [`Claimer::record`] wrote and read.
struct Written {
    records: Vec<LaneRecord>,
    /// Per record: whether it applied.
    recorded: Vec<bool>,
    idle: Vec<(LaneId, i64)>,
    events: HashMap<String, Document>,
}
