//! What the bench's `mongod` did during a measurement: its own counters and the CPU time it
//! and this process spent. It only reads them; it must never write to the server.

use std::time::Duration;

use anyhow::{Context, Result};
use bson::{Document, doc};

/// The bench's `mongod`: a client, and the process whose CPU time it reads.
pub(super) struct Server {
    pub client: mongodb::Client,
    pub pid: u32,
}

/// What `mongod` did, from its own counters (`serverStatus`), and the CPU time it and this
/// process spent: the drain is bound by their CPU together, so this says where a delivery
/// costs more than a floor document.
#[derive(Clone, Copy, Default)]
pub(super) struct ServerWork {
    pub mongod_cpu: Duration,
    pub host_cpu: Duration,
    pub written: i64,
    pub returned: i64,
    pub keys_scanned: i64,
    pub documents_scanned: i64,
    pub commands: i64,
    pub transactions: i64,
}

impl ServerWork {
    pub async fn now(server: &Server) -> Result<Self> {
        let status = server.client.database("admin").run_command(doc! { "serverStatus": 1 }).await?;
        let metrics = status.get_document("metrics")?;
        let (document, executor) = (metrics.get_document("document")?, metrics.get_document("queryExecutor")?);
        let count = |from: &Document, field: &str| from.get(field).and_then(|value| value.as_i64().or(value.as_i32().map(i64::from))).unwrap_or(0);
        Ok(Self {
            mongod_cpu: cpu_time(&format!("/proc/{}/stat", server.pid))?,
            host_cpu: cpu_time("/proc/self/stat")?,
            written: count(document, "inserted") + count(document, "updated") + count(document, "deleted"),
            returned: count(document, "returned"),
            keys_scanned: count(executor, "scanned"),
            documents_scanned: count(executor, "scannedObjects"),
            commands: metrics
                .get_document("commands")?
                .values()
                .filter_map(|command| command.as_document())
                .map(|command| count(command, "total"))
                .sum(),
            transactions: count(status.get_document("transactions")?, "totalCommitted"),
        })
    }

    /// The work of two measurements together.
    pub fn plus(self, other: Self) -> Self {
        self.with(other, |a, b| a + b, |a, b| a + b)
    }

    /// The work done since `earlier`.
    pub fn since(self, earlier: Self) -> Self {
        self.with(earlier, Duration::saturating_sub, |a, b| a - b)
    }

    /// Each figure of `self` with its counterpart in `other`: times by `time`, counts by `count`.
    fn with(self, other: Self, time: fn(Duration, Duration) -> Duration, count: fn(i64, i64) -> i64) -> Self {
        Self {
            mongod_cpu: time(self.mongod_cpu, other.mongod_cpu),
            host_cpu: time(self.host_cpu, other.host_cpu),
            written: count(self.written, other.written),
            returned: count(self.returned, other.returned),
            keys_scanned: count(self.keys_scanned, other.keys_scanned),
            documents_scanned: count(self.documents_scanned, other.documents_scanned),
            commands: count(self.commands, other.commands),
            transactions: count(self.transactions, other.transactions),
        }
    }

    pub fn per(self, items: usize) -> String {
        let per = |n: i64| n as f64 / items.max(1) as f64;
        let micros = |cpu: Duration| cpu.as_secs_f64() * 1e6 / items.max(1) as f64;
        format!(
            "{:.0} µs of mongod's CPU and {:.0} µs of this process's, {:.1} documents written, {:.1} returned, {:.1} index keys and {:.1} documents scanned, {:.3} commands and {:.4} transactions",
            micros(self.mongod_cpu),
            micros(self.host_cpu),
            per(self.written),
            per(self.returned),
            per(self.keys_scanned),
            per(self.documents_scanned),
            per(self.commands),
            per(self.transactions)
        )
    }
}

/// User and system CPU time of a process so far, from `/proc/<pid>/stat` (Linux).
fn cpu_time(stat: &str) -> Result<Duration> {
    let text = std::fs::read_to_string(stat).with_context(|| format!("reading {stat}"))?;
    // The command name (field 2) may hold spaces; the fields after its closing parenthesis
    // start at field 3, so utime and stime (fields 14 and 15) are the 12th and 13th.
    let after_name = text.rsplit_once(')').map(|(_, rest)| rest).context("no command name in /proc stat")?;
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    let ticks = |index: usize| -> Result<u64> {
        Ok(fields.get(index).context("a short /proc stat line")?.parse()?)
    };
    // SAFETY: sysconf has no memory-safety preconditions.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Ok(Duration::from_secs_f64((ticks(11)? + ticks(12)?) as f64 / per_second))
}
