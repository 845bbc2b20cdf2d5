//! `relayhost bench`: drain throughput and wakeup latency, with the raw floor measured on the
//! same mongod in the same run.

use anyhow::Result;
use clap::Args;

#[derive(Args)]
pub struct BenchArgs {}

pub async fn run(_args: BenchArgs) -> Result<()> {
    anyhow::bail!("not written yet")
}
