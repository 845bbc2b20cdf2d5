//! The `relayhost` command: the host (`run`) and what an operator does around it.
//!
//! This file owns the command line only: parsing, logging set-up, exit codes and printing.
//! Each subcommand is a thin call into the library; errors become `anyhow` here and nowhere
//! else.

mod admin;
mod backfill;
mod bench;
mod inspect;
mod trial;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use relayhost::config::Config;

#[derive(Parser)]
#[command(name = "relayhost", version, about = "Transactional-outbox event bus for MongoDB with sandboxed WebAssembly handlers")]
struct Cli {
    /// The configuration file (TOML); `RELAYHOST_*` variables override it.
    #[arg(long, short, global = true, env = "RELAYHOST_CONFIG")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Runs the host until SIGINT or SIGTERM, then stops gracefully.
    Run,
    /// Creates the collections, indexes and lanes (idempotent; `run` does it too).
    Setup,
    /// Validates the configuration and every plugin; exits non-zero with the reasons.
    Check,
    /// Per-handler delivery counts.
    Stats {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Dead letters: list and requeue them, or bury a stuck pending delivery.
    #[command(subcommand)]
    Dead(admin::DeadCommand),
    /// Deliveries by filter (status, handler, type, key, event, age): list them, requeue the
    /// dead, bury the stuck.
    #[command(subcommand)]
    Deliveries(inspect::DeliveriesCommand),
    /// One event as stored, its deliveries and completions.
    #[command(subcommand)]
    Events(inspect::EventsCommand),
    /// The handler registry: list it, or retire a handler no host serves any more.
    #[command(subcommand)]
    Handlers(admin::HandlersCommand),
    /// Deletes now what `[retention]` no longer keeps (`--dry-run` counts it); a host does it on
    /// its own every `retention.every`.
    Purge(admin::PurgeArgs),
    /// Publishes one event in its own transaction, to try things.
    Publish(admin::PublishArgs),
    /// Gives a handler added later the older events it never had (through the running hosts'
    /// fan-outs, in bounded batches, in per-key order, each event once).
    Backfill(backfill::BackfillArgs),
    /// Measures drain throughput and wakeup latency against the raw floor of the same mongod.
    Bench(bench::BenchArgs),
    /// Writes a new plugin project (a handler, its WIT, sample events, a README) into a new
    /// folder named after it.
    New {
        /// The plugin's name: its handler id and its file's (`<name>.wasm`).
        name: String,
        /// rust, python, javascript or c.
        #[arg(long)]
        lang: relayhost::author::Language,
        /// Where the folder goes (the current directory by default).
        #[arg(long, default_value = ".")]
        dir: PathBuf,
    },
    /// Builds the plugin project in a folder (`relayhost new` made it) into `<name>.wasm`.
    Build {
        /// The project's folder (the current directory by default).
        #[arg(default_value = ".")]
        project: PathBuf,
    },
    /// Runs a plugin on the events of a file, on an in-memory store (no MongoDB): each
    /// delivery's outcome, writes, follow-ups, HTTP requests, log lines and costs.
    TestPlugin(trial::TestPluginArgs),
    /// Runs a candidate plugin on a stored event, in a transaction that is always aborted,
    /// HTTP recorded and not sent: what a fix would do with the event that died.
    Replay(trial::ReplayArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // wasmtime builds an error value as it tears down every delivery's instance, and with
    // `RUST_BACKTRACE` set, each would capture a backtrace: about a tenth of this process's
    // CPU per delivery (measured with `relayhost bench`). Panics still print theirs; an
    // operator who wants library errors' backtraces sets `RUST_LIB_BACKTRACE=1`.
    if std::env::var_os("RUST_LIB_BACKTRACE").is_none() {
        // SAFETY: no other thread exists yet (the runtime is built below), so nothing reads
        // the environment while it changes.
        unsafe { std::env::set_var("RUST_LIB_BACKTRACE", "0") };
    }
    relayhost::plugin::limit_allocator_arenas();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("the tokio runtime starts");
    // The main thread drives every command: an embedded mongod started here dies with it.
    match runtime.block_on(execute(cli)) {
        Ok(code) => code,
        Err(error) => {
            eprintln!("relayhost: {error:#}");
            ExitCode::FAILURE
        }
    }
}

async fn execute(cli: Cli) -> Result<ExitCode> {
    match cli.command {
        Command::Bench(args) => {
            init_logs("plain", "warn");
            return bench::run(args).await.map(|()| ExitCode::SUCCESS);
        }
        // A plugin author's commands need no configuration.
        Command::New { name, lang, dir } => {
            let folder = dir.join(&name);
            let written = relayhost::author::template::create(&folder, &name, lang)?;
            println!("created {} ({} files); next:", folder.display(), written.len());
            println!("  cd {}\n  relayhost build\n  relayhost test-plugin {name}.wasm --events events.jsonl --config relayhost.toml", folder.display());
            return Ok(ExitCode::SUCCESS);
        }
        Command::Build { project } => {
            let built = relayhost::author::build::build(&project)?;
            println!("built {}", built.display());
            return Ok(ExitCode::SUCCESS);
        }
        command => run_with_config(cli.config, command).await,
    }
}

async fn run_with_config(config: Option<PathBuf>, command: Command) -> Result<ExitCode> {
    let cli = Cli { config, command };
    let config = Config::load(cli.config.as_deref(), std::env::vars()).context("invalid configuration")?;
    match cli.command {
        Command::Run => {
            init_logs(&config.host.log_format, "info");
            relayhost::service::run(config, cli.config.as_deref(), shutdown_signal()).await?;
            Ok(ExitCode::SUCCESS)
        }
        // The report shows the plugin's log lines; the host's own would only repeat them.
        Command::TestPlugin(args) => {
            init_logs(&config.host.log_format, "off");
            trial::test_plugin(&config, args).await
        }
        command => {
            init_logs(&config.host.log_format, "warn");
            match command {
                Command::Check => admin::check(&config).await,
                Command::Setup => admin::setup(&config).await,
                Command::Stats { json } => admin::stats(&config, json).await,
                Command::Dead(dead) => admin::dead(&config, dead).await,
                Command::Handlers(handlers) => admin::handlers(&config, handlers).await,
                Command::Purge(args) => admin::purge(&config, args).await,
                Command::Deliveries(command) => inspect::deliveries(&config, command).await,
                Command::Events(command) => inspect::events(&config, command).await,
                Command::Publish(args) => admin::publish(&config, args).await,
                Command::Backfill(args) => backfill::backfill(&config, args).await,
                Command::Replay(args) => trial::replay(&config, args).await,
                Command::Run | Command::Bench(_) | Command::TestPlugin(_) | Command::New { .. } | Command::Build { .. } => {
                    unreachable!("handled above")
                }
            }
        }
    }
}

/// Logs to stderr, plain or JSON; `RUST_LOG` overrides the level.
fn init_logs(format: &str, default_level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    if format == "json" {
        builder.json().flatten_event(true).init();
    } else {
        builder.with_target(false).init();
    }
}

/// Resolves on the first SIGINT or SIGTERM. The handlers are installed at the call, before the
/// host starts, not when it first waits for a signal: until then a signal would do its
/// default and kill the process (a SIGTERM while it started did).
fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut terminate = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut interrupt = signal(SignalKind::interrupt()).expect("SIGINT handler");
    async move {
        let name = tokio::select! {
            _ = terminate.recv() => "SIGTERM",
            _ = interrupt.recv() => "SIGINT",
        };
        tracing::info!(signal = name, "stopping: no new claims; deliveries in flight may finish");
    }
}
