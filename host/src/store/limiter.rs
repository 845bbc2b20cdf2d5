//! Limits that hold across every host: a handler's global `concurrency` and `rate`, kept in
//! one limiter document per limited handler, which each host leases a share of.
//!
//! - **Concurrency.** Each host's share is the most deliveries of the handler it may run at
//!   once. A host starts runs within its share; it asks for a bigger one while more of its
//!   deliveries wait to start than its share lets run, and shrinks it to what runs when nothing
//!   waits. The shares of all live hosts never add up to more than the limit: a share grows
//!   only into what the others' leave free, in one conditional write of the document. A share
//!   lasts a lease and is renewed with the host's leases, so a dead host's share comes back
//!   when its lane leases (and so its deliveries) do. A host that waits (its ask was cut short
//!   by the others' shares) says so in its share; the others then keep to an even part of the
//!   limit ([`ShareGrant::keep_to`]) and their shares shrink to it as their runs end, so no
//!   host starves.
//! - **Rate.** A token bucket in the same document: `max` tokens a `per`, up to `burst` kept.
//!   A host takes tokens for the deliveries waiting to start and gives back, when it has
//!   nothing left to start, those it did not use; each start costs one token, whichever host
//!   makes it.
//!
//! This module owns the arithmetic ([`LimiterState::lease`]) and the one way both stores
//! apply it ([`lease_share`]: read, compute, write if unchanged, again on a race). It never
//! claims and never counts what runs: the dispatcher tells it what its host runs.

use std::future::Future;

use bson::DateTime;

use super::StoreError;

/// What one host asks of a limited handler's limiter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ShareRequest {
    /// The global concurrency limit, if there is one.
    pub concurrency: Option<usize>,
    /// Deliveries of the handler this host runs, or may start before this ask's answer comes
    /// back (its share is never cut below).
    pub held: usize,
    /// The most it would run: what runs and what waits to start.
    pub wanted: usize,
    /// The global rate, if there is one.
    pub rate: Option<GlobalRate>,
    /// Tokens it would take for the deliveries waiting to start.
    pub tokens_wanted: usize,
    /// Tokens it took and did not use.
    pub tokens_returned: usize,
}

/// At most `max` starts a `per` across all hosts, with up to `burst` at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GlobalRate {
    pub max: usize,
    pub per_ms: i64,
    pub burst: usize,
}

/// What a host may do after its ask.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ShareGrant {
    /// Its share: the most deliveries it may run (`usize::MAX` without a concurrency limit).
    /// Never below what it runs ([`ShareRequest::held`]).
    pub share: usize,
    /// What it should keep to: its share once its runs above it ended (less than `share` only
    /// while it runs more than the others' waits leave it). It starts no run beyond it.
    pub keep_to: usize,
    /// Tokens it took: the most deliveries it may start now (`usize::MAX` without a rate).
    pub tokens: usize,
}

/// One host's share of a limiter.
#[derive(Debug, Clone, PartialEq)]
pub struct Share {
    pub host: String,
    /// The most deliveries it may run.
    pub share: usize,
    /// What it asked for; more than `share` while it waits for the others.
    pub wanted: usize,
    /// When the share lapses unless renewed (ms since the epoch).
    pub until_ms: i64,
}

/// A limiter document: the live shares and the bucket, and the version its writes check.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LimiterState {
    /// `None` before the first write.
    pub version: Option<i64>,
    pub shares: Vec<Share>,
    pub tokens: f64,
    pub refilled_at_ms: i64,
}

impl LimiterState {
    /// Applies `host`'s ask at `now_ms`, its share lasting until `until_ms`; returns the grant.
    /// Lapsed shares are dropped first. The sum of the live shares never exceeds the limit
    /// unless it did before (a limit lowered under running work), and a share never drops
    /// below what its host runs.
    pub fn lease(&mut self, host: &str, request: &ShareRequest, now_ms: i64, until_ms: i64) -> ShareGrant {
        self.shares.retain(|share| share.until_ms > now_ms && share.host != host);
        let (share, keep_to) = match request.concurrency {
            None => (usize::MAX, usize::MAX),
            Some(limit) => {
                let others: usize = self.shares.iter().map(|share| share.share).sum();
                let free = limit.saturating_sub(others);
                // While others wait, each host keeps to an even part of the limit.
                let waiting = self.shares.iter().filter(|share| share.wanted > share.share).count();
                let even = if waiting == 0 { usize::MAX } else { limit.div_ceil(waiting + 1) };
                let keep_to = request.wanted.min(free).min(even);
                let share = keep_to.max(request.held);
                if share > 0 || request.wanted > 0 {
                    self.shares.push(Share { host: host.to_string(), share, wanted: request.wanted, until_ms });
                }
                (share, keep_to)
            }
        };
        let tokens = match request.rate {
            None => usize::MAX,
            Some(rate) => {
                let elapsed = now_ms.saturating_sub(self.refilled_at_ms).max(0) as f64;
                let refill = elapsed * rate.max as f64 / rate.per_ms.max(1) as f64;
                let burst = rate.burst as f64;
                let tokens = if self.version.is_none() { burst } else { self.tokens + refill + request.tokens_returned as f64 };
                let tokens = tokens.min(burst);
                let taken = (request.tokens_wanted as f64).min(tokens.floor()).max(0.0);
                self.tokens = tokens - taken;
                self.refilled_at_ms = now_ms;
                taken as usize
            }
        };
        ShareGrant { share, keep_to, tokens }
    }
}

/// How a store keeps limiter documents: read one, and write it only if its version is the
/// one read (a document not there yet: only if still not there).
pub trait LimiterBackend: Sync {
    fn read(&self, handler: &str) -> impl Future<Output = Result<LimiterState, StoreError>> + Send;
    /// Writes `state` as `version + 1` (1 for a new document); whether it did.
    fn write_if(&self, handler: &str, state: &LimiterState) -> impl Future<Output = Result<bool, StoreError>> + Send;
}

/// How often an ask is tried again after another host's write raced it.
const RACES: usize = 16;

/// `host`'s ask of `handler`'s limiter at `now`, its share lasting `lease_ms`: read,
/// [`LimiterState::lease`], write if unchanged, again after a race.
pub async fn lease_share<B: LimiterBackend>(
    backend: &B,
    host: &str,
    handler: &str,
    request: &ShareRequest,
    now: DateTime,
    lease_ms: i64,
) -> Result<ShareGrant, StoreError> {
    let now_ms = now.timestamp_millis();
    for race in 0..RACES {
        let mut state = backend.read(handler).await?;
        let grant = state.lease(host, request, now_ms, now_ms.saturating_add(lease_ms));
        if backend.write_if(handler, &state).await? {
            return Ok(grant);
        }
        // Hosts asking at once take turns, a little apart.
        tokio::time::sleep(std::time::Duration::from_millis(1 + (race as u64 % 4))).await;
    }
    Err(StoreError::Raced(format!("the limiter of {handler} changed under {RACES} asks in a row")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ask(concurrency: usize, held: usize, wanted: usize) -> ShareRequest {
        ShareRequest { concurrency: Some(concurrency), held, wanted, ..Default::default() }
    }

    #[test]
    fn shares_never_add_up_past_the_limit_and_a_waiting_host_gets_an_even_part() {
        let mut state = LimiterState::default();
        assert_eq!(state.lease("a", &ask(4, 0, 10), 0, 1_000).share, 4);
        // b finds nothing free and waits.
        assert_eq!(state.lease("b", &ask(4, 0, 10), 1, 1_000).share, 0);
        // a still holds 4; as its runs end it keeps to half.
        let grant = state.lease("a", &ask(4, 4, 10), 2, 1_000);
        assert_eq!((grant.share, grant.keep_to), (4, 2), "it runs 4 and starts no more until it runs fewer than 2");
        assert_eq!(state.lease("a", &ask(4, 1, 10), 3, 1_000).share, 2);
        assert_eq!(state.lease("b", &ask(4, 0, 10), 4, 1_000).share, 2);
        let total: usize = state.shares.iter().map(|s| s.share).sum();
        assert_eq!(total, 4);
    }

    #[test]
    fn a_lapsed_share_comes_back_and_an_idle_host_hands_its_share_back() {
        let mut state = LimiterState::default();
        assert_eq!(state.lease("a", &ask(3, 0, 3), 0, 1_000).share, 3);
        assert_eq!(state.lease("b", &ask(3, 0, 3), 999, 2_000).share, 0);
        assert_eq!(state.lease("b", &ask(3, 0, 3), 1_000, 3_000).share, 3, "a's share lapsed");
        assert_eq!(state.lease("b", &ask(3, 0, 0), 1_001, 3_000).share, 0);
        assert!(state.shares.is_empty(), "an idle host leaves no share");
    }

    #[test]
    fn a_share_never_drops_below_what_its_host_holds() {
        let mut state = LimiterState::default();
        state.lease("a", &ask(5, 0, 5), 0, 1_000);
        // The limit was lowered to 2 while a ran 5.
        assert_eq!(state.lease("a", &ask(2, 5, 5), 1, 1_000).share, 5);
        assert_eq!(state.lease("b", &ask(2, 0, 2), 2, 1_000).share, 0);
    }

    #[test]
    fn the_bucket_refills_at_the_rate_up_to_its_burst_and_takes_back_what_was_not_used() {
        let rate = GlobalRate { max: 10, per_ms: 1_000, burst: 5 };
        let take = |wanted, returned| ShareRequest { rate: Some(rate), tokens_wanted: wanted, tokens_returned: returned, ..Default::default() };
        let mut state = LimiterState::default();
        assert_eq!(state.lease("a", &take(8, 0), 0, 1_000).tokens, 5, "a burst at first");
        state.version = Some(1);
        assert_eq!(state.lease("b", &take(8, 0), 100, 1_000).tokens, 1, "one token in 100 ms");
        assert_eq!(state.lease("a", &take(8, 0), 100, 1_000).tokens, 0);
        assert_eq!(state.lease("a", &take(8, 3), 100, 1_000).tokens, 3, "given back, taken again");
        assert_eq!(state.lease("a", &take(8, 0), 10_000, 1_000).tokens, 5, "never more than the burst");
    }
}
