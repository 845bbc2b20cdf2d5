//! `relayhost build`: a project's component, built with its language's toolchain, pinned as
//! this repository's `scripts/build-plugins.sh` pins it. A tool is looked for in relayhost's
//! cache first (where that script installs it), then on `PATH`; a missing one is named with
//! how to get it, before anything runs. The component is written as `<name>.wasm` in the
//! project's folder. It never installs anything itself.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::{AuthorError, Language, Project};

const COMPONENTIZE_PY: &str = "componentize-py-0.25.1";
const COMPONENTIZE_JS: &str = "componentize-js-0.23.0";
const WIT_BINDGEN: &str = "wit-bindgen-cli-0.57.1";
const WASM_TOOLS: &str = "wasm-tools-1.262.0";
const ADAPTER: &str = "wasi-preview1-adapter-48.0.8";

/// Builds the project in `dir`; the component's path.
pub fn build(dir: &Path) -> Result<PathBuf, AuthorError> {
    let project = Project::read(dir)?;
    let out = dir.join(format!("{}.wasm", project.name));
    match project.language {
        Language::Rust => rust(dir, &project, &out)?,
        Language::Python => python(dir, &out)?,
        Language::Javascript => javascript(dir, &out)?,
        Language::C => c(dir, &out)?,
    }
    Ok(out)
}

fn missing(tool: &str, how: &str) -> AuthorError {
    AuthorError::MissingTool { tool: tool.to_string(), how: how.to_string() }
}

/// `name` on `PATH`.
fn on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|path| std::env::split_paths(&path).map(|dir| dir.join(name)).find(|candidate| candidate.is_file()))
}

/// A tool relayhost's set-up scripts installed into the cache, if complete.
fn cached(tool: &str) -> Option<PathBuf> {
    let dir = crate::mongod::cache_dir().join(tool);
    dir.join(".complete").is_file().then_some(dir)
}

/// Runs `command`, its output the user's; fails naming it when it fails.
fn run(command: &mut Command) -> Result<(), AuthorError> {
    let shown = format!("{command:?}");
    let status = command.status().map_err(|e| AuthorError::BuildFailed(format!("{shown} did not start: {e}")))?;
    if !status.success() {
        return Err(AuthorError::BuildFailed(format!("{shown} exited with {status}")));
    }
    Ok(())
}

fn rust(dir: &Path, project: &Project, out: &Path) -> Result<(), AuthorError> {
    on_path("cargo").ok_or_else(|| missing("cargo", "install Rust with rustup (https://rustup.rs)"))?;
    if on_path("rustup").is_some() {
        let installed = Command::new("rustup").args(["target", "list", "--installed"]).output().map_err(|e| AuthorError::BuildFailed(e.to_string()))?;
        if !String::from_utf8_lossy(&installed.stdout).lines().any(|target| target.trim() == "wasm32-wasip2") {
            return Err(missing("the wasm32-wasip2 target", "rustup target add wasm32-wasip2"));
        }
    }
    run(Command::new("cargo").args(["build", "--release", "--target", "wasm32-wasip2", "--manifest-path"]).arg(dir.join("Cargo.toml")))?;
    let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| dir.join("target"));
    let built = target.join("wasm32-wasip2/release").join(format!("{}.wasm", project.name.replace('-', "_")));
    std::fs::copy(&built, out).map_err(|e| AuthorError::io(&built, e))?;
    Ok(())
}

fn python(dir: &Path, out: &Path) -> Result<(), AuthorError> {
    on_path("python3").ok_or_else(|| missing("python3", "install Python 3 (Debian: apt-get install python3)"))?;
    let arguments = |command: &mut Command| {
        command.current_dir(dir).args(["-d", "wit", "-w", "plugin", "componentize", "app", "-p", "."]).arg("-o").arg(out);
    };
    let mut command = if let Some(tool) = cached(COMPONENTIZE_PY) {
        let mut command = Command::new("python3");
        command.env("PYTHONPATH", tool).args([
            "-c",
            "import sys; from componentize_py import script; sys.argv[0] = 'componentize-py'; sys.exit(script())",
        ]);
        command
    } else if let Some(tool) = on_path("componentize-py") {
        Command::new(tool)
    } else {
        return Err(missing("componentize-py 0.25.1", "pip install componentize-py==0.25.1"));
    };
    arguments(&mut command);
    run(&mut command)
}

fn javascript(dir: &Path, out: &Path) -> Result<(), AuthorError> {
    on_path("node").ok_or_else(|| missing("node", "install Node.js 20 or newer (Debian: apt-get install nodejs npm)"))?;
    let package = Path::new("node_modules/@bytecodealliance/componentize-js");
    // The build script resolves componentize-js from where it lies: this folder's
    // `node_modules`, or the cache's (where a copy of the script is put).
    let script = if dir.join(package).is_dir() {
        dir.join("componentize.mjs")
    } else if let Some(tool) = cached(COMPONENTIZE_JS).filter(|tool| tool.join(package).is_dir()) {
        let script = tool.join("componentize.mjs");
        std::fs::copy(dir.join("componentize.mjs"), &script).map_err(|e| AuthorError::io(&script, e))?;
        script
    } else {
        return Err(missing("componentize-js 0.23.0", "npm ci (in this folder: package.json pins it)"));
    };
    run(Command::new("node").current_dir(dir).arg(script).arg(dir.join("handler.js")).arg(dir.join("wit")).arg(out))
}

fn c(dir: &Path, out: &Path) -> Result<(), AuthorError> {
    let debian = "apt-get install clang-14 lld wasi-libc libclang-rt-14-dev-wasm32";
    on_path("clang-14").ok_or_else(|| missing("clang-14", debian))?;
    on_path("wasm-ld").ok_or_else(|| missing("wasm-ld", debian))?;
    if !Path::new("/usr/include/wasm32-wasi/stdio.h").is_file() {
        return Err(missing("wasi-libc", debian));
    }
    let wit_bindgen = cached(WIT_BINDGEN)
        .map(|tool| tool.join("bin/wit-bindgen"))
        .or_else(|| on_path("wit-bindgen"))
        .ok_or_else(|| missing("wit-bindgen 0.57.1", "cargo install wit-bindgen-cli --version 0.57.1 --no-default-features --features c"))?;
    let wasm_tools = cached(WASM_TOOLS)
        .map(|tool| tool.join("bin/wasm-tools"))
        .or_else(|| on_path("wasm-tools"))
        .ok_or_else(|| missing("wasm-tools 1.262.0", "cargo install wasm-tools --version 1.262.0 --no-default-features --features component"))?;
    let adapter = std::env::var_os("RELAYHOST_WASI_ADAPTER")
        .map(PathBuf::from)
        .or_else(|| cached(ADAPTER).map(|tool| tool.join("wasi_snapshot_preview1.reactor.wasm")))
        .filter(|adapter| adapter.is_file())
        .ok_or_else(|| {
            missing(
                "the WASI preview1 reactor adapter of wasmtime 48.0.8",
                "download wasi_snapshot_preview1.reactor.wasm from wasmtime's v48.0.8 release and set RELAYHOST_WASI_ADAPTER to its path",
            )
        })?;
    let build = dir.join("build");
    let _ = std::fs::remove_dir_all(&build);
    std::fs::create_dir_all(&build).map_err(|e| AuthorError::io(&build, e))?;
    run(Command::new(wit_bindgen).arg("c").arg(dir.join("wit")).args(["--world", "plugin", "--out-dir"]).arg(&build))?;
    let sources: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| AuthorError::io(dir, e))?
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .filter(|path| path.extension().is_some_and(|ext| ext == "c"))
        .collect();
    run(Command::new("clang-14")
        .args(["--target=wasm32-wasi", "-mexec-model=reactor", "-O2", "-Wall", "-Werror"])
        .arg(format!("-I{}", build.display()))
        .arg(build.join("plugin.c"))
        .arg(build.join("plugin_component_type.o"))
        .args(&sources)
        .arg("-o")
        .arg(build.join("core.wasm")))?;
    run(Command::new(wasm_tools)
        .args(["component", "new"])
        .arg(build.join("core.wasm"))
        .arg("--adapt")
        .arg(format!("wasi_snapshot_preview1={}", adapter.display()))
        .arg("-o")
        .arg(out))
}
