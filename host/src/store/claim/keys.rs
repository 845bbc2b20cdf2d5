//! What a `Claimer` knows of keys beyond their documents: the keys its unsettled leases run
//! (a key's head handed out without a document is pending nowhere else), the keys whose
//! deliveries wait for a claim, or whose events wait for a fan-out, once one of theirs
//! settles, and the keys whose known heads its claims must forget. It must never read or
//! write the store.

use super::*;

impl Claimer {
    /// Takes out of `idle` (keys of which nothing is pending in the store) the keys of leases
    /// this instance issued and has not seen settled: a key's head handed out without a
    /// document is pending only here (its lane's holder is the only one that runs its lane's
    /// work), and a fan-out must not hand out the key's next delivery beside it.
    pub fn drop_running_keys(&self, idle: &mut HashSet<HandlerKey>) {
        if idle.is_empty() {
            return;
        }
        let issued = self.issued.lock().expect("issued leases");
        for key in issued.values().filter_map(|issued| issued.key.as_ref()) {
            idle.remove(key);
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
    /// (see [`Claimer::unfanned_may_wait`]).
    pub fn note_fan_out(&self, report: &FanOutReport) {
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
