//! Reaching MongoDB as the configuration says: a URI, or `embedded`, the local single-node
//! replica set relayhost starts and owns.
//!
//! The embedded server keeps its data in a directory across restarts and records where it
//! listens in that directory, so the admin commands (`stats`, `publish`, `dead`) of the same
//! configuration reach the server a running host owns instead of starting a second one on the
//! same data. This module must never start a server for a `mongodb://` URI.

use std::path::{Path, PathBuf};
use std::time::Duration;

use mongodb::Client;
use mongodb::options::ClientOptions;
use serde::{Deserialize, Serialize};

use crate::config::MongoConfig;
use crate::mongod::{Mongod, MongodError, MongodOptions, cache_dir, find_binary};

/// File in the data directory naming the process and port of the server using it.
const STATE_FILE: &str = "relayhost-embedded.json";

#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("embedded MongoDB: {0}")]
    Embedded(#[from] MongodError),
    #[error("cannot connect to MongoDB at {uri}: {source}")]
    Connect { uri: String, source: mongodb::error::Error },
}

#[derive(Debug, Serialize, Deserialize)]
struct EmbeddedState {
    pid: u32,
    port: u16,
}

/// A client, and the embedded server when this process started it.
pub struct MongoConnection {
    pub client: Client,
    pub uri: String,
    /// The `appName` the client gives the server: `relayhost <id>`, unique to this process
    /// (it replaces one the URI names), so that other hosts can end its sessions once it died.
    pub app_name: String,
    owned: Option<(Mongod, PathBuf)>,
}

impl MongoConnection {
    /// Connects to the configured MongoDB, starting the embedded one when it is not running.
    /// The server started here dies with this process, even when it is killed, and aborts
    /// transactions older than `transaction_lifetime` (those of a killed host hold locks).
    pub async fn open(config: &MongoConfig, transaction_lifetime: Duration) -> Result<Self, ConnectError> {
        if config.uri != "embedded" {
            return Self::connect(config.uri.clone(), None).await;
        }
        let data_dir = embedded_data_dir(config);
        if let Some(uri) = running_embedded(&data_dir) {
            tracing::info!(%uri, data_dir = %data_dir.display(), "using the embedded MongoDB another relayhost process started");
            return Self::connect(uri, None).await;
        }
        tracing::info!(data_dir = %data_dir.display(), "starting the embedded MongoDB");
        let options = MongodOptions {
            port: config.embedded_port,
            bind_ip: config.embedded_bind_ip,
            die_with_parent: true,
            transaction_lifetime: Some(transaction_lifetime),
            ..MongodOptions::new(find_binary()?, data_dir.clone())
        };
        let mongod = Mongod::start(options).await?;
        let state = EmbeddedState { pid: std::process::id(), port: mongod.port() };
        let state_path = data_dir.join(STATE_FILE);
        if let Err(error) = std::fs::write(&state_path, serde_json::to_vec(&state).expect("plain struct")) {
            tracing::warn!(%error, path = %state_path.display(), "cannot record the embedded server's port; admin commands will not find it");
        }
        let uri = mongod.uri();
        tracing::info!(%uri, log = %mongod.log_path().display(), "embedded MongoDB is up");
        Self::connect(uri, Some((mongod, state_path))).await
    }

    async fn connect(uri: String, owned: Option<(Mongod, PathBuf)>) -> Result<Self, ConnectError> {
        let failed = |source| ConnectError::Connect { uri: uri.clone(), source };
        let mut options = ClientOptions::parse(&uri).await.map_err(failed)?;
        let app_name = format!("relayhost {}", bson::oid::ObjectId::new().to_hex());
        options.app_name = Some(app_name.clone());
        let client = Client::with_options(options).map_err(failed)?;
        Ok(Self { client, uri, app_name, owned })
    }

    /// Stops the embedded server this process started (a no-op otherwise).
    pub async fn close(self) {
        drop(self.client);
        if let Some((mongod, state_path)) = self.owned {
            let _ = std::fs::remove_file(state_path);
            tokio::task::spawn_blocking(move || mongod.stop()).await.ok();
        }
    }
}

/// The embedded data directory of a configuration.
pub fn embedded_data_dir(config: &MongoConfig) -> PathBuf {
    config.embedded_data_dir.clone().unwrap_or_else(|| cache_dir().join("data"))
}

/// The URI of an embedded server some live process runs on `data_dir`.
fn running_embedded(data_dir: &Path) -> Option<String> {
    let text = std::fs::read(data_dir.join(STATE_FILE)).ok()?;
    let state: EmbeddedState = serde_json::from_slice(&text).ok()?;
    let alive = Path::new(&format!("/proc/{}", state.pid)).exists()
        && std::net::TcpStream::connect_timeout(&([127, 0, 0, 1], state.port).into(), Duration::from_secs(1)).is_ok();
    alive.then(|| format!("mongodb://127.0.0.1:{}/?directConnection=true", state.port))
}
