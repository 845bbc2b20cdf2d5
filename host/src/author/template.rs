//! `relayhost new`: a plugin project in a new folder, anywhere. Each language's handler is
//! this repository's order-check example of that language (built and tested here), with the
//! project's name as its handler id; beside it the WIT, a sample `events.jsonl` that
//! `relayhost test-plugin` runs green, a `relayhost.toml` configuring the plugin, a README and
//! what its build needs: for Rust the guest SDK, vendored (its WIT path adjusted); for
//! JavaScript the pinned `package.json`, its lock file and the build script.

use std::path::{Path, PathBuf};

use super::{AuthorError, Language, PROJECT_FILE, Project, check_name};

const WIT: &str = include_str!("../../../wit/relayhost.wit");
const RUST_HANDLER: &str = include_str!("../../../plugins/examples/order-check/src/lib.rs");
const RUST_SDK: &str = include_str!("../../../plugins/sdk/src/lib.rs");
const PYTHON_HANDLER: &str = include_str!("../../../plugins/python/order-check/app.py");
const JAVASCRIPT_HANDLER: &str = include_str!("../../../plugins/javascript/order-check/handler.js");
const JAVASCRIPT_PACKAGE: &str = include_str!("../../../plugins/javascript/package.json");
const JAVASCRIPT_LOCK: &str = include_str!("../../../plugins/javascript/package-lock.json");
const JAVASCRIPT_BUILD: &str = include_str!("../../../plugins/javascript/componentize.mjs");
const C_HANDLER: &str = include_str!("../../../plugins/c/order-check/handler.c");

/// The versions the vendored SDK builds with: those of this repository's plugins.
const WIT_BINDGEN: &str = "0.63";

/// The handler id each example declares, replaced by the project's name.
fn example_id(language: Language) -> &'static str {
    match language {
        Language::Rust => "rs-order-check",
        Language::Python => "py-order-check",
        Language::Javascript => "js-order-check",
        Language::C => "c-order-check",
    }
}

/// Writes the project `name` in `language` into the new folder `dir`; the files written.
pub fn create(dir: &Path, name: &str, language: Language) -> Result<Vec<PathBuf>, AuthorError> {
    check_name(name)?;
    if dir.exists() && std::fs::read_dir(dir).map_err(|e| AuthorError::io(dir, e))?.next().is_some() {
        return Err(AuthorError::Invalid(format!("{} exists and is not empty", dir.display())));
    }
    let mut files: Vec<(PathBuf, String)> = vec![
        (PROJECT_FILE.into(), toml::to_string(&Project { name: name.to_string(), language }).expect("a project serializes")),
        ("wit/relayhost.wit".into(), WIT.to_string()),
        ("events.jsonl".into(), EVENTS.to_string()),
        ("relayhost.toml".into(), CONFIG.replace("{name}", name)),
        ("README.md".into(), readme(name, language)),
        (".gitignore".into(), "/target\n/build\n/node_modules\n*.wasm\n".into()),
    ];
    let handler = |source: &str| source.replace(example_id(language), name);
    match language {
        Language::Rust => {
            files.push(("Cargo.toml".into(), RUST_MANIFEST.replace("{name}", name)));
            files.push(("src/lib.rs".into(), handler(RUST_HANDLER).replace("struct OrderCheck", "struct Handler").replace("(OrderCheck)", "(Handler)").replace("for OrderCheck", "for Handler")));
            files.push(("sdk/Cargo.toml".into(), SDK_MANIFEST.replace("{wit_bindgen}", WIT_BINDGEN)));
            files.push(("sdk/src/lib.rs".into(), RUST_SDK.replace("path: \"../../wit\"", "path: \"../wit\"")));
        }
        Language::Python => files.push(("app.py".into(), handler(PYTHON_HANDLER))),
        Language::Javascript => {
            files.push(("handler.js".into(), handler(JAVASCRIPT_HANDLER)));
            files.push(("package.json".into(), JAVASCRIPT_PACKAGE.to_string()));
            files.push(("package-lock.json".into(), JAVASCRIPT_LOCK.to_string()));
            files.push(("componentize.mjs".into(), JAVASCRIPT_BUILD.to_string()));
        }
        Language::C => files.push(("handler.c".into(), handler(C_HANDLER))),
    }
    let mut written = Vec::new();
    for (relative, text) in files {
        let path = dir.join(relative);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| AuthorError::io(parent, e))?;
        }
        std::fs::write(&path, text).map_err(|e| AuthorError::io(&path, e))?;
        written.push(path);
    }
    Ok(written)
}

const EVENTS: &str = r#"# One event a line, as `relayhost test-plugin` reads them: `id`, `type`, `payload`, and
# optionally `key`, `headers` and `expect` (completed, retry or dead; completed when absent).
# An HTTP fixture answers a request the plugin makes: {"http": {"method": "POST", "url": "https://...", "status": 200, "body": ""}}
{"id": "order-1", "type": "order.placed", "key": "customer-1", "payload": {"orderId": "o-1", "total": 25}}
{"id": "order-2", "type": "order.placed", "key": "customer-1", "payload": {"orderId": "o-2", "total": 40}}
{"id": "order-3", "type": "order.placed", "payload": {"total": 5}, "expect": "dead"}
"#;

const CONFIG: &str = r#"# The plugin's settings, as a host's configuration gives them (`relayhost test-plugin
# --config relayhost.toml`; copy the section into your hosts' configuration). A plugin starts
# with no grants: name the collections, hosts, environment variables and follow-up event
# types it may use.
[plugin.{name}]
wall_time = "2s"
retry = { max_attempts = 5, initial_backoff = "1s", max_backoff = "1m" }
# grants = { collections = ["orders"], http_hosts = ["hooks.example.com"], environment = ["API_TOKEN"], publish_types = ["order.checked"] }
"#;

const RUST_MANIFEST: &str = r#"[package]
name = "{name}"
version = "0.1.0"
edition = "2024"

[lib]
crate-type = ["cdylib"]

[dependencies]
relayhost-guest = { path = "sdk" }
serde_json = "1"

# Small components, as relayhost's own plugins are built.
[profile.release]
opt-level = "s"
lto = true
codegen-units = 1
strip = true
panic = "abort"

# A project of its own, even inside another workspace's folder.
[workspace]
"#;

const SDK_MANIFEST: &str = r#"[package]
name = "relayhost-guest"
description = "Write relayhost handler plugins in Rust (vendored by `relayhost new`)"
version = "0.1.0"
edition = "2024"

[dependencies]
wit-bindgen = "{wit_bindgen}"
serde = { version = "1", features = ["derive"] }
serde_json = "1"
"#;

fn readme(name: &str, language: Language) -> String {
    let (handler, needs) = match language {
        Language::Rust => ("src/lib.rs", "Rust with the `wasm32-wasip2` target (`rustup target add wasm32-wasip2`); the guest SDK is in `sdk/`."),
        Language::Python => ("app.py", "Python 3 and componentize-py 0.25.1 (`pip install componentize-py==0.25.1`)."),
        Language::Javascript => ("handler.js", "Node.js and componentize-js 0.23.0, pinned in `package.json` (`npm ci` in this folder)."),
        Language::C => (
            "handler.c",
            "clang 14 with wasi-libc (Debian: `apt-get install clang-14 lld wasi-libc libclang-rt-14-dev-wasm32`), \
             `wit-bindgen` 0.57.1, `wasm-tools` 1.262.0 and the WASI preview1 reactor adapter of wasmtime 48.0.8 \
             (`relayhost build` names whichever is missing and how to get it).",
        ),
    };
    format!(
        "# {name}\n\n\
         A relayhost handler plugin: `{handler}` subscribes the handler `{name}` to `order.placed` events, logs each\n\
         order it checks, and refuses one without an `orderId` (dead at once: retrying cannot help).\n\n\
         ```sh\n\
         relayhost build                      # -> {name}.wasm\n\
         relayhost test-plugin {name}.wasm --events events.jsonl --config relayhost.toml\n\
         ```\n\n\
         `test-plugin` runs the component on the events of `events.jsonl` on an in-memory store, no MongoDB: each\n\
         delivery's outcome, what its transaction wrote, the follow-up events it published, its HTTP requests\n\
         (answered from the file's fixtures; `--allow-http` sends the others), its log lines, fuel, memory and time.\n\
         It exits non-zero when a delivery did not end as the file's `expect` (or `--expect`) says.\n\n\
         To deploy, copy `{name}.wasm` into a host's plugins directory (it is loaded within a second, and hot-swapped\n\
         when replaced) and the `[plugin.{name}]` section of `relayhost.toml` into the host's configuration.\n\n\
         The build needs {needs}\n\
         The interface is `wit/relayhost.wit`.\n"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_template_renames_its_example_and_the_sdk_builds_with_the_repositorys_versions() {
        let plugins_manifest = include_str!("../../../plugins/Cargo.toml");
        assert!(plugins_manifest.contains(&format!("wit-bindgen = \"{WIT_BINDGEN}\"")), "the vendored SDK's wit-bindgen is the repository's");
        assert!(RUST_SDK.contains("path: \"../../wit\""), "the SDK's WIT path is the one the template adjusts");
        for language in [Language::Rust, Language::Python, Language::Javascript, Language::C] {
            let dir = std::env::temp_dir().join(format!("relayhost-template-{language:?}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            let written = create(&dir, "order-audit", language).unwrap();
            let all: String = written.iter().map(|path| std::fs::read_to_string(path).unwrap()).collect();
            assert!(!all.contains(example_id(language)), "{language:?}: the example's id is replaced");
            assert!(all.contains("\"order-audit\""), "{language:?}");
            assert_eq!(Project::read(&dir).unwrap(), Project { name: "order-audit".into(), language });
            assert!(create(&dir, "order-audit", language).unwrap_err().to_string().contains("is not empty"));
            std::fs::remove_dir_all(&dir).unwrap();
        }
        for bad in ["", "Orders", "1st", "a b", "../up", &"x".repeat(65)] {
            assert!(create(Path::new("/nonexistent"), bad, Language::C).unwrap_err().to_string().contains("is not a plugin name"), "{bad}");
        }
    }
}
