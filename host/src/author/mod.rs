//! What a plugin author runs outside this repository: `relayhost new` writes a plugin project
//! in one of the four languages ([`template`]), `relayhost build` builds it into a component
//! with that language's pinned toolchain ([`build`]), and `relayhost test-plugin` tries it
//! (see [`crate::trial`]). A project says its name and language in `plugin.toml`.
//!
//! It owns the templates (this repository's order-check examples, with the project's handler
//! id) and the build steps; it never runs a plugin and never touches a store.

pub mod build;
pub mod template;

use std::path::Path;

/// A language a plugin project is written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Language {
    Rust,
    Python,
    Javascript,
    C,
}

impl std::str::FromStr for Language {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        match text.to_ascii_lowercase().as_str() {
            "rust" | "rs" => Ok(Self::Rust),
            "python" | "py" => Ok(Self::Python),
            "javascript" | "js" => Ok(Self::Javascript),
            "c" => Ok(Self::C),
            other => Err(format!("{other:?} is not a language relayhost builds (rust, python, javascript or c)")),
        }
    }
}

/// `plugin.toml`: what `relayhost new` wrote and `relayhost build` reads.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct Project {
    /// The plugin's name: its handler id, its component's file name (`<name>.wasm`) and its
    /// `[plugin.<name>]` section in a host's configuration.
    pub name: String,
    pub language: Language,
}

/// The file a project is described by.
pub const PROJECT_FILE: &str = "plugin.toml";

#[derive(Debug, thiserror::Error)]
pub enum AuthorError {
    #[error("{0}")]
    Invalid(String),
    #[error("{tool} is missing: {how}")]
    MissingTool { tool: String, how: String },
    #[error("the build failed: {0}")]
    BuildFailed(String),
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
}

impl AuthorError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        Self::Io { path: path.display().to_string(), source }
    }
}

impl Project {
    /// The project in `dir`.
    pub fn read(dir: &Path) -> Result<Self, AuthorError> {
        let path = dir.join(PROJECT_FILE);
        let text = std::fs::read_to_string(&path).map_err(|source| match source.kind() {
            std::io::ErrorKind::NotFound => AuthorError::Invalid(format!(
                "{} has no {PROJECT_FILE}: run `relayhost build` in a folder `relayhost new` made",
                dir.display()
            )),
            _ => AuthorError::io(&path, source),
        })?;
        let project: Self = toml::from_str(&text).map_err(|e| AuthorError::Invalid(format!("{}: {e}", path.display())))?;
        check_name(&project.name)?;
        Ok(project)
    }
}

/// A plugin name: a lower-case letter, then lower-case letters, digits, `-` or `_`, at most 64.
pub fn check_name(name: &str) -> Result<(), AuthorError> {
    let mut chars = name.chars();
    let first = chars.next().is_some_and(|c| c.is_ascii_lowercase());
    if !first || name.len() > 64 || !chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_') {
        return Err(AuthorError::Invalid(format!(
            "{name:?} is not a plugin name: a lower-case letter, then lower-case letters, digits, `-` or `_` (at most 64)"
        )));
    }
    Ok(())
}
