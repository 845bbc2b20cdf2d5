//! The log capability: log lines (the `log` import) and stdout/stderr of one delivery, kept up
//! to a byte budget and routed to `tracing` under the plugin's name afterwards. Every plugin
//! has it (no grant); its limit is the budget. Output beyond it is counted and dropped; it
//! never fails the plugin's write, and it never reaches the host's logs unbounded.

use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use tokio::io::AsyncWrite;
use wasmtime::component::{HasSelf, Linker};
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::WasiCtxBuilder;

use crate::plugin::bindings::relayhost::plugin::log;
use crate::plugin::LogLevel;

/// The log capability's limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Log lines plus stdout/stderr kept per delivery, in bytes; the rest is dropped.
    pub output_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self { output_bytes: 64 * 1024 }
    }
}

/// Links the `log` import to the instance's [`Output`].
pub fn link<T: Send + 'static>(linker: &mut Linker<T>, get: fn(&mut T) -> &mut Output) -> wasmtime::Result<()> {
    log::add_to_linker::<T, HasSelf<Output>>(linker, get)
}

/// The per-instance state: the delivery's output, with stdout and stderr wired into `wasi`.
pub fn prepare(limits: &Limits, wasi: &mut WasiCtxBuilder) -> Output {
    let output = Output::new(limits.output_bytes);
    wasi.stdout(output.stream(Source::Stdout)).stderr(output.stream(Source::Stderr));
    output
}

impl log::Host for Output {
    async fn log(&mut self, level: LogLevel, message: String) {
        self.push(Source::Log(level), &message);
    }
}

/// Sends the delivery's output to `tracing`, one event a line, every control character left
/// in a line escaped (`\r`, `\u{1b}`, ...): a plugin can neither rewrite an operator's terminal
/// nor forge a line of the host's own; returns the bytes kept and dropped.
pub fn route(plugin: &str, version: &str, output: &Output) -> (usize, usize) {
    let (kept, dropped, _) = route_keeping(plugin, version, output, false);
    (kept, dropped)
}

/// [`route`], also handing back the lines routed (`LEVEL text`, escaped) when `keep` (a
/// plugin being tried shows them in its report).
pub fn route_keeping(plugin: &str, version: &str, output: &Output, keep: bool) -> (usize, usize, Vec<String>) {
    let (kept, dropped) = output.take();
    let kept_bytes = kept.iter().map(|(_, text)| text.len()).sum();
    let mut lines = Vec::new();
    for (source, text) in kept {
        for line in text.lines().filter(|l| !l.is_empty()).map(escaped) {
            let level = match source {
                Source::Log(LogLevel::Error) | Source::Stderr => {
                    tracing::error!(plugin, version, "{line}");
                    "ERROR"
                }
                Source::Log(LogLevel::Warn) => {
                    tracing::warn!(plugin, version, "{line}");
                    "WARN"
                }
                Source::Log(LogLevel::Info) | Source::Stdout => {
                    tracing::info!(plugin, version, "{line}");
                    "INFO"
                }
                Source::Log(LogLevel::Debug) => {
                    tracing::debug!(plugin, version, "{line}");
                    "DEBUG"
                }
                Source::Log(LogLevel::Trace) => {
                    tracing::trace!(plugin, version, "{line}");
                    "TRACE"
                }
            };
            if keep {
                lines.push(format!("{level} {line}"));
            }
        }
    }
    if dropped > 0 {
        tracing::warn!(plugin, version, dropped_bytes = dropped, "plugin output over its budget was dropped");
        if keep {
            lines.push(format!("WARN ({dropped} bytes of output over its budget were dropped)"));
        }
    }
    (kept_bytes, dropped, lines)
}

/// `line` with every control character escaped as Rust writes it (`\r`, `\t`, `\u{0}`).
pub fn escaped(line: &str) -> std::borrow::Cow<'_, str> {
    if !line.chars().any(char::is_control) {
        return std::borrow::Cow::Borrowed(line);
    }
    let mut text = String::with_capacity(line.len() + 8);
    for c in line.chars() {
        if c.is_control() {
            text.extend(c.escape_default());
        } else {
            text.push(c);
        }
    }
    std::borrow::Cow::Owned(text)
}

#[derive(Debug, Default)]
struct Buffer {
    kept: Vec<(Source, String)>,
    used: usize,
    dropped: usize,
}

/// Where a piece of output came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Log(LogLevel),
    Stdout,
    Stderr,
}

/// The output budget of one delivery, shared by the log import and the stdio streams.
#[derive(Debug, Clone)]
pub struct Output {
    buffer: Arc<Mutex<Buffer>>,
    budget: usize,
}

impl Output {
    pub fn new(budget: usize) -> Self {
        Self { buffer: Arc::default(), budget }
    }

    /// Keeps as much of `text` as the budget allows; returns how many bytes were kept.
    pub fn push(&self, source: Source, text: &str) -> usize {
        let mut buffer = self.buffer.lock().expect("output buffer");
        let room = self.budget.saturating_sub(buffer.used);
        let mut end = text.len().min(room);
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        buffer.used += end;
        buffer.dropped += text.len() - end;
        if end > 0 {
            buffer.kept.push((source, text[..end].to_string()));
        }
        end
    }

    /// The last non-empty line kept from `source`, leaving out the hint lines (`note: ...`)
    /// runtimes print after a panic message: a panicking guest's reason is there.
    pub fn last_line(&self, source: Source) -> Option<String> {
        let buffer = self.buffer.lock().expect("output buffer");
        // Writes may split a line; join the source's pieces first.
        let text: String = buffer.kept.iter().filter(|(from, _)| *from == source).map(|(_, text)| text.as_str()).collect();
        text.lines().rev().map(str::trim).find(|line| !line.is_empty() && !line.starts_with("note: ")).map(str::to_string)
    }

    /// Everything kept, in order, and how many bytes were dropped.
    pub fn take(&self) -> (Vec<(Source, String)>, usize) {
        let mut buffer = self.buffer.lock().expect("output buffer");
        (std::mem::take(&mut buffer.kept), buffer.dropped)
    }

    pub fn stream(&self, source: Source) -> OutputStream {
        OutputStream { output: self.clone(), source }
    }
}

/// A stdout or stderr of a plugin.
#[derive(Clone)]
pub struct OutputStream {
    output: Output,
    source: Source,
}

impl IsTerminal for OutputStream {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for OutputStream {
    fn async_stream(&self) -> Box<dyn AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
}

impl AsyncWrite for OutputStream {
    fn poll_write(self: Pin<&mut Self>, _cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.output.push(self.source, &String::from_utf8_lossy(buf));
        // Everything counts as written: a plugin over its budget goes on, silenced.
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_beyond_the_budget_is_counted_and_dropped() {
        let output = Output::new(10);
        assert_eq!(output.push(Source::Stdout, "hello "), 6);
        assert_eq!(output.push(Source::Stderr, "wörld!"), 4);
        let (kept, dropped) = output.take();
        assert_eq!(kept.iter().map(|(_, t)| t.as_str()).collect::<String>(), "hello wör");
        assert_eq!(dropped, 3);
    }
}
