//! The configuration a running host applies now, and its reload from the file (on SIGHUP or
//! a change of the file, see `crate::service`).
//!
//! It owns which sections apply live and which need a restart. What a reload applies is the
//! new file's processing settings (`[defaults]`, `[plugin.*]`: limits, grants, retry policies,
//! throttles, limits across hosts, priorities) and its `[schemas]`; every other section was
//! used to start the host (connections, listeners, the dispatcher's size), so a change there
//! is named as needing a restart and the running value stays. A file that does not load (it
//! does not parse, a value is out of range, a schema does not compile) changes nothing. It
//! must never start or stop anything: its readers ask it for the settings at each use.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use super::{Config, ConfigError};

/// The settings a running host applies now.
pub struct LiveConfig {
    /// The file it was loaded from (none: the defaults and the environment alone).
    path: Option<PathBuf>,
    current: RwLock<Arc<Config>>,
}

/// What a reload changed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Reloaded {
    /// The live sections whose settings changed, now applied.
    pub applied: Vec<&'static str>,
    /// The sections that changed but apply only at the next start: their running values stay.
    pub need_restart: Vec<&'static str>,
}

impl LiveConfig {
    pub fn new(config: Config, path: Option<&Path>) -> Arc<Self> {
        Arc::new(Self { path: path.map(Path::to_path_buf), current: RwLock::new(Arc::new(config)) })
    }

    /// The settings in force.
    pub fn get(&self) -> Arc<Config> {
        self.current.read().expect("live configuration").clone()
    }

    /// The file it reloads from.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Loads the file again (with `environment` applied, as at start) and applies its live
    /// sections; the settings in force stay whole if it does not load.
    pub fn reload(&self, environment: impl IntoIterator<Item = (String, String)>) -> Result<Reloaded, ConfigError> {
        let new = Config::load(self.path.as_deref(), environment)?;
        let mut current = self.current.write().expect("live configuration");
        let (applied, reloaded) = merged(&current, new);
        *current = Arc::new(applied);
        Ok(reloaded)
    }
}

/// `new`'s live sections over `running`'s others, and what differed.
fn merged(running: &Config, new: Config) -> (Config, Reloaded) {
    let mut reloaded = Reloaded::default();
    let mut changed = |section: &'static str, differs: bool, live: bool| {
        if differs {
            if live { reloaded.applied.push(section) } else { reloaded.need_restart.push(section) }
        }
    };
    changed("defaults", running.defaults != new.defaults, true);
    changed("plugin", running.plugin != new.plugin, true);
    changed("schemas", running.schemas != new.schemas, true);
    changed("mongodb", running.mongodb != new.mongodb, false);
    changed("host", running.host != new.host, false);
    changed("plugins", running.plugins != new.plugins, false);
    changed("retention", running.retention != new.retention, false);
    changed("admin", running.admin != new.admin, false);
    changed("telemetry", running.telemetry != new.telemetry, false);
    let applied = Config { defaults: new.defaults, plugin: new.plugin, schemas: new.schemas, ..running.clone() };
    (applied, reloaded)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A configuration file of its own, in a folder removed when the test ends.
    struct Written(PathBuf);

    impl Drop for Written {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(self.0.parent().expect("its folder"));
        }
    }

    fn written(text: &str) -> (Written, PathBuf) {
        let folder = std::env::temp_dir().join(format!("relayhost-live-{}", bson::oid::ObjectId::new()));
        std::fs::create_dir_all(&folder).unwrap();
        let path = folder.join("relayhost.toml");
        std::fs::write(&path, text).unwrap();
        (Written(path.clone()), path)
    }

    #[test]
    fn a_reload_applies_the_processing_settings_and_names_what_needs_a_restart() {
        let (_folder, path) = written("[host]\nconcurrency = 8\n[plugin.mail]\nconcurrency_per_host = 1\n");
        let live = LiveConfig::new(Config::load(Some(&path), []).unwrap(), Some(&path));
        std::fs::write(&path, "[host]\nconcurrency = 16\n[plugin.mail]\nconcurrency_per_host = 4\nretry = { max_attempts = 3 }\n").unwrap();
        let reloaded = live.reload([]).unwrap();
        assert_eq!(reloaded, Reloaded { applied: vec!["plugin"], need_restart: vec!["host"] });
        let now = live.get();
        assert_eq!(now.plugin["mail"].concurrency_per_host, Some(4), "applied");
        assert_eq!(now.host.concurrency, 8, "the running value stays until a restart");
        // The same file again applies nothing, and still says what waits for a restart.
        assert_eq!(live.reload([]).unwrap(), Reloaded { applied: vec![], need_restart: vec!["host"] });
    }

    #[test]
    fn a_file_that_does_not_load_changes_nothing() {
        let (_folder, path) = written("[plugin.mail]\nconcurrency_per_host = 2\n");
        let live = LiveConfig::new(Config::load(Some(&path), []).unwrap(), Some(&path));
        for broken in ["[plugin.mail\n", "[plugin.mail]\nconcurrency_per_host = 0\n", "[schemas]\n\"t\" = \"missing.json\"\n"] {
            std::fs::write(&path, broken).unwrap();
            let error = live.reload([]).unwrap_err().to_string();
            assert!(!error.is_empty());
            assert_eq!(live.get().plugin["mail"].concurrency_per_host, Some(2), "{broken:?} was refused: {error}");
        }
    }
}
