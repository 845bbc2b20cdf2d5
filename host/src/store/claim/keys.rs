//! What a `Claimer` knows of keys beyond their documents: the keys its unsettled leases run
//! (a key's head handed out without a document is pending nowhere else), the keys whose
//! deliveries wait for a claim, or whose events wait for a fan-out, once one of theirs
//! settles, and the keys whose known heads its claims must forget. It must never read or
//! write the store.

use super::*;

/// What a fan-out knew of this instance's keys before it read which keys have nothing
/// pending ([`Claimer::before_idle_read`]). A key's head handed out without a document is
/// pending only here, so the fan-out takes the keys running here out of those it found idle;
/// taken before the read, since a settling writes a head's record before it counts its lease
/// settled, a key taken to run here then, or found pending after, is never missed by both
/// (taken after, a head whose record landed past the read's snapshot and whose lease settled
/// before this would be neither). A takeover's charge gives a head that ran without a
/// document its document without a lease of this instance in between: a hand-out after a
/// charge made since then hands out no key's head ([`Claimer::hand_out`]).
pub struct KeysBeforeRead {
    /// The keys of leases this instance issued and has not seen settled.
    pub running: HashSet<HandlerKey>,
    takeovers_charged: u64,
}

/// Where a test holds a fan-out up, to let something happen in between.
#[cfg(test)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HoldUp {
    /// As it takes what it knows of keys before its read ([`Claimer::before_idle_read`]).
    KeysRead,
    /// As its hand-out starts, before it takes the lanes' lock ([`Claimer::hand_out`]).
    HandOut,
}

impl Claimer {
    /// What a fan-out that may hand out keys' heads must know of this instance before it
    /// reads the store for what is pending: the keys running here, and the takeover charges
    /// made so far (see [`KeysBeforeRead`]). In MongoDB, taken before the fan-out's
    /// transaction begins: it reads from a snapshot of its first read.
    pub async fn before_idle_read(&self) -> KeysBeforeRead {
        #[cfg(test)]
        self.held_up(HoldUp::KeysRead).await;
        let takeovers_charged = self.takeovers_charged.load(Ordering::SeqCst);
        let issued = self.issued.lock().expect("issued leases");
        KeysBeforeRead { running: issued.values().filter_map(|issued| issued.key.clone()).collect(), takeovers_charged }
    }

    /// Whether a takeover charge was made since `keys` were taken: its charge may have given
    /// a key's head that ran without a document its document, after the fan-out's read.
    pub(super) fn charged_since(&self, keys: &KeysBeforeRead) -> bool {
        self.takeovers_charged.load(Ordering::SeqCst) != keys.takeovers_charged
    }

    /// Holds up this instance's next fan-out at `at` until the second `Notify` is notified;
    /// the first is notified when it gets there.
    #[cfg(test)]
    pub(crate) fn hold_up(&self, at: HoldUp) -> (std::sync::Arc<tokio::sync::Notify>, std::sync::Arc<tokio::sync::Notify>) {
        let gate = (std::sync::Arc::new(tokio::sync::Notify::new()), std::sync::Arc::new(tokio::sync::Notify::new()));
        self.hold_ups.lock().expect("hold-ups").push((at, gate.0.clone(), gate.1.clone()));
        gate
    }

    #[cfg(test)]
    pub(super) async fn held_up(&self, at: HoldUp) {
        let gate = {
            let mut hold_ups = self.hold_ups.lock().expect("hold-ups");
            hold_ups.iter().position(|(step, _, _)| *step == at).map(|i| hold_ups.remove(i))
        };
        if let Some((_, arrived, proceed)) = gate {
            arrived.notify_one();
            proceed.notified().await;
        }
    }

    /// The ordering keys (of any handler) of the leases this instance issued and has not seen
    /// settled. A fan-out that may hand out leaves their unfanned events unfanned: none of
    /// them could run before that lease settles, and a follower created parked would then
    /// wait for a claim (see [`Claimer::unfanned_may_wait`]).
    pub fn keys_running_here(&self) -> HashSet<String> {
        let issued = self.issued.lock().expect("issued leases");
        issued.values().filter_map(|issued| issued.key.as_ref().map(|(_, key)| key.clone())).collect()
    }

    /// Notes what a fan-out's report says of keys: the keys of the deliveries it left to
    /// claims (see [`Claimer::followers_may_wait`]), and those whose events it left unfanned
    /// (see [`Claimer::unfanned_may_wait`]). A key whose head it handed out had nothing
    /// pending in the store: it is awaited no more, unless the same fan-out left some of its
    /// deliveries to claims. (Noted for good, a key that waited for claims once, while hosts
    /// split the lanes say, had each later completion ask for a claim that found nothing,
    /// and a claim holds the next hand-out back.)
    pub fn note_fan_out(&self, report: &FanOutReport) {
        if !report.handed_out_keys.is_empty() {
            let mut awaited = self.awaited_keys.lock().expect("awaited keys");
            for key in &report.handed_out_keys {
                awaited.remove(key);
            }
        }
        self.note_awaited(report.left_to_claims.iter().cloned());
        if !report.deferred_keys.is_empty() {
            // Past as many keys as heads are known, the notes start over (a key's events are
            // then fanned out by the next backlog batch or poll).
            let mut deferred = self.deferred_keys.lock().expect("deferred keys");
            if deferred.len() >= KNOWN_HEADS_MAX {
                deferred.clear();
            }
            deferred.extend(report.deferred_keys.iter().cloned());
        }
    }

    /// Whether events of `key` were left unfanned because a delivery of theirs ran here (see
    /// [`Claimer::keys_running_here`]): once it settles, a fan-out is to read them. Asked
    /// once per settled delivery; the key's note is then taken (a fan-out that leaves its
    /// events unfanned again notes it again).
    pub fn unfanned_may_wait(&self, key: &str) -> bool {
        self.deferred_keys.lock().expect("deferred keys").remove(key)
    }

    /// Keys whose later events a fan-out that hands out left unfanned (see
    /// [`crate::store::fan_out::heads_of_idle_keys`]), each with the sequence the next such
    /// fan-out reads it up to. That fan-out reads them apart: never among its oldest events,
    /// where a busy key's events would pile up at the front and fill its batches, but each up
    /// to its sequence, by its key's prefix read (which also takes any lower event of the key
    /// still unfanned, so a sequence noted too high skips nothing). A key whose read finds
    /// nothing is dropped, and its events are read among the oldest again.
    pub fn keys_left_out(&self) -> HashMap<String, i64> {
        self.left_out.lock().expect("left-out keys").clone()
    }

    /// Notes what a fan-out that hands out did with the keys it read apart (`asked`, see
    /// [`Claimer::keys_left_out`]) and those whose later events it left unfanned (`left`,
    /// with their lowest left out): a key of `asked` whose events are in `fanned` is read up to
    /// the next sequence after them next time, one with none is dropped. Returns the keys
    /// whose next events wait for a fan-out once what runs of them settles: those noted, and
    /// every key of `left` (one left out at a sequence that is not an integer is read among
    /// the oldest again, not apart). Past
    /// [`LEFT_OUT_MAX`] keys the notes start over.
    pub fn note_left_out(&self, asked: &[String], fanned: &[Document], left: &[(String, Option<i64>)]) -> Vec<String> {
        let mut notes = self.left_out.lock().expect("left-out keys");
        for key in asked {
            notes.remove(key);
        }
        let mut noted = Vec::new();
        for doc in fanned {
            let Some(key) = crate::event::string_key(doc) else { continue };
            if !asked.iter().any(|asked| asked == key) {
                continue;
            }
            let Some(next) = crate::store::fan_out::integer_sequence(doc).map(|n| n.saturating_add(1)) else { continue };
            let at = notes.entry(key.to_string()).or_insert(next);
            *at = (*at).max(next);
            noted.push(key.to_string());
        }
        for (key, lowest) in left {
            if let Some(lowest) = lowest {
                notes.insert(key.clone(), *lowest);
            }
            noted.push(key.clone());
        }
        if notes.len() > LEFT_OUT_MAX {
            notes.clear();
        }
        noted
    }

    /// Has claims forget what they know of `keys`' heads (see [`Claimer::forgotten_heads`]).
    pub(super) fn forget_heads(&self, keys: impl IntoIterator<Item = HandlerKey>) {
        self.forgotten_heads.lock().expect("forgotten heads").extend(keys);
    }

    /// Takes the keys claims are to forget the heads of out of `heads`; with `drain`, the
    /// keys count as forgotten from then on (a claim writing back what it learned).
    pub(super) fn drop_forgotten_heads<T>(&self, heads: &mut HashMap<HandlerKey, T>, drain: bool) {
        let mut forgotten = self.forgotten_heads.lock().expect("forgotten heads");
        if !forgotten.is_empty() {
            heads.retain(|key, _| !forgotten.contains(key));
        }
        if drain {
            forgotten.clear();
        }
    }

    /// Takes the keys claims are to forget the heads of out of what `plan` knows: a take in
    /// the middle of a claim may have charged a delivery of theirs.
    pub(super) fn forget_heads_in(&self, plan: &mut Plan) {
        self.drop_forgotten_heads(&mut plan.heads, false);
        self.drop_forgotten_heads(&mut plan.known_heads, false);
    }

    /// Notes keys whose deliveries this instance's fan-outs left to claims, or its claims
    /// parked: they may wait for a claim once one of their key settles. Past
    /// [`KNOWN_HEADS_MAX`] keys the notes start over; the keys forgotten are left to the
    /// unpark sweep.
    pub fn note_awaited(&self, keys: impl IntoIterator<Item = HandlerKey>) {
        let mut awaited = self.awaited_keys.lock().expect("awaited keys");
        for key in keys {
            if awaited.len() >= KNOWN_HEADS_MAX {
                awaited.clear();
            }
            awaited.insert(key);
        }
    }

    /// Whether deliveries of `key` may wait for a claim once one of theirs settles (see
    /// [`Claimer::note_awaited`]). A key's deliveries handed out by its fan-outs, one after
    /// the other, need none: its completions then ask for no claim.
    pub fn followers_may_wait(&self, key: &HandlerKey) -> bool {
        self.awaited_keys.lock().expect("awaited keys").contains(key)
    }
}

/// How many keys a claimer notes as left out at most (see [`Claimer::keys_left_out`]): each
/// is one more condition in every batch's read.
const LEFT_OUT_MAX: usize = 1_000;
