//! The environment capability: variables of the host's environment a plugin may read, by
//! name. Its grant is the list of names (empty by default); it has no limits and no import of
//! its own (WASI's environment is linked with WASI). It must never pass a variable not named.

use wasmtime_wasi::WasiCtxBuilder;

/// Names of the host's environment variables passed through (their values come from the host).
pub type Grant = Vec<String>;

/// Puts the granted variables the host has into the instance's WASI context.
pub fn prepare(grant: &Grant, wasi: &mut WasiCtxBuilder) {
    for name in grant {
        if let Ok(value) = std::env::var(name) {
            wasi.env(name, value);
        }
    }
}
