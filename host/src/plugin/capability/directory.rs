//! The directory capability: one host directory a plugin may read, mounted read-only at
//! `/data`. Its grant is the directory (none by default); it has no limits and no import of its
//! own (WASI's filesystem is linked with WASI). It must never mount anything writable.

use std::path::PathBuf;

use wasmtime_wasi::{FsPerms, WasiCtxBuilder};

/// Where the plugin's `/data` comes from, if anywhere.
pub type Grant = Option<PathBuf>;

/// Mounts the granted directory, read-only; a directory that cannot be opened is left out
/// (and said).
pub fn prepare(plugin: &str, grant: &Grant, wasi: &mut WasiCtxBuilder) {
    if let Some(directory) = grant {
        if let Err(error) = wasi.preopened_dir(directory, "/data", FsPerms::ReadOnly) {
            tracing::warn!(plugin, %error, directory = %directory.display(), "cannot open the granted directory");
        }
    }
}
