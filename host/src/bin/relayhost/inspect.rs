//! What is stuck, and what to do with it: `deliveries list|requeue|bury` by filter, and
//! `events show`. Every filter value reaches the store as a literal (never a query operator);
//! the bulk actions say how many they would change and act only with `--yes`.

use relayhost::store::Administration;
use std::process::ExitCode;

use anyhow::{Result, bail};
use bson::DateTime;
use clap::Subcommand;
use relayhost::admin::api::delivery_json;
use relayhost::admin::bulk::{self, BulkReport};
use relayhost::admin::filters::Filters;
use relayhost::config::Config;
use relayhost::store::{DeliveryFilter, DeliveryView, Listed};

use super::admin::with_store;

#[derive(Subcommand)]
pub enum DeliveriesCommand {
    /// Lists deliveries by filter, oldest first, a page at a time.
    List {
        #[command(flatten)]
        filters: Filters,
        /// Continue after this delivery id (printed at the end of a full page).
        #[arg(long)]
        after: Option<String>,
        #[arg(long, default_value_t = 100)]
        limit: usize,
        #[arg(long)]
        json: bool,
    },
    /// Makes the dead deliveries the filters match pending again, due now, attempts reset.
    Requeue {
        #[command(flatten)]
        filters: Filters,
        #[arg(long)]
        yes: bool,
    },
    /// Makes the pending deliveries the filters match dead (each announced like any death);
    /// one whose lane is leased is refused, naming the host and until when.
    Bury {
        #[command(flatten)]
        filters: Filters,
        #[arg(long, default_value = "buried by an operator")]
        reason: String,
        #[arg(long)]
        yes: bool,
    },
}

#[derive(Subcommand)]
pub enum EventsCommand {
    /// An event as stored (the host's marks included), its deliveries, and which handlers
    /// completed it when (with completion history).
    Show {
        id: String,
        #[arg(long)]
        json: bool,
    },
}

fn state(view: &DeliveryView) -> &'static str {
    Listed::of(view).as_str()
}

/// Prints what a bulk action did, and exits non-zero when it left some as they were.
fn report(did: &str, of: &str, report: &BulkReport) -> ExitCode {
    for (id, why) in &report.refused {
        println!("{id}: {why}");
    }
    println!("{did} {} of {} {of}", report.done, report.matched);
    if report.done == report.matched { ExitCode::SUCCESS } else { ExitCode::FAILURE }
}

fn shown(at: DateTime) -> String {
    at.try_to_rfc3339_string().unwrap_or_default()
}

pub async fn deliveries(config: &Config, command: DeliveriesCommand) -> Result<ExitCode> {
    with_store(config, async |store| match command {
        DeliveriesCommand::List { filters, after, limit, json } => {
            let mut filter = filters.filter(None).map_err(anyhow::Error::msg)?;
            filter.after = after;
            filter.limit = limit;
            let page = store.list_deliveries(&filter).await?;
            if json {
                let rows: Vec<serde_json::Value> = page.deliveries.iter().map(delivery_json).collect();
                println!("{}", serde_json::to_string_pretty(&serde_json::json!({ "deliveries": rows, "next": page.next }))?);
                return Ok(ExitCode::SUCCESS);
            }
            println!("{:<24} {:<8} {:<24} {:<20} {:<24} {:>4}  {:<20}  LAST ERROR", "ID", "STATE", "HANDLER", "TYPE", "KEY", "TRY", "CREATED");
            for d in &page.deliveries {
                // A key in order shows its sequence; a key counted by a limit per key, `~`.
                let key = match (&d.key, &d.limit_key) {
                    (Some(key), _) => format!("{key}#{}", d.sequence.unwrap_or(0)),
                    (None, Some(limit_key)) => format!("~{limit_key}"),
                    (None, None) => String::new(),
                };
                let error: String = d.last_error.as_deref().unwrap_or("").chars().take(80).collect();
                println!(
                    "{:<24} {:<8} {:<24} {:<20} {:<24} {:>4}  {:<20}  {error}",
                    d.id,
                    state(d),
                    d.handler,
                    d.event_type,
                    key,
                    d.attempts,
                    shown(d.created_at)
                );
            }
            if let Some(next) = page.next {
                println!("more: --after {next}");
            }
            Ok(ExitCode::SUCCESS)
        }
        DeliveriesCommand::Requeue { filters, yes } => {
            if filters.status().is_some_and(|s| s != Listed::Dead) {
                bail!("only dead deliveries are requeued: leave --status out or say dead");
            }
            let found = bulk::requeue(store, filters.filter(Some(Listed::Dead)).map_err(anyhow::Error::msg)?, yes).await?;
            if !yes {
                println!("would requeue {} dead deliveries; run again with --yes to do it", found.matched);
                return Ok(ExitCode::from(2));
            }
            Ok(report("requeued", "dead deliveries", &found))
        }
        DeliveriesCommand::Bury { filters, reason, yes } => {
            if filters.status().is_some_and(|s| s == Listed::Dead) {
                bail!("dead deliveries are buried already");
            }
            let found = bulk::bury(store, filters.filter(Some(Listed::Pending)).map_err(anyhow::Error::msg)?, &reason, yes).await?;
            if !yes {
                println!("would bury {} pending deliveries (not running); run again with --yes to do it", found.matched);
                return Ok(ExitCode::from(2));
            }
            Ok(report("buried", "pending deliveries", &found))
        }
    })
    .await
}

pub async fn events(config: &Config, command: EventsCommand) -> Result<ExitCode> {
    let EventsCommand::Show { id, json } = command;
    with_store(config, async |store| {
        let history = store.event_history(&id).await?;
        let filter = DeliveryFilter { event_id: Some(id.clone()), ..DeliveryFilter::default() };
        let deliveries = bulk::matching(store, filter, 10_000).await?;
        let Some(event) = history.event else {
            println!("no event {id:?} (never published, or purged)");
            return Ok(ExitCode::from(1));
        };
        let event_json = bson::Bson::Document(event).into_relaxed_extjson();
        let completions: Vec<serde_json::Value> =
            history.completions.iter().map(|(handler, at)| serde_json::json!({ "handler": handler, "completedAt": shown(*at) })).collect();
        if json {
            let rows: Vec<serde_json::Value> = deliveries.iter().map(delivery_json).collect();
            let report = serde_json::json!({ "event": event_json, "deliveries": rows, "completions": completions });
            println!("{}", serde_json::to_string_pretty(&report)?);
        } else {
            println!("{}", serde_json::to_string_pretty(&event_json)?);
            println!("deliveries ({} unfinished or dead):", deliveries.len());
            for d in &deliveries {
                println!("  {} {:<8} {} attempts {} {}", d.id, state(d), d.handler, d.attempts, d.last_error.as_deref().unwrap_or(""));
            }
            if !completions.is_empty() {
                println!("completed:");
                for (handler, at) in &history.completions {
                    println!("  {handler} at {}", shown(*at));
                }
            }
        }
        Ok(ExitCode::SUCCESS)
    })
    .await
}
