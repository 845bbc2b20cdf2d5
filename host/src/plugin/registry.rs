//! The plugin registry: which version of which plugin serves which handler, kept in step
//! with the plugins directory without a restart.
//!
//! Adding, replacing or deleting a `*.wasm` file takes effect on the next scan; the watcher
//! scans after the directory has been quiet for a moment (debounce), so a file being written
//! is read once it is complete, and a half-written or broken file is refused while the
//! previous version keeps serving. A delivery holds the `Arc` of the version that started it,
//! so it finishes on that version whatever happens to the file. The registry never knows
//! about lanes or claims: it answers "which plugin serves this handler now".
//!
//! A handler id belongs to one plugin. A new file offering a handler another plugin serves is
//! refused; two files of one scan (at startup, every file) offering the same handler are both
//! refused, loudly, so that no file name order decides who serves it (the handler stays
//! subscribed in the store's registry: its events wait). The files of a scan are loaded
//! concurrently; a file whose size, times and inode did not change since it was last decided
//! on is not read again, a directory unchanged since the last scan is not scanned again, and a
//! refusal is logged once per change of its file (or of its reason).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use notify::{RecursiveMode, Watcher};
use sha2::{Digest, Sha256};

use super::bounds::read_plugin_file;
use super::{LoadedPlugin, PluginError, PluginPolicy, PluginRuntime, Subscription};

/// How long the directory must be quiet before a scan.
pub const DEBOUNCE: Duration = Duration::from_millis(250);

/// What one scan changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    Loaded { plugin: String, version: String },
    Replaced { plugin: String, old_version: String, new_version: String },
    /// The file was refused; the previous version, if any, keeps serving.
    Refused { plugin: String, reason: String },
    Removed { plugin: String, version: String },
}

#[derive(Default)]
struct Catalog {
    plugins: BTreeMap<String, Arc<LoadedPlugin>>,
    /// Content hashes of files refused for what they are, so an unchanged broken file is not
    /// retried. (A file refused for a handler another file offers is retried at every scan.)
    refused: BTreeMap<String, String>,
    /// What each file looked like when it was last decided on (loaded, or refused for what it
    /// is): an unchanged file is not read again.
    stamps: BTreeMap<String, Stamp>,
    /// Every file of the directory as the last scan found it: a scan that finds the same does
    /// nothing (reading a file is a change to a watcher, which must not scan again for it).
    scanned: Option<BTreeMap<String, Option<Stamp>>>,
    /// The last refusal logged of each file, with the file as it was: the same refusal of the
    /// same file is not logged again.
    logged_refusals: BTreeMap<String, (Option<Stamp>, String)>,
}

/// A file's size, modification and change times and inode: what tells, without reading it,
/// that it is the file it was.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Stamp {
    len: u64,
    modified: Option<std::time::SystemTime>,
    changed: (i64, i64),
    inode: u64,
}

fn stamp_of(path: &Path) -> Option<Stamp> {
    use std::os::unix::fs::MetadataExt;
    let metadata = std::fs::metadata(path).ok()?;
    Some(Stamp {
        len: metadata.len(),
        modified: metadata.modified().ok(),
        changed: (metadata.ctime(), metadata.ctime_nsec()),
        inode: metadata.ino(),
    })
}

/// What reading and loading one file of a scan gave.
enum Read {
    /// The same content as the version serving or the refusal remembered.
    Known,
    Loaded(LoadedPlugin),
    /// Refused for what the file is (not for what another file offers).
    Refused(String),
}

impl Catalog {
    fn owner_of(&self, handler: &str) -> Option<&str> {
        self.plugins
            .iter()
            .find(|(_, plugin)| plugin.subscription(handler).is_some())
            .map(|(name, _)| name.as_str())
    }
}

/// The loaded plugins of one directory.
pub struct PluginRegistry {
    runtime: Arc<PluginRuntime>,
    directory: PathBuf,
    policy_for: Box<dyn Fn(&str) -> PluginPolicy + Send + Sync>,
    catalog: RwLock<Catalog>,
    scanning: tokio::sync::Mutex<()>,
}

impl PluginRegistry {
    /// `policy_for` gives the operator's limits and grants of a plugin by its name (the file
    /// name without `.wasm`).
    pub fn new(
        runtime: Arc<PluginRuntime>,
        directory: impl Into<PathBuf>,
        policy_for: impl Fn(&str) -> PluginPolicy + Send + Sync + 'static,
    ) -> Self {
        Self {
            runtime,
            directory: directory.into(),
            policy_for: Box::new(policy_for),
            catalog: RwLock::default(),
            scanning: tokio::sync::Mutex::new(()),
        }
    }

    /// The runtime the plugins were loaded by, which is the one to run them with.
    pub fn runtime(&self) -> &Arc<PluginRuntime> {
        &self.runtime
    }

    pub fn directory(&self) -> &Path {
        &self.directory
    }

    /// The version serving `handler` now.
    pub fn plugin_for(&self, handler: &str) -> Option<Arc<LoadedPlugin>> {
        let catalog = self.catalog.read().expect("catalog");
        catalog.plugins.values().find(|plugin| plugin.subscription(handler).is_some()).cloned()
    }

    /// Every handler offered now.
    pub fn subscriptions(&self) -> Vec<Subscription> {
        let catalog = self.catalog.read().expect("catalog");
        catalog.plugins.values().flat_map(|plugin| plugin.subscriptions.iter().cloned()).collect()
    }

    /// Why each file refused since its last good version loaded was refused, as last logged
    /// (a plugin refused a new version may still serve its previous one).
    pub fn refusals(&self) -> BTreeMap<String, String> {
        let catalog = self.catalog.read().expect("catalog");
        catalog.logged_refusals.iter().map(|(name, (_, reason))| (name.clone(), reason.clone())).collect()
    }

    /// The loaded plugins, each with what it serves and its policy.
    pub fn plugins(&self) -> Vec<Arc<LoadedPlugin>> {
        self.catalog.read().expect("catalog").plugins.values().cloned().collect()
    }

    /// The loaded plugins and their versions.
    pub fn versions(&self) -> BTreeMap<String, String> {
        let catalog = self.catalog.read().expect("catalog");
        catalog.plugins.iter().map(|(name, plugin)| (name.clone(), plugin.content_hash.clone())).collect()
    }

    /// Brings the registry in step with the directory and logs every change.
    pub async fn scan(&self) -> Result<Vec<Change>, PluginError> {
        let _one_at_a_time = self.scanning.lock().await;
        let files = plugin_files(&self.directory).map_err(|e| PluginError::Refused {
            file: self.directory.display().to_string(),
            reason: format!("cannot read the plugins directory: {e}"),
        })?;
        let mut changes = Vec::new();
        let seen: BTreeMap<String, Option<Stamp>> = files.iter().map(|(name, path)| (name.clone(), stamp_of(path))).collect();
        {
            let mut catalog = self.catalog.write().expect("catalog");
            if catalog.scanned.as_ref() == Some(&seen) {
                return Ok(changes);
            }
            let gone: Vec<String> = catalog.plugins.keys().filter(|name| !files.contains_key(*name)).cloned().collect();
            for name in gone {
                let plugin = catalog.plugins.remove(&name).expect("listed");
                changes.push(Change::Removed { plugin: name, version: plugin.content_hash.clone() });
            }
            catalog.refused.retain(|name, _| files.contains_key(name));
            catalog.stamps.retain(|name, _| files.contains_key(name));
            catalog.logged_refusals.retain(|name, _| files.contains_key(name));
        }
        let changed: Vec<(&String, &PathBuf, Option<Stamp>)> = {
            let catalog = self.catalog.read().expect("catalog");
            files
                .iter()
                .map(|(name, path)| (name, path, stamp_of(path)))
                .filter(|(name, _, stamp)| stamp.is_none() || catalog.stamps.get(*name) != stamp.as_ref())
                .collect()
        };
        // Every changed file at once: one slow or large plugin holds up no other.
        let reads = futures::future::join_all(changed.iter().map(|(name, path, _)| self.read(name, path))).await;
        let mut loaded = Vec::new();
        for ((name, _, stamp), read) in changed.into_iter().zip(reads) {
            match read {
                (_, Read::Known) => self.remember_stamp(name, stamp),
                (_, Read::Loaded(plugin)) => loaded.push((name.clone(), plugin, stamp)),
                (hash, Read::Refused(reason)) => {
                    let mut catalog = self.catalog.write().expect("catalog");
                    catalog.refused.insert(name.clone(), hash);
                    if let Some(stamp) = stamp {
                        catalog.stamps.insert(name.clone(), stamp);
                    }
                    changes.push(Change::Refused { plugin: name.clone(), reason });
                }
            }
        }
        let contested = contested_handlers(&loaded);
        for (name, plugin, stamp) in loaded {
            let clash = plugin.subscriptions.iter().find_map(|s| contested.get(&s.handler).map(|others| (&s.handler, others)));
            let installed = match clash {
                Some((handler, others)) => {
                    let others: Vec<String> = others
                        .iter()
                        .filter(|other| **other != name)
                        .map(|other| files.get(other).map_or_else(|| other.clone(), |path| path.display().to_string()))
                        .collect();
                    Err(format!(
                        "handler `{handler}` is also offered by plugin(s) {others:?} loaded at the same time; all of them are \
                         refused until only one offers it: remove all but one of these files (or rename them to a name not \
                         ending in .wasm). The handler stays subscribed: its events wait (`relayhost handlers list`)"
                    ))
                }
                None => self.install(&name, plugin),
            };
            match installed {
                Ok(change) => {
                    self.remember_stamp(&name, stamp);
                    changes.push(change);
                }
                Err(reason) => changes.push(Change::Refused { plugin: name, reason }),
            }
        }
        for change in &changes {
            match change {
                Change::Loaded { plugin, version } => tracing::info!(plugin, version = &version[..12], "plugin loaded"),
                Change::Replaced { plugin, old_version, new_version } if old_version == new_version => {
                    tracing::info!(plugin, version = &new_version[..12], "plugin loaded again under its new limits and grants")
                }
                Change::Replaced { plugin, old_version, new_version } => {
                    tracing::info!(plugin, old = &old_version[..12], new = &new_version[..12], "plugin replaced")
                }
                Change::Refused { plugin, reason } => {
                    let file = (seen.get(plugin).cloned().flatten(), reason.clone());
                    let mut catalog = self.catalog.write().expect("catalog");
                    if catalog.logged_refusals.get(plugin) == Some(&file) {
                        tracing::debug!(plugin, reason, "plugin refused again, unchanged");
                    } else {
                        catalog.logged_refusals.insert(plugin.clone(), file);
                        tracing::error!(plugin, reason, "plugin refused; the previous version, if any, keeps serving")
                    }
                }
                Change::Removed { plugin, version } => tracing::info!(plugin, version = &version[..12], "plugin removed"),
            }
        }
        self.catalog.write().expect("catalog").scanned = Some(seen);
        Ok(changes)
    }

    /// Reads one file and, unless its content is known, loads it; with the content's hash.
    async fn read(&self, name: &str, path: &Path) -> (String, Read) {
        let read = read_plugin_file(path);
        // An unreadable file is remembered by its reason, like a broken one by its content.
        let hash = match &read {
            Ok(bytes) => hex::encode(Sha256::digest(bytes)),
            Err(reason) => format!("unreadable: {reason}"),
        };
        // A version serving under other limits or grants than the operator's now is loaded
        // again (see `reapply_policies`).
        let known = {
            let catalog = self.catalog.read().expect("catalog");
            let serving = catalog.plugins.get(name).is_some_and(|p| p.content_hash == hash && *p.policy == (self.policy_for)(name));
            serving || catalog.refused.get(name) == Some(&hash)
        };
        if known {
            return (hash, Read::Known);
        }
        let bytes = match read {
            Ok(bytes) => bytes,
            Err(reason) => {
                let refused = PluginError::Refused { file: path.display().to_string(), reason };
                return (hash, Read::Refused(refused.to_string()));
            }
        };
        match self.runtime.load_bytes(path, bytes, (self.policy_for)(name)).await {
            Ok(plugin) => (hash, Read::Loaded(plugin)),
            Err(error) => (hash, Read::Refused(error.to_string())),
        }
    }

    fn remember_stamp(&self, name: &str, stamp: Option<Stamp>) {
        if let Some(stamp) = stamp {
            self.catalog.write().expect("catalog").stamps.insert(name.to_string(), stamp);
        }
    }

    /// Puts a loaded version in place, unless one of its handlers belongs to another plugin.
    fn install(&self, name: &str, plugin: LoadedPlugin) -> Result<Change, String> {
        let mut catalog = self.catalog.write().expect("catalog");
        for subscription in &plugin.subscriptions {
            if let Some(owner) = catalog.owner_of(&subscription.handler).filter(|owner| *owner != name) {
                return Err(format!("handler `{}` is already provided by plugin `{owner}`", subscription.handler));
            }
        }
        let new_version = plugin.content_hash.clone();
        catalog.refused.remove(name);
        catalog.logged_refusals.remove(name);
        Ok(match catalog.plugins.insert(name.to_string(), Arc::new(plugin)) {
            Some(old) => Change::Replaced { plugin: name.to_string(), old_version: old.content_hash.clone(), new_version },
            None => Change::Loaded { plugin: name.to_string(), version: new_version },
        })
    }

    /// Loads again, from their files, the plugins that serve under other limits or grants
    /// than `policy_for` gives now (the operator changed them): their next runs get the new
    /// ones, and runs under way finish with the version they started with. A file that no
    /// longer loads under its new policy is refused as at any scan, and its version keeps
    /// serving; files refused before are tried again (a limit may have been what refused
    /// them).
    pub async fn reapply_policies(&self) -> Result<Vec<Change>, PluginError> {
        {
            let mut catalog = self.catalog.write().expect("catalog");
            let mut again: Vec<String> =
                catalog.plugins.iter().filter(|(name, plugin)| *plugin.policy != (self.policy_for)(name)).map(|(name, _)| name.clone()).collect();
            again.extend(catalog.refused.keys().cloned());
            if again.is_empty() {
                return Ok(Vec::new());
            }
            for name in &again {
                catalog.stamps.remove(name);
            }
            catalog.refused.clear();
            catalog.scanned = None;
        }
        self.scan().await
    }

    /// Watches the directory and scans it after every quiet period following a change, until
    /// the returned guard is dropped.
    pub fn watch(self: &Arc<Self>) -> Result<WatchGuard, PluginError> {
        let (sender, mut receiver) = tokio::sync::mpsc::unbounded_channel();
        let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
            // Reading a file (every scan does) changes nothing; a write that ends does.
            use notify::event::{AccessKind, AccessMode, EventKind};
            let changes = |kind: &EventKind| {
                !matches!(kind, EventKind::Access(access) if *access != AccessKind::Close(AccessMode::Write))
            };
            if event.is_ok_and(|event| changes(&event.kind)) {
                let _ = sender.send(());
            }
        })
        .map_err(|e| self.watch_error(e))?;
        watcher.watch(&self.directory, RecursiveMode::NonRecursive).map_err(|e| self.watch_error(e))?;
        let registry = Arc::clone(self);
        let task = tokio::spawn(async move {
            while receiver.recv().await.is_some() {
                // Debounce: wait until nothing happened for a while.
                loop {
                    match tokio::time::timeout(DEBOUNCE, receiver.recv()).await {
                        Ok(Some(())) => continue,
                        Ok(None) => return,
                        Err(_) => break,
                    }
                }
                if let Err(error) = registry.scan().await {
                    tracing::error!(%error, "scanning the plugins directory failed");
                }
            }
        });
        Ok(WatchGuard { _watcher: watcher, task })
    }

    fn watch_error(&self, error: notify::Error) -> PluginError {
        PluginError::Refused { file: self.directory.display().to_string(), reason: format!("cannot watch it: {error}") }
    }
}

/// Keeps the directory watched; dropping it stops watching.
pub struct WatchGuard {
    _watcher: notify::RecommendedWatcher,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for WatchGuard {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Handlers offered by more than one of `loaded`, with the plugins offering each.
fn contested_handlers(loaded: &[(String, LoadedPlugin, Option<Stamp>)]) -> BTreeMap<String, Vec<String>> {
    let mut offered: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (name, plugin, _) in loaded {
        for subscription in &plugin.subscriptions {
            offered.entry(subscription.handler.clone()).or_default().push(name.clone());
        }
    }
    offered.retain(|_, plugins| plugins.len() > 1);
    offered
}

/// `*.wasm` files of the directory by plugin name; hidden files (editors' and copy tools'
/// temporary files) are left out.
fn plugin_files(directory: &Path) -> std::io::Result<BTreeMap<String, PathBuf>> {
    let mut files = BTreeMap::new();
    for entry in std::fs::read_dir(directory)? {
        let path = entry?.path();
        let Some(file_name) = path.file_name().and_then(|n| n.to_str()) else { continue };
        if file_name.starts_with('.') || !path.is_file() {
            continue;
        }
        if let Some(name) = file_name.strip_suffix(".wasm") {
            files.insert(name.to_string(), path.clone());
        }
    }
    Ok(files)
}
