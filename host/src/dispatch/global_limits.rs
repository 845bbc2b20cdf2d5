//! This host's side of limits across hosts ([`crate::store::limiter`]), held where a run
//! starts. Each delivery of a handler limited across hosts passes its handler's gate before it
//! takes a run slot: the gate lets it in while the handler runs fewer here than this host
//! keeps to of its share, spending a token in hand when the handler is rate-limited. Claims
//! and hand-outs take such a handler's work like any other's, up to what its limits could
//! start soon (see [`super::throttle`]), so its backlog is claimed ahead and handed out. The
//! loop asks the limiter ([`GlobalShares::ask`]) when a gate lacks what its waiting deliveries
//! need (a bigger share, tokens), each at most so often; shrinks the share to what runs and
//! gives the tokens back when nothing waits and a claim found no more; renews the shares with
//! the leases; closes the gates and hands everything back at a stop.
//!
//! This module owns the gates: what of each limited handler runs and waits here, what this
//! host may run of it and the tokens in hand. It never claims and never runs anything. A
//! limiter that cannot be asked leaves its gate as it was (what waits there waits for the
//! next ask), and nothing else waits for it.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bson::DateTime;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::HandlerSpec;
use crate::store::limiter::{GlobalRate, ShareGrant, ShareRequest};
use crate::store::Store;

/// How often a gate whose deliveries want to run beyond what it keeps to asks again: it may
/// grow into what other hosts left, and (when they wait) learns to keep to an even part.
const SHARE_ASK_INTERVAL: Duration = Duration::from_millis(50);
/// The least time between two asks of a gate short of tokens.
const LEAST_TOKEN_ASK_INTERVAL: Duration = Duration::from_millis(5);

/// The gates of this host's handlers limited across hosts, shared with the runs that wait at
/// them.
#[derive(Debug, Default, Clone)]
pub(super) struct GlobalShares {
    gates: Arc<Mutex<Gates>>,
}

#[derive(Debug, Default)]
struct Gates {
    by_handler: HashMap<String, Gate>,
    /// The host stops: nothing is let in any more.
    closed: bool,
    /// The asks under way in the background (a stop waits for them before it hands back).
    asking: Vec<JoinHandle<()>>,
}

/// One limited handler's gate on this host.
#[derive(Debug)]
struct Gate {
    /// This host's share: the most it may run (`usize::MAX` without a concurrency limit).
    share: usize,
    /// What it keeps to: no run starts beyond (see [`ShareGrant::keep_to`]).
    keep_to: usize,
    /// What the last ask wanted to run.
    wanted: usize,
    /// Tokens in hand (`usize::MAX` without a rate).
    tokens: usize,
    /// Let in and not ended.
    running: usize,
    /// Waiting to be let in.
    waiting: usize,
    /// The limits the gate keeps to (none before its first ask).
    limits: Option<(Option<usize>, Option<GlobalRate>)>,
    asked_at: Option<Instant>,
    /// An ask of its limiter is under way (nothing else asks it meanwhile).
    asking: bool,
    /// Woken, one waiting run at a time, as a place or a token comes free.
    opened: Arc<Notify>,
}

impl Gate {
    fn new() -> Self {
        Gate {
            share: 0,
            keep_to: 0,
            wanted: 0,
            tokens: 0,
            running: 0,
            waiting: 0,
            limits: None,
            asked_at: None,
            asking: false,
            opened: Arc::default(),
        }
    }

    /// The most it may run before the answer to an ask made now comes back: what runs, and
    /// what waits up to what it keeps to. An ask says so as what it holds, so that its share
    /// never falls below what runs.
    fn may_run(&self) -> usize {
        self.running.max(self.keep_to.min(self.running + self.waiting))
    }

    /// The tokens in hand it may give back (none without a rate).
    fn spare_tokens(&self, spec: &HandlerSpec) -> usize {
        if spec.controls.throttle.global_rate.is_some() && self.tokens != usize::MAX { self.tokens } else { 0 }
    }

    /// Whether one more run may start.
    fn lets_in(&self) -> bool {
        self.running < self.keep_to && self.tokens > 0
    }

    /// Wakes as many waiting runs as may start now.
    fn wake(&self) {
        let may_start = self.keep_to.saturating_sub(self.running).min(self.tokens).min(self.waiting);
        for _ in 0..may_start {
            self.opened.notify_one();
        }
    }

    /// Takes what `grant` gives for `request`.
    fn granted(&mut self, request: &ShareRequest, grant: ShareGrant) {
        self.share = grant.share;
        self.keep_to = grant.keep_to;
        self.wanted = request.wanted;
        if request.rate.is_some() {
            self.tokens = self.tokens.saturating_add(grant.tokens);
        }
        self.wake();
    }

    /// Takes the handler's limits now (they may have changed live): a limit it was not held to
    /// before admits nothing until asked; a limit gone lets everything in.
    fn limited_by(&mut self, limits: (Option<usize>, Option<GlobalRate>)) {
        if self.limits == Some(limits) {
            return;
        }
        let (concurrency, rate) = limits;
        let (had_concurrency, had_rate) = self.limits.map_or((false, false), |(c, r)| (c.is_some(), r.is_some()));
        if concurrency.is_none() {
            (self.share, self.keep_to) = (usize::MAX, usize::MAX);
        } else if !had_concurrency {
            self.keep_to = 0;
        }
        if rate.is_none() {
            self.tokens = usize::MAX;
        } else if !had_rate {
            self.tokens = 0;
        }
        self.limits = Some(limits);
        self.asked_at = None;
        self.wake();
    }
}

/// One delivery's place at its handler's gate: waiting until it is let in
/// ([`Place::let_in`]), then counted as running until dropped.
pub(super) struct Place {
    gates: Arc<Mutex<Gates>>,
    handler: String,
    opened: Arc<Notify>,
    running: bool,
}

impl Place {
    /// Waits until the gate lets this run in: `true`, counted as running now; `false` when
    /// the host stops first.
    pub(super) async fn let_in(&mut self) -> bool {
        loop {
            let opened = self.opened.notified();
            tokio::pin!(opened);
            opened.as_mut().enable();
            {
                let mut gates = lock(&self.gates);
                if gates.closed {
                    return false;
                }
                let gate = gates.by_handler.get_mut(&self.handler).expect("a place's gate is kept");
                if gate.lets_in() {
                    gate.waiting -= 1;
                    gate.running += 1;
                    if gate.tokens != usize::MAX {
                        gate.tokens -= 1;
                    }
                    self.running = true;
                    return true;
                }
            }
            opened.await;
        }
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut gates = lock(&self.gates);
        let Some(gate) = gates.by_handler.get_mut(&self.handler) else { return };
        if self.running {
            gate.running -= 1;
            gate.opened.notify_one();
        } else {
            gate.waiting -= 1;
        }
    }
}

fn lock(gates: &Mutex<Gates>) -> MutexGuard<'_, Gates> {
    gates.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl GlobalShares {
    /// Whether no delivery of a handler limited across hosts came here yet (nothing to ask,
    /// renew or hand back).
    pub(super) fn is_empty(&self) -> bool {
        lock(&self.gates).by_handler.is_empty()
    }

    /// A place at `handler`'s gate for a delivery about to start (it waits there).
    pub(super) fn enter(&self, handler: &str) -> Place {
        let mut gates = lock(&self.gates);
        let gate = gates.by_handler.entry(handler.to_string()).or_insert_with(Gate::new);
        gate.waiting += 1;
        Place { gates: self.gates.clone(), handler: handler.to_string(), opened: gate.opened.clone(), running: false }
    }

    /// Lets nothing in any more: what waits at a gate is not run (the host stops).
    pub(super) fn close(&self) {
        let mut gates = lock(&self.gates);
        gates.closed = true;
        for gate in gates.by_handler.values() {
            gate.opened.notify_waiters();
        }
    }

    /// Asks, in the background, the limiters whose gates lack what their waiting deliveries
    /// need: a bigger share (more run and wait than the gate keeps to), at most every
    /// [`SHARE_ASK_INTERVAL`], and tokens (fewer in hand than wait), at most as often as the
    /// bucket gains one; one ask of a gate at a time. Returns when to look again, if a gate may
    /// still lack then.
    pub(super) fn ask<S: Store>(&self, store: &Arc<S>, specs: &[HandlerSpec]) -> Option<Instant> {
        let now = Instant::now();
        let mut again: Option<Instant> = None;
        let mut later = |at: Instant| again = Some(again.map_or(at, |again: Instant| again.min(at)));
        let mut gates = lock(&self.gates);
        if gates.closed {
            return None;
        }
        let mut asks = Vec::new();
        for (handler, gate) in gates.by_handler.iter_mut() {
            let throttle = specs.iter().find(|spec| spec.handler == *handler).map(|spec| spec.controls.throttle).unwrap_or_default();
            gate.limited_by((throttle.global_concurrency, throttle.global_rate));
            let wants_share = gate.running + gate.waiting > gate.keep_to;
            let wants_tokens = gate.waiting > gate.tokens;
            let interval = match (wants_share, wants_tokens, throttle.global_rate) {
                (false, false, _) => continue,
                (_, true, Some(rate)) => token_interval(rate).min(if wants_share { SHARE_ASK_INTERVAL } else { Duration::MAX }),
                _ => SHARE_ASK_INTERVAL,
            };
            later(now + interval);
            if gate.asking || gate.asked_at.is_some_and(|asked| asked + interval > now) {
                continue;
            }
            gate.asked_at = Some(now);
            let request = ShareRequest {
                concurrency: throttle.global_concurrency,
                held: gate.may_run(),
                wanted: gate.running + gate.waiting,
                rate: throttle.global_rate,
                // As many again as what runs and waits: a backlog's next batch finds tokens in
                // hand, where the bucket has them.
                tokens_wanted: if wants_tokens { 2 * (gate.running + gate.waiting) - gate.tokens } else { 0 },
                tokens_returned: 0,
            };
            asks.push((handler.clone(), request));
        }
        for (handler, request) in asks {
            self.send(&mut gates, store, handler, request, "asking the limiter across hosts failed; its deliveries wait for the next ask");
        }
        again
    }

    /// After a claim that filled the rooms of `filled`: a handler whose room the claim did not
    /// fill (no more of its work was due) and with nothing
    /// waiting at its gate shrinks its share to what runs and gives its tokens back, in the
    /// background, so that other hosts may take them; unless its fan-outs still have events to
    /// hand out (`fanning_out`).
    pub(super) fn after_claim<S: Store>(
        &self,
        store: &Arc<S>,
        specs: &[HandlerSpec],
        filled: &HashSet<String>,
        fanning_out: bool,
    ) {
        if fanning_out {
            return;
        }
        let mut gates = lock(&self.gates);
        for spec in specs.iter().filter(|spec| spec.controls.throttle.global()) {
            let Some(gate) = gates.by_handler.get_mut(&spec.handler) else { continue };
            let spare_tokens = gate.spare_tokens(spec);
            let spare_share = spec.controls.throttle.global_concurrency.is_some() && gate.share > gate.running;
            if filled.contains(&spec.handler) || gate.asking || gate.waiting > 0 || !(spare_share || spare_tokens > 0) {
                continue;
            }
            gate.tokens -= spare_tokens;
            let request = ShareRequest {
                concurrency: spec.controls.throttle.global_concurrency,
                held: gate.may_run(),
                wanted: gate.running,
                rate: spec.controls.throttle.global_rate,
                tokens_wanted: 0,
                tokens_returned: spare_tokens,
            };
            self.send(&mut gates, store, spec.handler.clone(), request, "handing back a share across hosts failed; it lapses with the lease");
        }
    }

    /// Renews, in the background, every share this host holds or waits for (with its leases);
    /// a gate whose ask is under way is renewed by it.
    pub(super) fn renew<S: Store>(&self, store: &Arc<S>, specs: &[HandlerSpec]) {
        let mut gates = lock(&self.gates);
        for spec in specs.iter().filter(|spec| spec.controls.throttle.global_concurrency.is_some()) {
            let Some(gate) = gates.by_handler.get_mut(&spec.handler) else { continue };
            if gate.asking || (gate.share == 0 && gate.wanted == 0) {
                continue;
            }
            let request = ShareRequest {
                concurrency: spec.controls.throttle.global_concurrency,
                held: gate.may_run(),
                wanted: gate.running + gate.waiting,
                ..Default::default()
            };
            self.send(&mut gates, store, spec.handler.clone(), request, "renewing a share across hosts failed");
        }
    }

    /// Hands every share and the tokens in hand back, once the asks under way came back (a
    /// stop, after the gates closed and the last run settled).
    pub(super) async fn hand_back<S: Store>(&self, store: &S, specs: &[HandlerSpec]) {
        let asking = std::mem::take(&mut lock(&self.gates).asking);
        futures::future::join_all(asking).await;
        for spec in specs.iter().filter(|spec| spec.controls.throttle.global()) {
            let request = {
                let mut gates = lock(&self.gates);
                let Some(gate) = gates.by_handler.get_mut(&spec.handler) else { continue };
                let spare_tokens = gate.spare_tokens(spec);
                let holds = spec.controls.throttle.global_concurrency.is_some() && (gate.share > 0 || gate.wanted > 0);
                if !holds && spare_tokens == 0 {
                    continue;
                }
                gate.tokens -= spare_tokens;
                ShareRequest {
                    concurrency: spec.controls.throttle.global_concurrency,
                    rate: spec.controls.throttle.global_rate.filter(|_| spare_tokens > 0),
                    tokens_returned: spare_tokens,
                    ..Default::default()
                }
            };
            if let Err(error) = store.lease_share(&spec.handler, &request, DateTime::now()).await {
                tracing::warn!(%error, handler = %spec.handler, "handing back a share across hosts failed; it lapses with the lease");
            }
        }
    }

    /// Sends `request` to `handler`'s limiter in the background (its gate asks nothing else
    /// meanwhile); the grant is the gate's when it comes back, or `failed` is logged.
    fn send<S: Store>(&self, gates: &mut Gates, store: &Arc<S>, handler: String, request: ShareRequest, failed: &'static str) {
        if let Some(gate) = gates.by_handler.get_mut(&handler) {
            gate.asking = true;
        }
        let (store, shared) = (store.clone(), self.gates.clone());
        let asking = tokio::spawn(async move {
            let grant = store.lease_share(&handler, &request, DateTime::now()).await;
            let mut gates = lock(&shared);
            let Some(gate) = gates.by_handler.get_mut(&handler) else { return };
            gate.asking = false;
            match grant {
                Ok(grant) => gate.granted(&request, grant),
                Err(error) => tracing::warn!(%error, handler = %handler, "{failed}"),
            }
        });
        gates.asking.retain(|asking| !asking.is_finished());
        gates.asking.push(asking);
    }
}

/// How long `rate`'s bucket takes to gain a token (at least [`LEAST_TOKEN_ASK_INTERVAL`]).
fn token_interval(rate: GlobalRate) -> Duration {
    let millis = rate.per_ms.max(1) as u128 / rate.max.max(1) as u128;
    Duration::from_millis(millis as u64).max(LEAST_TOKEN_ASK_INTERVAL)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gates_with(handler: &str, keep_to: usize, tokens: usize) -> GlobalShares {
        let shares = GlobalShares::default();
        let mut gate = Gate::new();
        (gate.share, gate.keep_to, gate.tokens) = (keep_to, keep_to, tokens);
        lock(&shares.gates).by_handler.insert(handler.to_string(), gate);
        shares
    }

    fn counts(shares: &GlobalShares, handler: &str) -> (usize, usize, usize) {
        let gates = lock(&shares.gates);
        let gate = &gates.by_handler[handler];
        (gate.running, gate.waiting, gate.tokens)
    }

    #[tokio::test]
    async fn a_gate_lets_in_what_its_share_and_tokens_allow_and_the_next_as_a_run_ends() {
        let shares = gates_with("h", 2, 3);
        let mut places: Vec<Place> = (0..4).map(|_| shares.enter("h")).collect();
        assert!(places[0].let_in().await && places[1].let_in().await);
        assert_eq!(counts(&shares, "h"), (2, 2, 1), "two run, two wait, one token left");
        // The third waits until a run ends.
        let mut third = places.remove(2);
        let waiting = tokio::spawn(async move { third.let_in().await.then_some(third) });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished(), "let in beyond the share");
        drop(places.remove(0));
        let third = tokio::time::timeout(Duration::from_secs(1), waiting).await.unwrap().unwrap().expect("let in");
        assert_eq!(counts(&shares, "h"), (2, 1, 0));
        // Out of tokens, the last waits although a run ends; a close sends it away.
        drop(third);
        let mut last = places.pop().unwrap();
        let waiting = tokio::spawn(async move {
            let let_in = last.let_in().await;
            drop(last);
            let_in
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished(), "let in without a token");
        shares.close();
        assert!(!tokio::time::timeout(Duration::from_secs(1), waiting).await.unwrap().unwrap(), "a closed gate lets nothing in");
        assert_eq!(counts(&shares, "h"), (1, 0, 0), "the one left running; nothing waits");
    }

    /// A gate lets runs in while its ask is under way: the ask says what it may run by then, so
    /// the share it gets never falls below what runs, and another host gets no more than the
    /// limit leaves.
    #[tokio::test]
    async fn an_ask_under_way_counts_what_the_gate_may_let_in_meanwhile() {
        use crate::store::limiter::LimiterState;
        let limit = 3;
        let ask = |held: usize, wanted: usize| ShareRequest { concurrency: Some(limit), held, wanted, ..Default::default() };
        let mut limiter = LimiterState::default();
        let shares = gates_with("h", 3, usize::MAX);
        let grant = limiter.lease("a", &ask(0, 3), 0, 1_000);
        let mut places: Vec<Place> = (0..6).map(|_| shares.enter("h")).collect();
        assert!(places[0].let_in().await);
        // b waits for a share; a asks while it runs one and five wait...
        assert_eq!(limiter.lease("b", &ask(0, 3), 1, 1_000).share, 0);
        let request = {
            let gates = lock(&shares.gates);
            let gate = &gates.by_handler["h"];
            ask(gate.may_run(), gate.running + gate.waiting)
        };
        // ...and lets two more in before the answer comes back.
        assert!(places[1].let_in().await && places[2].let_in().await);
        let answer = limiter.lease("a", &request, 2, 1_000);
        assert_eq!((grant.share, answer.keep_to), (3, 2), "b waits: a keeps to an even part");
        assert_eq!(answer.share, 3, "a's share covers the three it runs");
        assert_eq!(limiter.lease("b", &ask(0, 3), 3, 1_000).share, 0, "nothing is free while a runs three");
        lock(&shares.gates).by_handler.get_mut("h").unwrap().granted(&request, answer);
        let mut fourth = places.remove(3);
        assert!(tokio::time::timeout(Duration::from_millis(20), fourth.let_in()).await.is_err(), "a keeps to two");
    }

    #[test]
    fn limits_changed_live_hold_the_gate_until_asked_or_open_it() {
        let shares = gates_with("h", usize::MAX, usize::MAX);
        let mut gates = lock(&shares.gates);
        let gate = gates.by_handler.get_mut("h").unwrap();
        gate.limited_by((None, None));
        assert!(gate.lets_in(), "no limit: a gate never asked lets everything in");
        gate.limited_by((Some(3), None));
        assert!(!gate.lets_in(), "a new concurrency limit admits nothing until asked");
        gate.limited_by((Some(3), Some(GlobalRate { max: 1, per_ms: 1_000, burst: 1 })));
        assert_eq!(gate.tokens, 0, "a new rate has no tokens until asked");
        gate.limited_by((None, None));
        assert!(gate.lets_in(), "no limit left");
    }
}
