//! `relayhost backfill`: gives a handler added later the older events it never had, in
//! bounded batches, through the running hosts' fan-outs (see `relayhost::store::backfill`).
//! It owns the batches and the waiting; what may be reopened is the store's.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use bson::{Bson, DateTime};
use clap::Args;
use relayhost::config::Config;
use relayhost::store::{Administration, Hosts};

use crate::admin::with_store;

#[derive(Args)]
pub struct BackfillArgs {
    /// The registered handler that is to get the older events it never had.
    #[arg(long)]
    handler: String,
    /// Only events of this type (repeatable; the handler's registered types by default).
    #[arg(long = "type")]
    types: Vec<String>,
    /// Only events created at this time or later (RFC 3339, e.g. 2026-12-01T00:00:00Z).
    #[arg(long)]
    since: Option<String>,
    /// Events reopened at a time: the next batch waits until the hosts fanned this one out.
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    batch: u32,
    /// How long a batch may wait for the hosts' fan-outs before the backfill gives up, in
    /// seconds (run it again: it goes on where it stopped).
    #[arg(long, default_value_t = 120)]
    wait: u64,
}

/// How often a batch that the hosts fanned out without the handler is tried again (they
/// read the registry about once a second) before the backfill gives up.
const UNHEARD_ROUNDS: u32 = 5;

pub async fn backfill(config: &Config, args: BackfillArgs) -> Result<ExitCode> {
    let since = match &args.since {
        Some(text) => Some(DateTime::parse_rfc3339_str(text).map_err(|_| anyhow::anyhow!("--since: {text:?} is not an RFC 3339 time"))?),
        None => None,
    };
    with_store(config, async |store| {
        let registry = store.registered_handlers(DateTime::now()).await?;
        let Some(handler) = registry.iter().find(|h| h.handler == args.handler) else {
            bail!("handler {:?} is not registered: start a host that serves it first (`relayhost handlers list` shows the registry)", args.handler);
        };
        if !handler.active() {
            bail!("handler {:?} is retired: fan-outs create none of its deliveries", args.handler);
        }
        let types: Vec<String> = if args.types.is_empty() { handler.event_types.iter().cloned().collect() } else { args.types.clone() };
        if let Some(unknown) = types.iter().find(|t| !handler.event_types.contains(*t)) {
            bail!("handler {:?} does not subscribe to {unknown:?} (it subscribes to {:?})", args.handler, handler.event_types);
        }
        let (mut total, mut unheard, mut last): (usize, u32, Vec<Bson>) = (0, 0, Vec::new());
        let mut waiting_since: Option<Instant> = None;
        loop {
            let ids = store.reopen_for(&args.handler, &types, since, args.batch as usize).await?;
            if ids.is_empty() {
                // Events whose delivery to another handler runs without a document just now
                // are reopened once that run ended.
                let waiting = store.backfill_waiting(&args.handler, &types, since).await?;
                if waiting == 0 {
                    break;
                }
                let waiting_since = *waiting_since.get_or_insert_with(Instant::now);
                if waiting_since.elapsed() >= Duration::from_secs(args.wait) {
                    bail!(
                        "{waiting} events still have a delivery running without a document after {}s, and were not reopened: run the backfill again once those runs ended ({total} reopened)",
                        args.wait
                    );
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
            waiting_since = None;
            if ids == last {
                // Fanned out again without it: the hosts may not have read the registry yet.
                unheard += 1;
                if unheard > UNHEARD_ROUNDS {
                    bail!("the hosts fan these events out without a delivery for {:?}: does a running host know it (`relayhost handlers list`)?", args.handler);
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            } else {
                total += ids.len();
                println!("reopened {} events for {} ({total} so far)", ids.len(), args.handler);
            }
            let deadline = Instant::now() + Duration::from_secs(args.wait);
            loop {
                let waiting = store.unfanned_among(&ids).await?;
                if waiting == 0 {
                    break;
                }
                if Instant::now() >= deadline {
                    bail!("{waiting} reopened events still wait for a fan-out after {}s: is a host running? (run the backfill again to go on)", args.wait);
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            last = ids;
        }
        println!("backfilled {total} events for {}", args.handler);
        Ok(ExitCode::SUCCESS)
    })
    .await
}
