//! The operator's subcommands: `check`, `setup`, `stats`, `dead list|requeue|bury`,
//! `handlers list|retire`, `purge` and `publish`.
//!
//! Each opens MongoDB as the configuration says (joining the embedded server a running host
//! owns, or starting it for the command's duration), does one thing, and prints the result.
//! Ids and filters typed here reach the store as literal values only.

use relayhost::store::{Administration, Hosts, Outbox};
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use bson::{DateTime, Document};
use clap::{Args, Subcommand};
use relayhost::config::{Config, Keep};
use relayhost::dispatch::{DEAD_LETTER_EVENT_TYPE, bury_by_operator};
use relayhost::event::NewEvent;
use relayhost::plugin::Change;
use relayhost::service::{connect, registry_for, store_for};
use relayhost::store::mongo::MongoStore;
use relayhost::store::{DeliveryFilter, DeliveryStatus, Disposal, Published, RegisteredHandler, run_in_transaction};

#[derive(Subcommand)]
pub enum DeadCommand {
    /// Lists dead deliveries, oldest first.
    List {
        #[arg(long)]
        handler: Option<String>,
        /// Continue after this delivery id (printed at the end of a full page).
        #[arg(long)]
        after: Option<String>,
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
    /// Makes dead deliveries pending again, due now, with their attempts reset.
    Requeue {
        #[arg(required = true)]
        ids: Vec<String>,
    },
    /// Makes a stuck pending delivery dead (its key moves on), announced like any death.
    /// Refused while its lane is leased, since it may be running.
    Bury {
        id: String,
        #[arg(long, default_value = "no reason given")]
        reason: String,
    },
}

#[derive(Args)]
pub struct PurgeArgs {
    /// Only count what would go.
    #[arg(long)]
    dry_run: bool,
    /// Keep completed events this long instead of `retention.completed` ("off" keeps them).
    #[arg(long)]
    completed: Option<String>,
    /// Keep dead deliveries this long instead of `retention.dead_letters` ("off" keeps them).
    #[arg(long)]
    dead_letters: Option<String>,
}

#[derive(Subcommand)]
pub enum HandlersCommand {
    /// The handler registry: every handler ever declared, its event types, what declared it,
    /// which live hosts serve it, first and last seen, retired or not.
    List {
        #[arg(long)]
        json: bool,
    },
    /// Stops subscribing a handler that no live host serves: fan-outs create no more of its
    /// deliveries, and its waiting ones are buried (kept as dead letters) or dropped.
    Retire {
        handler: String,
        /// Make its waiting deliveries dead letters.
        #[arg(long, conflicts_with = "drop", required_unless_present = "drop")]
        bury: bool,
        /// Delete its waiting deliveries.
        #[arg(long)]
        drop: bool,
        /// Do it; without it, only says what it would do.
        #[arg(long)]
        yes: bool,
    },
}

#[derive(Args)]
pub struct PublishArgs {
    #[arg(long = "type")]
    event_type: String,
    #[arg(long)]
    key: Option<String>,
    /// Its priority (-1000 to 1000), for handlers that take priorities per event.
    #[arg(long, allow_hyphen_values = true)]
    priority: Option<i32>,
    /// The payload: a JSON object (extended JSON accepted).
    #[arg(long)]
    payload: String,
    /// The event id; a new ObjectId when absent.
    #[arg(long)]
    id: Option<String>,
}

/// Runs `work` on the configured store, then closes the connection (stopping an embedded
/// server this command started).
pub(crate) async fn with_store<T>(config: &Config, work: impl AsyncFnOnce(&MongoStore) -> Result<T>) -> Result<T> {
    let connection = connect(config).await?;
    let result = match store_for(config, &connection) {
        Ok(store) => work(&store).await,
        Err(error) => Err(error.into()),
    };
    connection.close().await;
    result
}

pub async fn check(config: &Config) -> Result<ExitCode> {
    let mut problems = Vec::new();
    let directory = &config.plugins.directory;
    if !directory.is_dir() {
        bail!("plugins.directory {} is not a directory", directory.display());
    }
    let registry = registry_for(config)?;
    for change in registry.scan().await? {
        match change {
            Change::Refused { plugin, reason } => problems.push(format!("plugin {plugin}: {reason}")),
            Change::Loaded { plugin, version } => {
                let handlers: Vec<String> = registry
                    .subscriptions()
                    .into_iter()
                    .filter(|s| registry.plugin_for(&s.handler).is_some_and(|p| *p.name == *plugin))
                    .map(|s| {
                        let transactional = if s.transactional { " (transactional)" } else { "" };
                        format!("{} <- {}{transactional}{}", s.handler, s.event_types.join(", "), processing(config, &plugin, &s.handler))
                    })
                    .collect();
                println!("ok  {plugin} {}: {}", &version[..12], handlers.join("; "));
            }
            Change::Replaced { .. } | Change::Removed { .. } => {}
        }
    }
    let loaded = registry.versions();
    for name in config.plugin.keys() {
        if !loaded.contains_key(name) && !problems.iter().any(|p| p.starts_with(&format!("plugin {name}:"))) {
            problems.push(format!("[plugin.{name}] is configured but {}/{name}.wasm does not exist", directory.display()));
        }
    }
    if loaded.is_empty() && problems.is_empty() {
        problems.push(format!("no plugin in {}", directory.display()));
    }
    for problem in &problems {
        println!("ERR {problem}");
    }
    Ok(if problems.is_empty() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// How the operator set a handler of a plugin to be processed, as `check` shows it: its
/// throttle, per-key limit and priority, when they are not the defaults.
fn processing(config: &Config, plugin: &str, handler: &str) -> String {
    let relayhost::dispatch::Controls { throttle, priority, priority_from, per_key } = config.controls_for(plugin, handler);
    let mut said = Vec::new();
    if let Some(concurrency) = throttle.concurrency {
        said.push(format!("at most {concurrency} at once per host"));
    }
    if let Some(rate) = throttle.rate {
        said.push(format!("at most {} starts per {} per host", rate.max, humantime::format_duration(rate.per)));
    }
    if let Some(concurrency) = throttle.global_concurrency {
        said.push(format!("at most {concurrency} at once across hosts"));
    }
    if let Some(rate) = throttle.global_rate {
        let per = humantime::format_duration(std::time::Duration::from_millis(rate.per_ms as u64));
        said.push(format!("at most {} starts per {per} across hosts (burst {})", rate.max, rate.burst));
    }
    if let Some(per_key) = per_key {
        let key = per_key.key.pointer().map_or_else(|| "its event's key".to_string(), |pointer| format!("payload {pointer}"));
        said.push(format!("at most {} of one key at once, unordered (by {key})", per_key.limit));
    }
    if priority != 0 {
        said.push(format!("priority {priority}"));
    }
    match priority_from {
        Some(relayhost::store::PriorityFrom::Event) => said.push("priority per event from the event's `priority`".to_string()),
        Some(relayhost::store::PriorityFrom::Payload(pointer)) => said.push(format!("priority per event from payload {pointer}")),
        None => {}
    }
    if said.is_empty() { String::new() } else { format!(" [{}]", said.join(", ")) }
}

pub async fn setup(config: &Config) -> Result<ExitCode> {
    with_store(config, async |store| {
        store.setup().await?;
        println!("collections, indexes and lanes are in place in `{}`", config.mongodb.database);
        Ok(ExitCode::SUCCESS)
    })
    .await
}

pub async fn stats(config: &Config, json: bool) -> Result<ExitCode> {
    with_store(config, async |store| {
        let now = DateTime::now();
        let statistics = store.statistics(now).await?;
        let registry = store.registered_handlers(now).await?;
        let serving = Serving::of(&registry);
        let unfanned = store.unfanned_events().await?;
        if json {
            let rows: Vec<serde_json::Value> = statistics
                .iter()
                .map(|s| {
                    let record = registry.iter().find(|r| r.handler == s.handler);
                    serde_json::json!({
                        "handler": s.handler, "pending": s.pending, "running": s.running, "parked": s.parked,
                        "dead": s.dead, "completed": s.completed,
                        "oldestDueAt": s.oldest_due_at.map(|d| d.try_to_rfc3339_string().unwrap_or_default()),
                        "servedBy": record.map(|r| r.served_by.clone()),
                        "unservedSince": record.filter(|r| r.served_by.is_empty()).map(|r| rfc3339(r.last_seen)),
                    })
                })
                .collect();
            let report = serde_json::json!({ "handlers": rows, "hostsServingHandlers": serving.hosts, "unfannedEvents": unfanned });
            println!("{}", serde_json::to_string_pretty(&report)?);
        } else {
            println!(
                "{:<32} {:>9} {:>9} {:>9} {:>9} {:>10}  SERVED BY",
                "HANDLER", "PENDING", "RUNNING", "PARKED", "DEAD", "COMPLETED"
            );
            for s in &statistics {
                let completed = s.completed.map_or("-".to_string(), |c| c.to_string());
                let served = serving.describe(registry.iter().find(|r| r.handler == s.handler));
                println!("{:<32} {:>9} {:>9} {:>9} {:>9} {:>10}  {served}", s.handler, s.pending, s.running, s.parked, s.dead, completed);
            }
            println!("events not fanned out yet: {unfanned}");
            for s in statistics.iter().filter(|s| s.pending > 0) {
                let Some(record) = registry.iter().find(|r| r.handler == s.handler && r.active()) else { continue };
                if record.served_by.is_empty() {
                    println!(
                        "WARNING: no live host serves `{}` since {}: its {} waiting deliveries wait for one (load its plugin, or `relayhost handlers retire`)",
                        s.handler,
                        rfc3339(record.last_seen),
                        s.pending
                    );
                } else if record.served_by.len() < serving.hosts {
                    println!(
                        "WARNING: `{}` is served by {} of {} live hosts: its deliveries in the others' lanes wait for a host that serves it",
                        s.handler,
                        record.served_by.len(),
                        serving.hosts
                    );
                }
            }
        }
        Ok(ExitCode::SUCCESS)
    })
    .await
}

/// How long after a retirement every host has read the registry again, and a fan-out that
/// read it before has committed: a refresh interval twice, and a second.
const RETIREMENT_SEEN: std::time::Duration = std::time::Duration::from_secs(3);

fn rfc3339(at: DateTime) -> String {
    at.try_to_rfc3339_string().unwrap_or_default()
}

/// How many live hosts serve handlers at all, to say of each handler how many of them serve it.
struct Serving {
    hosts: usize,
}

impl Serving {
    fn of(registry: &[RegisteredHandler]) -> Self {
        let hosts: std::collections::BTreeSet<&String> = registry.iter().flat_map(|r| r.served_by.iter()).collect();
        Self { hosts: hosts.len() }
    }

    fn describe(&self, record: Option<&RegisteredHandler>) -> String {
        match record {
            None => "-".to_string(),
            Some(record) if record.retired_at.is_some() => format!("retired {}", rfc3339(record.retired_at.expect("retired"))),
            Some(record) if record.served_by.is_empty() => format!("none since {}", rfc3339(record.last_seen)),
            Some(record) => format!("{} of {} hosts", record.served_by.len(), self.hosts),
        }
    }
}

/// Deletes once, now, what `[retention]` (or the flags) no longer keeps; `--dry-run` counts.
pub async fn purge(config: &Config, args: PurgeArgs) -> Result<ExitCode> {
    let mut retention = config.retention.clone();
    if let Some(completed) = &args.completed {
        retention.completed = Keep::parse(completed).map_err(anyhow::Error::msg).context("--completed")?;
    }
    if let Some(dead) = &args.dead_letters {
        retention.dead_letters = Keep::parse(dead).map_err(anyhow::Error::msg).context("--dead-letters")?;
    }
    let now = DateTime::now();
    let options = retention.purge_options(now);
    with_store(config, async |store| {
        if !retention.purges() {
            println!("retention keeps everything (completed and dead_letters are \"off\"): nothing to purge");
            return Ok(ExitCode::SUCCESS);
        }
        let cutoff = |at: Option<DateTime>| at.map_or("kept".to_string(), |at| format!("before {}", rfc3339(at)));
        println!("completed events {}, dead deliveries {}", cutoff(options.completed_before), cutoff(options.dead_before));
        if args.dry_run {
            let report = store.purge_preview(&options, now).await?;
            println!(
                "would delete {} dead deliveries, {} completion records and up to {} events (those still referred to stay)",
                report.dead_deliveries, report.history_records, report.events
            );
        } else {
            let report = store.purge(&options, now).await?;
            println!(
                "deleted {} dead deliveries, {} completion records, {} events and {} key counters",
                report.dead_deliveries, report.history_records, report.events, report.key_counters
            );
        }
        Ok(ExitCode::SUCCESS)
    })
    .await
}

pub async fn handlers(config: &Config, command: HandlersCommand) -> Result<ExitCode> {
    with_store(config, async |store| match command {
        HandlersCommand::List { json } => {
            let registry = store.registered_handlers(DateTime::now()).await?;
            if json {
                let rows: Vec<serde_json::Value> = registry
                    .iter()
                    .map(|r| {
                        serde_json::json!({
                            "handler": r.handler, "eventTypes": r.event_types, "transactional": r.in_transaction,
                            "plugin": r.plugin, "version": r.version, "servedBy": r.served_by,
                            "firstSeen": rfc3339(r.first_seen), "lastSeen": rfc3339(r.last_seen),
                            "retiredAt": r.retired_at.map(rfc3339),
                        })
                    })
                    .collect();
                println!("{}", serde_json::to_string_pretty(&serde_json::json!({ "handlers": rows }))?);
            } else {
                let serving = Serving::of(&registry);
                println!("{:<32} {:<24} {:<14} {:<26} EVENT TYPES", "HANDLER", "PLUGIN", "VERSION", "SERVED BY");
                for r in &registry {
                    let version: String = r.version.chars().take(12).collect();
                    let types: Vec<&str> = r.event_types.iter().map(String::as_str).collect();
                    println!("{:<32} {:<24} {:<14} {:<26} {}", r.handler, r.plugin, version, serving.describe(Some(r)), types.join(", "));
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        HandlersCommand::Retire { handler, bury, drop: _, yes } => {
            let now = DateTime::now();
            let disposal = if bury { Disposal::Bury } else { Disposal::Drop };
            let waiting = store.statistics(now).await?.into_iter().find(|s| s.handler == handler).map_or(0, |s| s.pending);
            let doing = if bury { "bury" } else { "drop" };
            if !yes {
                let registry = store.registered_handlers(now).await?;
                relayhost::store::registry::check_retirable(&registry, &handler)?;
                println!("retiring `{handler}` would {doing} its {waiting} waiting deliveries; run again with --yes to do it");
                return Ok(ExitCode::from(2));
            }
            let mut report = store.retire(&handler, disposal, now).await?;
            // A host's fan-out may have read the registry just before: once every host read it
            // again (and such a fan-out committed), what it created goes the same way.
            tokio::time::sleep(RETIREMENT_SEEN).await;
            let again = store.retire(&handler, disposal, DateTime::now()).await?;
            report.disposed += again.disposed;
            report.still_claimed = again.still_claimed;
            let done = if bury { "buried" } else { "dropped" };
            println!("retired `{handler}`: {} waiting deliveries {done}", report.disposed);
            if report.still_claimed > 0 {
                println!(
                    "{} deliveries are still listed by a live lease (a host that stopped serving it hands them back): run retire again once they are back",
                    report.still_claimed
                );
            }
            Ok(ExitCode::SUCCESS)
        }
    })
    .await
}

pub async fn dead(config: &Config, command: DeadCommand) -> Result<ExitCode> {
    with_store(config, async |store| match command {
        DeadCommand::List { handler, after, limit } => {
            let filter = DeliveryFilter { status: Some(DeliveryStatus::Dead), handler, after, limit, ..DeliveryFilter::default() };
            let page = store.list_deliveries(&filter).await?;
            for d in &page.deliveries {
                println!(
                    "{}  {}  event {}{}  attempts {}  {}",
                    d.id,
                    d.handler,
                    d.event_id,
                    d.key.as_ref().map(|k| format!(" (key {k})")).unwrap_or_default(),
                    d.attempts,
                    d.last_error.as_deref().unwrap_or("-"),
                );
            }
            if let Some(next) = page.next {
                println!("more: --after {next}");
            }
            Ok(ExitCode::SUCCESS)
        }
        DeadCommand::Requeue { ids } => {
            let mut failed = false;
            for id in &ids {
                match store.requeue(id, DateTime::now()).await {
                    Ok(()) => println!("requeued {id}"),
                    Err(error) => {
                        failed = true;
                        eprintln!("relayhost: {error}");
                    }
                }
            }
            Ok(if failed { ExitCode::FAILURE } else { ExitCode::SUCCESS })
        }
        DeadCommand::Bury { id, reason } => {
            let buried = bury_by_operator(store, &id, &format!("buried by an operator: {reason}")).await?;
            println!("buried {} ({} of event {}); its death is announced as {DEAD_LETTER_EVENT_TYPE}", buried.id, buried.handler, buried.event_id);
            Ok(ExitCode::SUCCESS)
        }
    })
    .await
}

pub async fn publish(config: &Config, args: PublishArgs) -> Result<ExitCode> {
    let payload = parse_payload(&args.payload)?;
    let id = args.id.unwrap_or_else(|| bson::oid::ObjectId::new().to_hex());
    let mut event = NewEvent::new(&id, &args.event_type, payload);
    if let Some(priority) = args.priority {
        event = event.with_priority(priority);
    }
    if let Some(key) = args.key {
        event = event.with_key(key);
    }
    // The schema is checked before anything is written, as a host's fan-out would check it.
    if let Err(reason) = config.event_schemas()?.check(&event.event_type, &event.payload) {
        bail!("{reason}; nothing was published");
    }
    with_store(config, async |store| {
        store.setup().await?;
        // Retried like any publisher's transaction: another transaction holding the key's
        // counter (a handler publishing on it, say) is a write conflict, not a failure.
        let published = run_in_transaction(store, async |tx| store.publish(tx, &event).await).await?;
        match published {
            Published::New { sequence: Some(sequence) } => println!("published {id} (sequence {sequence} of its key)"),
            Published::New { sequence: None } => println!("published {id}"),
            Published::Duplicate => println!("an event with id {id} exists already; nothing was written"),
        }
        Ok(ExitCode::SUCCESS)
    })
    .await
}

/// A JSON object (relaxed or canonical extended JSON) as a BSON document.
fn parse_payload(text: &str) -> Result<Document> {
    let json: serde_json::Value = serde_json::from_str(text).context("--payload is not JSON")?;
    match bson::Bson::try_from(json).context("--payload is not valid extended JSON")? {
        bson::Bson::Document(document) => Ok(document),
        other => bail!("--payload must be a JSON object, not {}", relayhost::event::bson_type_name(&other)),
    }
}
