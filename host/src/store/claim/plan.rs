//! What one claim decided so far ([`Plan`]): its picks, the heads of the keys it met, what it
//! parks; and the scan of lanes into it, page by page, under the per-key rules. It must never
//! write: the claim records what the plan says.

use super::*;

/// What one claim decided so far.
pub(super) struct Plan {
    pub(super) limit: usize,
    running_ids: HashSet<DeliveryId>,
    /// Keys with a running delivery, or one already picked by this claim.
    busy_keys: HashSet<HandlerKey>,
    pub(super) heads: HashMap<HandlerKey, Option<DeliveryId>>,
    /// Heads earlier claims looked up, not confirmed by this one yet.
    pub(super) known_heads: HashMap<HandlerKey, DeliveryId>,
    pub(super) picks: Vec<Candidate>,
    /// Seen waiting behind an unfinished predecessor of their key.
    blocked: Vec<(LaneId, DeliveryId, HandlerKey)>,
    /// What it may still pick of the handlers the claim's [`Rooms`] name.
    rooms: HashMap<String, usize>,
    /// The claim's handlers' priorities: making room drops the lowest first.
    pub(super) priorities: Priorities,
    /// The most of one key at once, of handlers that run several of a key unordered.
    per_key: KeyLimits,
    /// Of those handlers' keys, how many run in the held lanes or are picked (a key's
    /// deliveries are all in its lane, so its holder counts them all).
    groups: HashMap<HandlerKey, usize>,
}

impl Plan {
    pub(super) fn new<'a>(limit: usize, rooms: &Rooms, running: impl Iterator<Item = &'a InFlight>) -> Self {
        let mut running_ids = HashSet::new();
        let mut busy_keys = HashSet::new();
        for entry in running {
            running_ids.insert(entry.delivery);
            if let Some(key) = &entry.key {
                busy_keys.insert((entry.handler.clone(), key.clone()));
            }
        }
        Self {
            limit,
            running_ids,
            busy_keys,
            heads: HashMap::new(),
            known_heads: HashMap::new(),
            picks: Vec::new(),
            blocked: Vec::new(),
            rooms: rooms.iter().map(|(handler, room)| (handler.clone(), room.most)).collect(),
            priorities: Priorities::default(),
            per_key: KeyLimits::default(),
            groups: HashMap::new(),
        }
    }

    /// Keeps to `per_key`, `running` being the keys of the deliveries running in the held
    /// lanes (one entry per delivery).
    pub(super) fn limit_keys(&mut self, per_key: KeyLimits, running: Vec<HandlerKey>) {
        for key in running {
            *self.groups.entry(key).or_default() += 1;
        }
        self.per_key = per_key;
    }

    /// Whether `key` (a handler and one of its keys) runs or is picked as many times as its
    /// handler's limit per key allows (never, for a handler without one).
    fn at_key_limit(&self, key: &HandlerKey) -> bool {
        let running = self.groups.get(key).copied().unwrap_or(0);
        self.per_key.of(&key.0).is_some_and(|limit| running >= limit)
    }

    /// The keys whose handler's limit is reached: their rows are not read.
    pub(super) fn full_keys(&self) -> Vec<HandlerKey> {
        self.groups.keys().filter(|key| self.at_key_limit(key)).cloned().collect()
    }

    /// `row`'s key, if its handler has a limit per key.
    fn limited_key(&self, row: &Candidate) -> Option<HandlerKey> {
        let group = row.group.as_ref().filter(|_| self.per_key.of(&row.handler).is_some())?;
        Some((row.handler.clone(), group.clone()))
    }

    /// Counts `row` against its key's limit, if its handler has one: whether it may be
    /// picked. One that may not is left as it is, like one of a handler without room.
    fn within_key_limit(&mut self, row: &Candidate) -> bool {
        let Some(key) = self.limited_key(row) else { return true };
        if self.at_key_limit(&key) {
            return false;
        }
        *self.groups.entry(key).or_default() += 1;
        true
    }

    /// Of `handlers`, those it may still pick (all but those whose room is used up).
    pub(super) fn open_handlers(&self, handlers: &[String]) -> Vec<String> {
        handlers.iter().filter(|h| self.rooms.get(*h) != Some(&0)).cloned().collect()
    }

    /// How many more it may pick of `open`'s deliveries: up to its limit, or what their rooms
    /// leave when each of them has one.
    pub(super) fn missing(&self, open: &[String]) -> usize {
        let left = self.limit.saturating_sub(self.picks.len());
        let roomed: Option<usize> = open.iter().map(|h| self.rooms.get(h).copied()).sum();
        roomed.map_or(left, |rooms| rooms.min(left))
    }

    /// The order `handlers`' deliveries are read in: a tier of handlers that take priorities
    /// per event in theirs (see `Priorities::tiers`: such handlers share a tier with no other).
    pub(super) fn read_order(&self, handlers: &[String]) -> ReadOrder {
        let by_event = !handlers.is_empty() && handlers.iter().all(|handler| self.priorities.per_event_of(handler));
        if by_event { ReadOrder::Priority } else { ReadOrder::Due }
    }

    /// Whether it may pick more of `handler`'s deliveries.
    fn has_room_for(&self, handler: &str) -> bool {
        self.rooms.get(handler) != Some(&0)
    }

    fn pick(&mut self, row: Candidate) {
        if let Some(room) = self.rooms.get_mut(&row.handler) {
            *room -= 1;
        }
        self.picks.push(row);
    }

    pub(super) fn full(&self) -> bool {
        self.picks.len() >= self.limit
    }

    /// The lowest delivery priority among its picks of `handlers`.
    pub(super) fn lowest_priority(&self, handlers: &[String]) -> Option<i32> {
        self.picks.iter().filter(|pick| handlers.contains(&pick.handler)).map(|pick| pick.priority.unwrap_or(i32::MIN)).min()
    }

    pub(super) fn youngest_due(&self) -> Option<DateTime> {
        self.picks.iter().map(|pick| pick.due_at).max()
    }

    /// Drops the `n` youngest picks of the lowest priority, freeing their keys; the rest stay
    /// in priority and due order.
    pub(super) fn make_room(&mut self, n: usize) {
        let priorities = &self.priorities;
        self.picks.sort_by_key(|pick| (std::cmp::Reverse((priorities.of(&pick.handler), pick.priority)), pick.due_at, pick.id));
        let keep = self.picks.len().saturating_sub(n);
        for pick in self.picks.drain(keep..) {
            if let Some(room) = self.rooms.get_mut(&pick.handler) {
                *room += 1;
            }
            if let Some(group) = pick.group.filter(|_| self.per_key.of(&pick.handler).is_some()) {
                if let Some(running) = self.groups.get_mut(&(pick.handler.clone(), group)) {
                    *running = running.saturating_sub(1);
                }
            }
            if let Some(key) = pick.key {
                self.busy_keys.remove(&(pick.handler, key));
            }
        }
    }

    /// Confirms the known heads that `rows` contain. A delivery that was its key's lowest
    /// pending one when an earlier claim looked it up still is while it is pending: a fan-out
    /// never creates a lower sequence after a higher one, and an operator's requeue, the one
    /// way back for a lower one, is what the claim's requeue check is for. A key whose known
    /// head is not among the rows (it ran elsewhere, or is further on) is looked up again.
    fn recall_heads(&mut self, rows: &[Candidate]) {
        if self.known_heads.is_empty() {
            return;
        }
        for row in rows {
            if let Some(key) = row.handler_key() {
                if self.known_heads.get(&key) == Some(&row.id) {
                    self.heads.entry(key).or_insert(Some(row.id));
                }
            }
        }
    }

    /// The known heads after this claim: what it looked up or confirmed replaces what was
    /// known of those keys.
    pub(super) fn into_known_heads(mut self) -> HashMap<HandlerKey, DeliveryId> {
        if self.known_heads.len() + self.heads.len() > KNOWN_HEADS_MAX {
            self.known_heads.clear();
        }
        for (key, head) in self.heads {
            match head {
                Some(head) => self.known_heads.insert(key, head),
                None => self.known_heads.remove(&key),
            };
        }
        self.known_heads
    }

    /// Keyed candidates whose head is not known yet and whose key is not busy.
    fn unknown_keys(&self, rows: &[Candidate]) -> Vec<HandlerKey> {
        let mut keys: Vec<HandlerKey> = rows
            .iter()
            .filter(|row| !self.running_ids.contains(&row.id))
            .filter_map(Candidate::handler_key)
            .filter(|key| !self.busy_keys.contains(key) && !self.heads.contains_key(key))
            .collect();
        keys.sort();
        keys.dedup();
        keys
    }

    /// How a pick ranks: its handler's priority, then its own (see `Priorities`).
    fn rank(&self, pick: &Candidate) -> (i32, Option<i32>) {
        (self.priorities.of(&pick.handler), pick.priority)
    }

    /// Whether `row`, of a handler that takes priorities per event, ranks above the lowest
    /// pick and would be picked in its place: read in priority order, it takes that place in a
    /// full claim. (A keyed row is not: whether it heads its key is known only as it is
    /// considered; it waits for the next claim.)
    fn outranks_lowest(&self, row: &Candidate) -> bool {
        // Rows read by age have no priority: they never look at the picks.
        if row.priority.is_none() || row.key.is_some() || self.running_ids.contains(&row.id) {
            return false;
        }
        let Some(lowest) = self.picks.iter().min_by_key(|pick| (self.rank(pick), std::cmp::Reverse((pick.due_at, pick.id)))) else {
            return false;
        };
        self.rank(row) > self.rank(lowest)
            && (self.has_room_for(&row.handler) || lowest.handler == row.handler)
            && !self.limited_key(row).is_some_and(|key| self.at_key_limit(&key))
    }

    fn consider(&mut self, row: Candidate) -> bool {
        if self.full() && self.outranks_lowest(&row) {
            self.make_room(1);
        }
        // One of a handler without room is left as it is: not blocked, only not taken now.
        if self.full() || self.running_ids.contains(&row.id) || !self.has_room_for(&row.handler) || !self.within_key_limit(&row) {
            return false;
        }
        let Some(key) = &row.key else {
            self.pick(row);
            return true;
        };
        let handler_key = (row.handler.clone(), key.clone());
        let is_head = self.heads.get(&handler_key).copied().flatten() == Some(row.id);
        if is_head && !self.busy_keys.contains(&handler_key) {
            self.busy_keys.insert(handler_key);
            self.pick(row);
            true
        } else {
            self.blocked.push((row.lane, row.id, handler_key));
            false
        }
    }

    /// Drops what was seen in lanes this claim did not get, so nothing there is parked.
    pub(super) fn forget_lanes(&mut self, lanes: &HashSet<LaneId>) {
        if lanes.is_empty() {
            return;
        }
        self.blocked.retain(|(lane, _, _)| !lanes.contains(lane));
    }

    pub(super) fn to_park(&self) -> Vec<DeliveryId> {
        self.blocked.iter().map(|(_, id, _)| *id).collect()
    }

    /// The keys of what it parks.
    pub(super) fn parked_keys(&self) -> impl Iterator<Item = HandlerKey> + '_ {
        self.blocked.iter().map(|(_, _, key)| key.clone())
    }
}

/// Reads the due deliveries of `lanes` page by page and lets the plan pick from them; it
/// continues past blocked keys until the batch is full or the lanes are exhausted. The lanes
/// are read in groups of [`MAX_LANES_PER_QUERY`], one after the other; it returns those of
/// the groups it did not reach, the batch being full before them (see
/// [`older_work_of_unread_lanes`]).
pub(super) async fn scan<'l, B: ClaimBackend>(
    backend: &B,
    plan: &mut Plan,
    lanes: &'l [LaneId],
    handlers: &[String],
    now: DateTime,
) -> Result<&'l [LaneId], StoreError> {
    // Read in priority order, a full claim still reads a page: what ranks above its lowest
    // picks takes their places (rows come highest first, so a page that took none ends it).
    let order = plan.read_order(handlers);
    let replacing = order == ReadOrder::Priority;
    for (group, chunk) in lanes.chunks(MAX_LANES_PER_QUERY).enumerate() {
        if plan.full() && !replacing {
            return Ok(&lanes[group * MAX_LANES_PER_QUERY..]);
        }
        let mut after = None;
        loop {
            let was_full = plan.full();
            let open = plan.open_handlers(handlers);
            if open.is_empty() {
                return Ok(&[]);
            }
            let page = ((plan.limit - plan.picks.len()) * 2).clamp(64, 1_000);
            let full_keys = plan.full_keys();
            let read = CandidateRead { order, after, running: &plan.running_ids, full_keys: &full_keys };
            let rows = backend.candidates(chunk, &open, now, read, page).await?;
            plan.recall_heads(&rows);
            let unknown = plan.unknown_keys(&rows);
            if !unknown.is_empty() {
                let heads = backend.key_heads(&unknown).await?;
                for key in unknown {
                    let head = heads.get(&key).copied();
                    plan.heads.insert(key, head);
                }
            }
            let exhausted = rows.len() < page;
            after = rows.last().map(After::of);
            let mut took = false;
            for row in rows {
                took |= plan.consider(row);
            }
            if exhausted || (plan.full() && !replacing) || (was_full && !took) {
                break;
            }
        }
    }
    Ok(&[])
}

/// Gives the held lanes a scan did not reach their turn: their due work older than the
/// claim's youngest pick takes the place of the youngest picks, up to half the claim. A scan
/// reads its lanes' groups in lane order and stops once the batch is full, so without this a
/// steady stream into the lanes of the first group would starve the later ones for as long as
/// it lasted; the claim does it at most once a second, since it costs one read to count that
/// work and one scan to pick it.
pub(super) async fn older_work_of_unread_lanes<B: ClaimBackend>(
    backend: &B,
    plan: &mut Plan,
    unread: &[LaneId],
    handlers: &[String],
) -> Result<(), StoreError> {
    let Some(youngest) = plan.youngest_due() else { return Ok(()) };
    let before = DateTime::from_millis(youngest.timestamp_millis() - 1);
    let half = (plan.limit / 2).max(1);
    let mut older = 0;
    let open = plan.open_handlers(handlers);
    for chunk in unread.chunks(MAX_LANES_PER_QUERY) {
        if older >= half || open.is_empty() {
            break;
        }
        let full_keys = plan.full_keys();
        let read = CandidateRead { full_keys: &full_keys, ..CandidateRead::plain(&plan.running_ids) };
        older += backend.candidates(chunk, &open, before, read, half - older).await?.len();
    }
    if older > 0 {
        plan.make_room(older);
        scan(backend, plan, unread, handlers, before).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An unkeyed candidate of `handler` for event `event_id`, due at `due` ms.
    fn candidate(event_id: &str, handler: &str, due: i64) -> Candidate {
        Candidate {
            id: ObjectId::new(),
            event_id: event_id.to_string(),
            handler: handler.into(),
            key: None,
            group: None,
            priority: None,
            lane: 0,
            due_at: DateTime::from_millis(due),
            claims: 0,
            attempts: 0,
            unstored: None,
            started: false,
            suspect: false,
            before_commit: None,
        }
    }

    fn key(name: &str) -> HandlerKey {
        ("h".to_string(), name.to_string())
    }

    #[test]
    fn known_heads_are_forgotten_past_their_cap_but_what_a_claim_learned_is_kept() {
        // Under the cap: what the claim looked up replaces what was known of those keys.
        let mut plan = Plan::new(1, &Rooms::default(), std::iter::empty());
        let (old, new) = (ObjectId::new(), ObjectId::new());
        plan.known_heads = HashMap::from([(key("a"), old), (key("b"), old)]);
        plan.heads = HashMap::from([(key("a"), Some(new)), (key("b"), None)]);
        assert_eq!(plan.into_known_heads(), HashMap::from([(key("a"), new)]));

        // Past it: everything known before is forgotten, and only this claim's heads stay.
        let mut plan = Plan::new(1, &Rooms::default(), std::iter::empty());
        plan.known_heads = (0..KNOWN_HEADS_MAX).map(|n| (key(&format!("k{n}")), old)).collect();
        plan.heads = HashMap::from([(key("fresh"), Some(new))]);
        assert_eq!(plan.into_known_heads(), HashMap::from([(key("fresh"), new)]));
    }

    #[test]
    fn read_by_priority_a_row_takes_the_place_of_a_lower_pick_only() {
        let row = |name: &str, priority: i32, key: Option<&str>| Candidate {
            key: key.map(str::to_string),
            priority: Some(priority),
            ..candidate(name, "h", 1)
        };
        let mut plan = Plan::new(3, &Rooms::default(), std::iter::empty());
        plan.priorities = Priorities::default().per_event(["h".to_string()]);
        for candidate in [row("a", 9, None), row("b", 9, None), row("c", 1, None)] {
            assert!(plan.consider(candidate));
        }
        assert!(plan.consider(row("d", 5, None)), "5 goes before 1");
        assert!(!plan.consider(row("e", 5, None)), "but not before 9");
        assert!(!plan.consider(row("f", 10, Some("k"))), "a keyed row waits for the next claim");
        let mut kept: Vec<&str> = plan.picks.iter().map(|pick| pick.event_id.as_str()).collect();
        kept.sort();
        assert_eq!(kept, ["a", "b", "d"]);
    }

    #[test]
    fn making_room_drops_the_lowest_priority_first_and_gives_its_room_back() {
        let row = |handler: &str, due: i64| candidate(&format!("{handler}-{due}"), handler, due);
        let rooms = Rooms::new([("low".to_string(), crate::store::Room { most: 2 })]);
        let mut plan = Plan::new(4, &rooms, std::iter::empty());
        plan.priorities = Priorities::new([("low".to_string(), 0), ("high".to_string(), 5)]);
        // The low priority's are the older: making room still drops them first.
        for candidate in [row("low", 1), row("low", 2), row("high", 3), row("high", 4)] {
            plan.consider(candidate);
        }
        assert_eq!(plan.open_handlers(&["low".to_string(), "high".to_string()]), ["high"], "`low` used its room");
        plan.make_room(1);
        let kept: Vec<&str> = plan.picks.iter().map(|pick| pick.event_id.as_str()).collect();
        assert_eq!(kept, ["high-3", "high-4", "low-1"]);
        assert_eq!(plan.missing(&["low".to_string()]), 1, "its dropped pick's place is its again");
    }
}
