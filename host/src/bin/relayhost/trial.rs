//! `relayhost test-plugin`: a plugin tried on an events file on the memory store, no MongoDB,
//! and `relayhost replay`: a candidate plugin run on a stored event, nothing written (see
//! `relayhost::trial`). Their reports printed, as text or JSON; the exit code says whether
//! every delivery ended as it should.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::Args;
use relayhost::config::Config;
use relayhost::plugin::capability::http::recording::Answer;
use relayhost::trial::{self, DeliveryReport, EventsFile, Expected, Reported};

#[derive(Args)]
pub struct TestPluginArgs {
    /// The plugin's component (`.wasm`); it is configured as the plugin of its file's name.
    plugin: PathBuf,
    /// One event a line (`{"id", "type", "payload", "key", "headers", "expect"}`), or an HTTP
    /// fixture (`{"http": {"method", "url", "status", "body"}}`).
    #[arg(long)]
    events: PathBuf,
    /// Send the HTTP requests no fixture answers (as a host would; refused otherwise).
    #[arg(long)]
    allow_http: bool,
    /// What a delivery must end as: `EVENT=OUTCOME` or `EVENT/HANDLER=OUTCOME` (completed,
    /// retry or dead); repeatable, over the file's `expect`. Unstated ones must complete.
    #[arg(long, value_name = "EVENT[/HANDLER]=OUTCOME")]
    expect: Vec<String>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct ReplayArgs {
    /// The stored event's id.
    #[arg(long)]
    event: String,
    /// The candidate plugin's component; configured as the plugin of its file's name.
    #[arg(long)]
    plugin: PathBuf,
    /// Only this handler of the candidate's (all those subscribed to the event's type by
    /// default).
    #[arg(long)]
    handler: Option<String>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

pub async fn replay(config: &Config, args: ReplayArgs) -> Result<ExitCode> {
    let connection = relayhost::service::connect(config).await?;
    let store = match relayhost::service::store_for(config, &connection) {
        Ok(store) => std::sync::Arc::new(store),
        Err(error) => {
            connection.close().await;
            return Err(error.into());
        }
    };
    let replayed = trial::replay(store, &args.plugin, config, &args.event, args.handler.as_deref()).await;
    connection.close().await;
    let replayed = replayed?;
    if args.json {
        let rows: Vec<serde_json::Value> = replayed
            .iter()
            .map(|r| {
                let mut row = as_json(&r.report);
                row["stored"] = match &r.delivery {
                    Some((status, last_error)) => serde_json::json!({ "status": format!("{status:?}").to_lowercase(), "lastError": last_error }),
                    None => serde_json::Value::Null,
                };
                row
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        for r in &replayed {
            print_report(&r.report);
            match &r.delivery {
                Some((status, last_error)) => {
                    let error = last_error.as_deref().map(|e| format!(", its last error: {e}")).unwrap_or_default();
                    println!("  stored   {status:?}{error}");
                }
                None => println!("  stored   no delivery of this handler for the event"),
            }
        }
        eprintln!("replayed in a transaction that was aborted; HTTP requests were recorded, not sent; nothing was written");
    }
    let completed = replayed.iter().all(|r| r.report.outcome == Reported::Completed);
    Ok(if completed { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

pub async fn test_plugin(config: &Config, args: TestPluginArgs) -> Result<ExitCode> {
    let text = std::fs::read_to_string(&args.events).with_context(|| format!("cannot read {}", args.events.display()))?;
    let file = EventsFile::parse(&text).map_err(|e| anyhow::anyhow!("{} is not an events file: {e}", args.events.display()))?;
    let mut stated = Vec::new();
    for expectation in &args.expect {
        let Some((who, outcome)) = expectation.split_once('=') else { bail!("--expect {expectation:?}: write EVENT=OUTCOME") };
        let outcome: Expected = outcome.parse().map_err(anyhow::Error::msg)?;
        let (event, handler) = who.split_once('/').map_or((who, None), |(event, handler)| (event, Some(handler)));
        stated.push((event.to_string(), handler.map(str::to_string), outcome));
    }
    let mut reports = trial::run(&args.plugin, &file, config, args.allow_http).await?;
    for report in &mut reports {
        if let Some((_, _, outcome)) = stated
            .iter()
            .find(|(event, handler, _)| *event == report.event_id && handler.as_ref().is_none_or(|h| *h == report.handler))
        {
            report.expected = Some(*outcome);
        }
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&reports.iter().map(as_json).collect::<Vec<_>>())?);
    } else {
        for report in &reports {
            print_report(report);
        }
    }
    let wrong: Vec<&DeliveryReport> = reports.iter().filter(|r| !r.as_it_should()).collect();
    let count = |outcome: Option<Expected>| reports.iter().filter(|r| r.outcome.as_expected() == outcome).count();
    eprintln!(
        "{} deliveries: {} completed, {} to retry, {} dead, {} not run",
        reports.len(),
        count(Some(Expected::Completed)),
        count(Some(Expected::Retry)),
        count(Some(Expected::Dead)),
        count(None)
    );
    if wrong.is_empty() {
        return Ok(ExitCode::SUCCESS);
    }
    for report in wrong {
        let expected = report.expected.unwrap_or(Expected::Completed);
        eprintln!("  {} / {}: {} where {expected:?} was expected", report.event_id, report.handler, outcome_text(&report.outcome));
    }
    Ok(ExitCode::FAILURE)
}

fn outcome_text(outcome: &Reported) -> String {
    match outcome {
        Reported::Completed => "completed".into(),
        Reported::Retry { at, reason } => {
            let at = bson::DateTime::from_millis(*at).try_to_rfc3339_string().unwrap_or_else(|_| at.to_string());
            format!("retry at {at}: {reason}")
        }
        Reported::Dead { reason } => format!("dead: {reason}"),
        Reported::NotRun { why } => format!("not run: {why}"),
    }
}

fn print_report(report: &DeliveryReport) {
    let run = &report.run;
    let cost = match run.fuel_consumed {
        Some(fuel) => format!("{:.1} ms, fuel {fuel}, peak memory {} KiB", run.elapsed.as_secs_f64() * 1e3, run.peak_memory_bytes / 1024),
        None => String::new(),
    };
    println!("{} ({}) -> {}, attempt {}: {}", report.event_id, report.event_type, report.handler, report.attempt, outcome_text(&report.outcome));
    if !cost.is_empty() {
        println!("  ran      {cost}");
    }
    for write in &run.writes {
        println!("  wrote    {}", serde_json::to_string(write).unwrap_or_default());
    }
    let published = if report.outcome == Reported::Completed { "published" } else { "not published (it did not complete)" };
    for event in &run.follow_ups {
        let key = event.key.as_deref().map(|k| format!(", key {k}")).unwrap_or_default();
        println!("  follow-up {} ({}{key}) {}: {published}", event.id, event.event_type, bson::Bson::Document(event.payload.clone()).into_relaxed_extjson());
    }
    for request in &report.http {
        let answer = match &request.answer {
            Answer::Fixture(status) => format!("fixture {status}"),
            Answer::Sent(status) => format!("sent, {status}"),
            Answer::Refused(reason) => format!("refused: {reason}"),
        };
        println!("  http     {} {} -> {answer}", request.method, request.url);
    }
    for line in &run.log {
        println!("  log      {line}");
    }
}

fn as_json(report: &DeliveryReport) -> serde_json::Value {
    let run = &report.run;
    serde_json::json!({
        "event": report.event_id,
        "type": report.event_type,
        "handler": report.handler,
        "attempt": report.attempt,
        "result": report.outcome,
        "expected": report.expected,
        "asItShould": report.as_it_should(),
        "elapsedMs": run.elapsed.as_secs_f64() * 1e3,
        "fuel": run.fuel_consumed,
        "peakMemoryBytes": run.peak_memory_bytes,
        "writes": run.writes,
        "followUps": run.follow_ups.iter().map(|e| serde_json::json!({
            "id": e.id, "type": e.event_type, "key": e.key,
            "payload": bson::Bson::Document(e.payload.clone()).into_relaxed_extjson(),
        })).collect::<Vec<_>>(),
        "http": report.http.iter().map(|r| serde_json::json!({
            "method": r.method, "url": r.url, "body": r.body,
            "answer": match &r.answer {
                Answer::Fixture(status) => serde_json::json!({ "fixture": status }),
                Answer::Sent(status) => serde_json::json!({ "sent": status }),
                Answer::Refused(reason) => serde_json::json!({ "refused": reason }),
            },
        })).collect::<Vec<_>>(),
        "log": run.log,
    })
}
