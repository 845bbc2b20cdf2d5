//! Reloading the configuration while the host runs: on SIGHUP, and after the configuration
//! file changed (a quiet period after its last write, as the plugins directory's watch).
//!
//! It owns when a reload happens and what the log says of it; which settings apply live is
//! [`LiveConfig`]'s, and the readers of the settings (the runner's closures, the registry's
//! policies, the fan-out's schemas) take them at each use. After a reload, plugins whose
//! limits or grants changed are loaded again (`PluginRegistry::reapply_policies`) and the
//! dispatcher is woken, so that a changed limit counts from its next claim. It must never stop
//! the host nor change a setting itself: a file refused leaves the settings in force.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use notify::{RecursiveMode, Watcher};
use tokio::sync::Notify;

use crate::config::LiveConfig;
use crate::event_schema::SchemaSource;
use crate::plugin::PluginRegistry;

/// How long the file must be quiet after a write before it is read again.
const QUIET: Duration = Duration::from_millis(200);

/// What a reload puts in force beside the settings themselves.
pub(super) struct Reloading {
    pub live: Arc<LiveConfig>,
    pub registry: Arc<PluginRegistry>,
    pub schemas: SchemaSource,
    pub dispatcher: Arc<Notify>,
}

/// Keeps reloading on SIGHUP and file changes; dropping it stops that.
pub(super) struct ReloadGuard {
    _watcher: Option<notify::RecommendedWatcher>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ReloadGuard {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Reloading {
    /// Starts listening for SIGHUP and, given a configuration file, for changes of it.
    pub fn spawn(self) -> std::io::Result<ReloadGuard> {
        let mut hangup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
        let (changed, mut changes) = tokio::sync::mpsc::unbounded_channel();
        let watcher = match self.live.path() {
            Some(path) => Some(watch(path, changed)?),
            None => None,
        };
        let task = tokio::spawn(async move {
            loop {
                let trigger = tokio::select! {
                    signal = hangup.recv() => match signal {
                        Some(()) => "SIGHUP",
                        None => return,
                    },
                    change = changes.recv() => match change {
                        Some(()) => {
                            while let Ok(Some(())) = tokio::time::timeout(QUIET, changes.recv()).await {}
                            "the file changed"
                        }
                        None => return,
                    },
                };
                self.reload(trigger).await;
            }
        });
        Ok(ReloadGuard { _watcher: watcher, task })
    }

    async fn reload(&self, trigger: &str) {
        let reloaded = match self.live.reload(std::env::vars()) {
            Ok(reloaded) => reloaded,
            Err(error) => {
                tracing::error!(%error, trigger, "the configuration was refused; the settings in force stay");
                return;
            }
        };
        // Compiled again whatever the file says: a schema file may have changed alone.
        match self.live.get().event_schemas() {
            Ok(schemas) => self.schemas.replace(schemas),
            Err(error) => tracing::error!(%error, trigger, "the event schemas were refused; those in force stay"),
        }
        if !reloaded.need_restart.is_empty() {
            tracing::warn!(
                sections = ?reloaded.need_restart,
                "the configuration changed in sections that apply at the next start; their values in force stay"
            );
        }
        tracing::info!(trigger, applied = ?reloaded.applied, "configuration reloaded");
        if let Err(error) = self.registry.reapply_policies().await {
            tracing::error!(%error, "loading plugins again under their new limits and grants failed; the versions in force keep serving");
        }
        self.dispatcher.notify_one();
    }
}

/// Watches the folder of `path` (an editor replaces a file rather than writing it) and sends
/// on `changed` after each change of that file.
fn watch(path: &Path, changed: tokio::sync::mpsc::UnboundedSender<()>) -> std::io::Result<notify::RecommendedWatcher> {
    let file = path.file_name().map(ToOwned::to_owned);
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        use notify::event::{AccessKind, AccessMode, EventKind};
        let Ok(event) = event else { return };
        let writes = !matches!(event.kind, EventKind::Access(access) if access != AccessKind::Close(AccessMode::Write));
        if writes && event.paths.iter().any(|changed| changed.file_name() == file.as_deref()) {
            let _ = changed.send(());
        }
    })
    .map_err(std::io::Error::other)?;
    let folder = path.parent().filter(|folder| !folder.as_os_str().is_empty()).unwrap_or(Path::new("."));
    watcher.watch(folder, RecursiveMode::NonRecursive).map_err(std::io::Error::other)?;
    Ok(watcher)
}
