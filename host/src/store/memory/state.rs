//! The in-memory store's state changes that several of its operations share: fan-outs'
//! writes, completions, burials, materializations, publishing, unparking, and what runs. Each
//! is what one MongoDB statement (or transaction) does there; none ever awaits.

use super::*;

impl State {
    /// Names `handler` among the event's `suspects` while the event is unfanned: a takeover
    /// found its run handed out before its fan-out committed, which it never did (see the
    /// MongoDB store's `suspects`).
    pub(super) fn suspect(&mut self, event: &Bson, handler: &str) {
        let Some(event) = self.events.get_mut(&id_text(event)) else { return };
        if event.contains_key(field::FANNED_OUT_AT) {
            return;
        }
        let handler = Bson::String(handler.to_string());
        match event.get_mut(field::SUSPECTS) {
            Some(Bson::Array(suspects)) if suspects.contains(&handler) => {}
            Some(Bson::Array(suspects)) => suspects.push(handler),
            _ => {
                event.insert(field::SUSPECTS, vec![handler]);
            }
        }
    }

    /// What [`ClaimBackend::unpark`] does, on this data.
    pub(super) fn unpark(&mut self, handlers: &[String], scope: &Unpark) -> HashMap<HandlerKey, DeliveryId> {
        let mut heads = HashMap::new();
        // Followers created behind a delivery that is no longer pending lead their keys.
        if let Unpark::Keys { behind, .. } = scope {
            // As in MongoDB, a delivery this instance completed is taken as gone unread.
            let gone = |settled: &Settled| {
                settled.completed || self.deliveries.get(&settled.delivery).is_none_or(|d| d.status != DeliveryStatus::Pending)
            };
            let named: Vec<DeliveryId> = self
                .deliveries
                .iter()
                .filter(|(_, d)| d.lane == LaneKind::Parked && handlers.contains(&d.handler))
                .filter(|(_, d)| d.behind.is_some_and(|before| behind.iter().any(|s| s.delivery == before && gone(s))))
                .map(|(id, _)| *id)
                .collect();
            for id in named {
                let d = self.deliveries.get_mut(&id).expect("found above");
                d.lane = LaneKind::Ready;
                d.behind = None;
                heads.insert((d.handler.clone(), d.key.clone().expect("keyed")), id);
            }
        }
        let keys: Option<HashSet<(&str, &str)>> = match scope {
            Unpark::Everything => None,
            Unpark::Keys { keys, .. } => Some(
                keys.iter()
                    .filter(|key| !heads.contains_key(*key))
                    .map(|(handler, key)| (handler.as_str(), key.as_str()))
                    .collect(),
            ),
        };
        let in_scope = |handler: &str, key: &str| keys.as_ref().is_none_or(|keys| keys.contains(&(handler, key)));
        let mut lowest: HashMap<HandlerKey, (i64, DeliveryId, LaneKind)> = HashMap::new();
        for (id, d) in &self.deliveries {
            if d.status != DeliveryStatus::Pending || !handlers.contains(&d.handler) {
                continue;
            }
            let (Some(key), Some(sequence)) = (&d.key, d.sequence) else { continue };
            if !in_scope(&d.handler, key) {
                continue;
            }
            let slot = lowest.entry((d.handler.clone(), key.clone())).or_insert((sequence, *id, d.lane));
            if sequence < slot.0 {
                *slot = (sequence, *id, d.lane);
            }
        }
        for (key, (_, id, lane)) in lowest {
            if lane == LaneKind::Parked {
                let d = self.deliveries.get_mut(&id).expect("exists");
                d.lane = LaneKind::Ready;
                d.behind = None;
            }
            heads.insert(key, id);
        }
        heads
    }

    pub(super) fn new() -> Self {
        let lanes = (0..LANE_COUNT)
            .map(|id| LaneState {
                id: id as LaneId,
                owner: None,
                instance: None,
                lease_expires_at: DateTime::from_millis(0),
                epoch: 0,
                in_flight: Vec::new(),
            })
            .collect();
        Self {
            events: BTreeMap::new(),
            key_sequences: HashMap::new(),
            deliveries: BTreeMap::new(),
            lanes,
            history: BTreeMap::new(),
            hosts: BTreeMap::new(),
            handlers: BTreeMap::new(),
            serves: BTreeMap::new(),
            turns: BTreeMap::new(),
            limiters: BTreeMap::new(),
            collections: BTreeMap::new(),
        }
    }

    /// The lease is current: its lane still has that epoch and the delivery that generation.
    /// (Not necessarily in that lane: one handed out without a record may be listed in any lane
    /// its holder holds, and its record, once it has one, is in its event's lane.)
    pub(super) fn current(&self, lease: &Lease) -> bool {
        self.lanes[usize::from(lease.lane)].epoch == lease.epoch
            && self.deliveries.get(&lease.delivery).is_some_and(|d| d.claims == lease.claims && d.status == DeliveryStatus::Pending)
    }

    /// Whether the lane of `lease` still has its epoch.
    pub(super) fn lane_current(&self, lease: &Lease) -> bool {
        self.lanes[usize::from(lease.lane)].epoch == lease.epoch
    }

    /// Inserts a fan-out's deliveries but those handed out `without` a record (which its
    /// events list instead), announces those it creates dead and marks its events fanned out.
    pub(super) fn write_fan_out(&mut self, plan: &FanOutPlan, without: &WithoutDocuments, now: DateTime) {
        for dead_letter in &plan.dead_letters {
            // Built by the store itself, so it is valid; one published already stays.
            let _ = self.publish(dead_letter, usize::MAX);
        }
        self.insert_deliveries(plan, |id| !without.deliveries.contains_key(id), now);
        for fanned in &plan.events {
            if let Some(event) = self.events.get_mut(&id_text(&fanned.id)) {
                event.insert(field::FANNED_OUT_AT, now);
                let mut handlers: Vec<Bson> = match event.get(field::HANDLERS) {
                    Some(Bson::Array(list)) => list.clone(),
                    _ => Vec::new(),
                };
                handlers.extend(fanned.new_handlers.iter().cloned().map(Bson::String));
                event.insert(field::HANDLERS, handlers);
            }
        }
        self.list_handed_out(without);
    }

    /// Inserts the records of the plan's deliveries that `wanted`.
    pub(super) fn insert_deliveries(&mut self, plan: &FanOutPlan, wanted: impl Fn(&DeliveryId) -> bool, now: DateTime) {
        for NewDelivery { id, event_id, event_type, handler, key, sequence, group, priority, lane, dead_reason, behind, suspect } in
            plan.deliveries.iter().filter(|d| wanted(&d.id))
        {
            let dead = dead_reason.is_some();
            self.deliveries.insert(
                *id,
                Delivery {
                    event_id: event_id.clone(),
                    event_type: event_type.clone(),
                    handler: handler.clone(),
                    key: key.clone(),
                    sequence: *sequence,
                    group: group.clone(),
                    priority: *priority,
                    lane_id: *lane,
                    lane: if dead {
                        LaneKind::Dead
                    } else if behind.is_some() {
                        LaneKind::Parked
                    } else {
                        LaneKind::Ready
                    },
                    status: if dead { DeliveryStatus::Dead } else { DeliveryStatus::Pending },
                    attempts: 0,
                    claims: 0,
                    due_at: now,
                    created_at: now,
                    updated_at: dead.then_some(now),
                    requeued_at: None,
                    last_error: dead_reason.clone(),
                    suspect: *suspect,
                    behind: *behind,
                },
            );
        }
    }

    pub(super) fn complete(&mut self, lease: &Lease, now: DateTime, history: bool) -> Settlement {
        if !self.current(lease) {
            return Settlement::LeaseLost;
        }
        let delivery = self.deliveries.remove(&lease.delivery).expect("checked above");
        self.stamp_completed(&delivery.event_id, now);
        if history {
            self.history.insert(
                lease.delivery,
                HistoryRecord { event_id: delivery.event_id, handler: delivery.handler, completed_at: now },
            );
        }
        Settlement::Completed
    }

    /// Stamps the event's latest completion.
    pub(super) fn stamp_completed(&mut self, event_id: &Bson, now: DateTime) {
        if let Some(event) = self.events.get_mut(&id_text(event_id)) {
            let later = match event.get(field::COMPLETED_AT) {
                Some(Bson::DateTime(at)) => *at < now,
                _ => true,
            };
            if later {
                event.insert(field::COMPLETED_AT, now);
            }
        }
    }

    /// Completes what `lease` runs, with or without a record (the latter as `unstored` names it).
    pub(super) fn publish(&mut self, event: &NewEvent, max_payload_bytes: usize) -> Result<Published, StoreError> {
        event.validate(max_payload_bytes)?;
        if self.events.contains_key(&event.id) {
            return Ok(Published::Duplicate);
        }
        let sequence = event.key.as_ref().map(|key| {
            let counter = self.key_sequences.entry(key.clone()).or_insert(0);
            *counter += 1;
            *counter
        });
        self.events.insert(event.id.clone(), event.to_document(sequence, DateTime::now()));
        Ok(Published::New { sequence })
    }

    /// The entries of live lanes that run: at their record's generation, or without a record
    /// while their event names them.
    pub(super) fn running(&self, now: DateTime) -> Vec<&InFlight> {
        self.lanes
            .iter()
            .filter(|lane| lane.owner.is_some() && lane.lease_expires_at >= now)
            .flat_map(|lane| lane.in_flight.iter())
            .filter(|entry| self.runs(entry))
            .collect()
    }

    /// Whether a lane's entry still runs: its record is at the entry's generation and pending,
    /// or, without a record, its event names it.
    pub(super) fn runs(&self, entry: &InFlight) -> bool {
        match Entry::listed(std::slice::from_ref(entry)).first() {
            Some(unstored) => self.names(unstored),
            None => self.deliveries.get(&entry.delivery).is_some_and(|d| d.claims == entry.claims && d.status == DeliveryStatus::Pending),
        }
    }
}
