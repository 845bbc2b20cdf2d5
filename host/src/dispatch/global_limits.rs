//! This host's side of limits across hosts ([`crate::store::limiter`]): before a claim, each
//! handler limited across hosts asks its limiter for the share and tokens the claim could use
//! (and as many again, for the hand-outs until the next claim), which narrow its room; a
//! fan-out hands out within the share and tokens in hand, without asking; each start spends a
//! token; after a claim that did not fill its room, the share shrinks to what is held and the
//! tokens go back; the shares are renewed with the leases and handed back at a stop.
//!
//! This module owns what this host last asked of each limiter and the tokens in hand. It
//! never claims and never counts what runs (the loop tells it what it holds). A limiter that
//! cannot be asked leaves its handler no room for that claim, and nothing else waits for it.

use std::collections::HashMap;

use bson::DateTime;

use super::HandlerSpec;
use crate::store::limiter::{ShareGrant, ShareRequest};
use crate::store::{ClaimedDelivery, Room, Rooms, Store};

/// What this host holds of each limiter, by handler.
#[derive(Debug, Default)]
pub(super) struct GlobalShares {
    by_handler: HashMap<String, Asked>,
}

/// This host's last ask of one limiter and what it left.
#[derive(Debug, Default, Clone, Copy)]
struct Asked {
    /// The share granted (0 when none is held).
    share: usize,
    /// What it asked to hold.
    wanted: usize,
    /// The room the last claim was given.
    room: usize,
    /// Tokens taken and not spent yet (each start spends one).
    unused_tokens: usize,
    /// The last ask got fewer tokens than it wanted.
    short_of_tokens: bool,
}

impl GlobalShares {
    /// Whether this host ever asked a limiter (nothing to renew or hand back otherwise).
    pub(super) fn is_empty(&self) -> bool {
        self.by_handler.is_empty()
    }

    /// Narrows `rooms` for a claim of up to `total` deliveries: each handler of `specs`
    /// limited across hosts gets no more than its share leaves above what this host holds
    /// (`held`), and, rate-limited, the tokens it could take.
    pub(super) async fn before_claim<S: Store>(
        &mut self,
        store: &S,
        specs: &[HandlerSpec],
        rooms: Rooms,
        total: usize,
        held: impl Fn(&str) -> usize,
    ) -> Rooms {
        if !specs.iter().any(|spec| spec.throttle.global()) {
            return rooms;
        }
        let mut narrowed: Vec<(String, Room)> = rooms.iter().map(|(handler, room)| (handler.clone(), *room)).collect();
        for (handler, room) in narrowed.iter_mut() {
            let Some(spec) = specs.iter().find(|spec| spec.handler == *handler && spec.throttle.global()) else { continue };
            let held = held(handler);
            let more = room.most.min(total);
            let asked = self.by_handler.entry(handler.clone()).or_default();
            let request = ShareRequest {
                concurrency: spec.throttle.global_concurrency,
                held,
                wanted: held + more,
                rate: spec.throttle.global_rate,
                tokens_wanted: if spec.throttle.global_rate.is_some() { more.saturating_mul(2) } else { 0 },
                tokens_returned: std::mem::take(&mut asked.unused_tokens),
            };
            room.most = match store.lease_share(handler, &request, DateTime::now()).await {
                Ok(ShareGrant { share, tokens }) => {
                    let most = more.min(share.saturating_sub(held)).min(tokens);
                    let rated = request.rate.is_some();
                    let short_of_tokens = rated && tokens < more;
                    *asked = Asked { share, wanted: request.wanted, room: most, unused_tokens: if rated { tokens } else { 0 }, short_of_tokens };
                    most
                }
                Err(error) => {
                    tracing::warn!(%error, handler = %handler, "asking the limiter across hosts failed; its handler waits for the next claim");
                    0
                }
            };
        }
        Rooms::new(narrowed)
    }

    /// Narrows `rooms` for a fan-out's hand-out of up to `total` deliveries to what this host
    /// has in hand of each handler's share and tokens (`held` of its deliveries held), without
    /// asking its limiter. Also whether one wanted more than it had: the next claim asks.
    pub(super) fn within_hand(&self, specs: &[HandlerSpec], rooms: Rooms, total: usize, held: impl Fn(&str) -> usize) -> (Rooms, bool) {
        if !specs.iter().any(|spec| spec.throttle.global()) {
            return (rooms, false);
        }
        let mut short = false;
        let mut narrowed: Vec<(String, Room)> = rooms.iter().map(|(handler, room)| (handler.clone(), *room)).collect();
        for (handler, room) in narrowed.iter_mut() {
            let Some(spec) = specs.iter().find(|spec| spec.handler == *handler && spec.throttle.global()) else { continue };
            let asked = self.by_handler.get(handler).copied().unwrap_or_default();
            let share = if spec.throttle.global_concurrency.is_some() { asked.share } else { usize::MAX };
            let tokens = if spec.throttle.global_rate.is_some() { asked.unused_tokens } else { usize::MAX };
            let more = room.most.min(total);
            let most = more.min(share.saturating_sub(held(handler))).min(tokens);
            short |= most < more;
            room.most = most;
        }
        (Rooms::new(narrowed), short)
    }

    /// Spends a token of `handler`'s, whose delivery starts now.
    pub(super) fn started(&mut self, handler: &str) {
        if let Some(asked) = self.by_handler.get_mut(handler) {
            asked.unused_tokens = asked.unused_tokens.saturating_sub(1);
        }
    }

    /// How many of `claimed` each handler limited across hosts took (nothing is counted
    /// without such a handler).
    pub(super) fn taken(specs: &[HandlerSpec], claimed: &[ClaimedDelivery]) -> HashMap<String, usize> {
        let mut taken = HashMap::new();
        for spec in specs.iter().filter(|spec| spec.throttle.global()) {
            taken.insert(spec.handler.clone(), claimed.iter().filter(|c| c.handler == spec.handler).count());
        }
        taken
    }

    /// After a claim that took `taken` of each (see [`GlobalShares::taken`]; their starts
    /// spent their tokens): a handler whose room the claim did not fill (no more of its work was
    /// due) shrinks its share to what this host holds now (`held`) and gives its tokens back,
    /// so that other hosts may take the rest; unless its fan-outs still have events to hand
    /// out (`fanning_out`), which the share and tokens in hand are for.
    pub(super) async fn after_claim<S: Store>(
        &mut self,
        store: &S,
        specs: &[HandlerSpec],
        taken: &HashMap<String, usize>,
        fanning_out: bool,
        held: impl Fn(&str) -> usize,
    ) {
        if fanning_out {
            return;
        }
        for spec in specs.iter().filter(|spec| spec.throttle.global()) {
            let Some(asked) = self.by_handler.get_mut(&spec.handler) else { continue };
            let count = taken.get(&spec.handler).copied().unwrap_or(0);
            if count < asked.room {
                let held = held(&spec.handler);
                let request = ShareRequest {
                    concurrency: spec.throttle.global_concurrency,
                    held,
                    wanted: held,
                    rate: spec.throttle.global_rate,
                    tokens_wanted: 0,
                    tokens_returned: std::mem::take(&mut asked.unused_tokens),
                };
                match store.lease_share(&spec.handler, &request, DateTime::now()).await {
                    Ok(grant) => *asked = Asked { share: grant.share, wanted: held, room: 0, ..Asked::default() },
                    Err(error) => tracing::warn!(%error, handler = %spec.handler, "handing back a share across hosts failed; it lapses with the lease"),
                }
            }
        }
    }

    /// When a claim should look again for a handler whose last ask was short of tokens: once
    /// the bucket has had time for one more.
    pub(super) fn next_token_in(&self, specs: &[HandlerSpec]) -> Option<std::time::Duration> {
        specs
            .iter()
            .filter(|spec| self.by_handler.get(&spec.handler).is_some_and(|asked| asked.short_of_tokens))
            .filter_map(|spec| spec.throttle.global_rate)
            .map(|rate| std::time::Duration::from_millis((rate.per_ms / rate.max.max(1) as i64).max(5) as u64))
            .min()
    }

    /// Renews every share this host holds or waits for (with its leases), or hands them all
    /// back (`stop`: after the last run settled).
    pub(super) async fn renew<S: Store>(&mut self, store: &S, specs: &[HandlerSpec], held: impl Fn(&str) -> usize, stop: bool) {
        for spec in specs.iter().filter(|spec| spec.throttle.global_concurrency.is_some()) {
            let Some(asked) = self.by_handler.get_mut(&spec.handler) else { continue };
            if asked.share == 0 && asked.wanted == 0 {
                continue;
            }
            let held = if stop { 0 } else { held(&spec.handler) };
            let request = ShareRequest {
                concurrency: spec.throttle.global_concurrency,
                held,
                wanted: if stop { 0 } else { asked.wanted.max(held) },
                ..Default::default()
            };
            match store.lease_share(&spec.handler, &request, DateTime::now()).await {
                Ok(grant) => {
                    asked.share = grant.share;
                    asked.wanted = request.wanted;
                }
                Err(error) => tracing::warn!(%error, handler = %spec.handler, "renewing a share across hosts failed"),
            }
        }
    }
}
