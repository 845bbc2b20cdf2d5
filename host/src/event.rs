//! The event document: the publishing protocol every driver in every language follows.
//!
//! This module owns the field names and BSON types of `<prefix>events` documents, the
//! validation of new events before they are written, and the strict parsing of stored event
//! documents at fan-out (a document another driver wrote may be anything). It must never talk
//! to a database.

use std::collections::BTreeMap;

use bson::{Bson, DateTime, Document, doc};

/// Field names of an event document. Publishers in other languages write exactly these.
pub mod field {
    pub const ID: &str = "_id";
    pub const TYPE: &str = "type";
    pub const PAYLOAD: &str = "payload";
    pub const KEY: &str = "key";
    pub const SEQUENCE: &str = "sequence";
    pub const HEADERS: &str = "headers";
    pub const CORRELATION_ID: &str = "correlationId";
    pub const CAUSATION_ID: &str = "causationId";
    /// How urgent it is, an integer from -1000 to 1000 (absent: no priority of its own). A
    /// handler set to take priorities per event gets its deliveries of higher priorities first.
    pub const PRIORITY: &str = "priority";
    /// How many handlers' follow-ups lie between it and an application's event (0, the
    /// default, is left out): a handler's follow-up of an event of depth `n` has `n + 1`.
    pub const CHAIN_DEPTH: &str = "chainDepth";
    /// Written by the host on handlers' follow-ups: how many descendants the event may still
    /// have (see the transaction capability's `descendants` limit). An event without it (an
    /// application's) has the handling plugin's whole limit.
    pub const CHAIN_BUDGET: &str = "chainBudget";
    pub const CREATED_AT: &str = "createdAt";
    /// Written by the host at fan-out; absent until then.
    pub const FANNED_OUT_AT: &str = "fannedOutAt";
    /// Every handler the event ever had a delivery for, completed ones included.
    pub const HANDLERS: &str = "handlers";
    /// Set by the host on an event too large to deliver: the collection its whole document
    /// was moved to (its payload taken out of it here).
    pub const PAYLOAD_MOVED_TO: &str = "payloadMovedTo";
    /// The time of the latest completion of any of its deliveries.
    pub const COMPLETED_AT: &str = "completedAt";
    /// Handlers whose delivery of it its fan-out handed out without writing a document for
    /// it (MongoDB); each leaves the list when that delivery completes or gets its document.
    pub const HANDED_OUT: &str = "handedOut";
    /// The fan-out that marked it, when that mark was no transaction (MongoDB): racing
    /// fan-outs tell by it which events each marked.
    pub const FAN_OUT: &str = "fanOut";
    /// Handlers whose run of it may have killed its host before it was fanned out: a
    /// takeover found the run listed as started and the event unfanned (its fan-out's
    /// transaction never committed). Its fan-out gives their deliveries documents, suspect,
    /// for a claim, which records a run's start before it runs.
    pub const SUSPECTS: &str = "suspects";
}

/// Longest event id, in characters.
pub const MAX_ID_CHARS: usize = 256;
/// Longest event type, in characters.
pub const MAX_TYPE_CHARS: usize = 256;
/// Longest ordering key, in characters.
pub const MAX_KEY_CHARS: usize = 512;
/// Default ceiling of an encoded payload, in bytes (the whole document must stay under
/// MongoDB's 16 MiB, and every byte also goes to the oplog).
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 1024 * 1024;
/// The range of an event's priority (see [`field::PRIORITY`]).
pub const PRIORITY_RANGE: std::ops::RangeInclusive<i64> = -1000..=1000;
/// Most headers an event may carry.
pub const MAX_HEADERS: usize = 64;
/// Longest header name, in characters.
pub const MAX_HEADER_NAME_CHARS: usize = 128;
/// Longest header value, in bytes.
pub const MAX_HEADER_VALUE_BYTES: usize = 4 * 1024;
/// Largest stored event document a fan-out delivers, in bytes: the host adds its marks
/// (`fannedOutAt`, `handlers`, ...) to it, and a document may not pass MongoDB's 16 MiB. A
/// larger one, whoever wrote it, is dead-lettered at fan-out instead of failing every fan-out.
pub const MAX_EVENT_DOCUMENT_BYTES: usize = 15 * 1024 * 1024;

/// What is wrong with an event, named by field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EventError {
    #[error("`{field}` must not be empty")]
    Empty { field: &'static str },
    #[error("`{field}` is {chars} characters long; the limit is {max}")]
    TooLong { field: &'static str, chars: usize, max: usize },
    #[error("`{field}` contains a control character")]
    ControlCharacter { field: &'static str },
    #[error("`payload` is {bytes} bytes as BSON; the limit is {max}")]
    PayloadTooLarge { bytes: usize, max: usize },
    #[error("`{field}` is missing")]
    Missing { field: &'static str },
    #[error("`{field}` must be {expected}, found {found}")]
    WrongType { field: &'static str, expected: &'static str, found: String },
    #[error("`sequence` must be a positive integer, found {0}")]
    BadSequence(i64),
    #[error("`sequence` is set but `key` is not; only keyed events carry a sequence")]
    SequenceWithoutKey,
    #[error("`key` is set but `sequence` is missing; a keyed publish must increment the key's counter and store it")]
    KeyWithoutSequence,
    #[error("`headers` has {count} entries; the limit is {max}")]
    TooManyHeaders { count: usize, max: usize },
    #[error("header name {name} is not allowed: {why}")]
    BadHeaderName { name: String, why: &'static str },
    #[error("header {name} is {bytes} bytes long; the limit is {max}")]
    HeaderTooLong { name: String, bytes: usize, max: usize },
    #[error("header {name}'s value contains a control character")]
    HeaderValueControlCharacter { name: String },
    /// The payload does not match its type's JSON Schema (see `crate::event_schema`).
    #[error("{0}")]
    Schema(String),
    #[error("`priority` must be an integer from -1000 to 1000, found {0}")]
    BadPriority(String),
    #[error("`chainDepth` must be a non-negative integer, found {0}")]
    BadChainDepth(String),
    #[error("`chainBudget` must be a non-negative integer, found {0}")]
    BadChainBudget(String),
    #[error("the event document is {bytes} bytes as BSON; the limit is {max} (the host adds to it, and a document may not pass 16 MiB)")]
    DocumentTooLarge { bytes: usize, max: usize },
}

/// An event as an application hands it to [`crate::publish::Publisher::publish`] or a store.
#[derive(Debug, Clone, PartialEq)]
pub struct NewEvent {
    pub id: String,
    pub event_type: String,
    pub payload: Document,
    pub key: Option<String>,
    pub headers: BTreeMap<String, String>,
    pub correlation_id: Option<String>,
    pub causation_id: Option<String>,
    /// See [`field::PRIORITY`].
    pub priority: Option<i32>,
    /// See [`field::CHAIN_DEPTH`]; set by the host for handlers' follow-ups.
    pub chain_depth: u32,
    /// See [`field::CHAIN_BUDGET`]; set by the host for handlers' follow-ups.
    pub chain_budget: Option<u32>,
    /// Defaults to the publisher's clock at publish time.
    pub created_at: Option<DateTime>,
}

impl NewEvent {
    pub fn new(id: impl Into<String>, event_type: impl Into<String>, payload: Document) -> Self {
        Self {
            id: id.into(),
            event_type: event_type.into(),
            payload,
            key: None,
            headers: BTreeMap::new(),
            correlation_id: None,
            causation_id: None,
            priority: None,
            chain_depth: 0,
            chain_budget: None,
            created_at: None,
        }
    }

    /// The same, of priority `priority` (see [`field::PRIORITY`]).
    pub fn with_priority(mut self, priority: i32) -> Self {
        self.priority = Some(priority);
        self
    }

    pub fn with_key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    pub fn with_created_at(mut self, at: DateTime) -> Self {
        self.created_at = Some(at);
        self
    }

    /// Checks everything that can be checked without a database.
    pub fn validate(&self, max_payload_bytes: usize) -> Result<(), EventError> {
        check_text(field::ID, &self.id, MAX_ID_CHARS)?;
        check_text(field::TYPE, &self.event_type, MAX_TYPE_CHARS)?;
        if let Some(key) = &self.key {
            check_text(field::KEY, key, MAX_KEY_CHARS)?;
        }
        if let Some(id) = &self.correlation_id {
            check_text(field::CORRELATION_ID, id, MAX_ID_CHARS)?;
        }
        if let Some(id) = &self.causation_id {
            check_text(field::CAUSATION_ID, id, MAX_ID_CHARS)?;
        }
        if let Some(priority) = self.priority {
            priority_in_range(i64::from(priority))?;
        }
        check_headers(self.headers.iter().map(|(name, value)| (name.as_str(), value.as_str())), self.headers.len())?;
        let bytes = bson::to_vec(&self.payload).map(|v| v.len()).unwrap_or(usize::MAX);
        if bytes > max_payload_bytes {
            return Err(EventError::PayloadTooLarge { bytes, max: max_payload_bytes });
        }
        Ok(())
    }

    /// The document to insert, with the key's sequence when keyed. Empty optional fields are
    /// left out: every byte of a new document is written to the oplog too.
    pub fn to_document(&self, sequence: Option<i64>, now: DateTime) -> Document {
        let mut document = doc! {
            field::ID: &self.id,
            field::TYPE: &self.event_type,
            field::PAYLOAD: self.payload.clone(),
        };
        if let (Some(key), Some(sequence)) = (&self.key, sequence) {
            document.insert(field::KEY, key);
            document.insert(field::SEQUENCE, sequence);
        }
        if !self.headers.is_empty() {
            let headers: Document =
                self.headers.iter().map(|(k, v)| (k.clone(), Bson::String(v.clone()))).collect();
            document.insert(field::HEADERS, headers);
        }
        if let Some(id) = &self.correlation_id {
            document.insert(field::CORRELATION_ID, id);
        }
        if let Some(id) = &self.causation_id {
            document.insert(field::CAUSATION_ID, id);
        }
        if let Some(priority) = self.priority {
            document.insert(field::PRIORITY, priority);
        }
        if self.chain_depth > 0 {
            document.insert(field::CHAIN_DEPTH, i64::from(self.chain_depth));
        }
        if let Some(budget) = self.chain_budget {
            document.insert(field::CHAIN_BUDGET, i64::from(budget));
        }
        document.insert(field::CREATED_AT, self.created_at.unwrap_or(now));
        document
    }
}

fn check_text(field: &'static str, value: &str, max: usize) -> Result<(), EventError> {
    if value.is_empty() {
        return Err(EventError::Empty { field });
    }
    let chars = value.chars().count();
    if chars > max {
        return Err(EventError::TooLong { field, chars, max });
    }
    if value.chars().any(char::is_control) {
        return Err(EventError::ControlCharacter { field });
    }
    Ok(())
}

/// Headers are metadata, not a second payload: bounded in number and size, named so that no
/// name can be read as an operator or a path (`$`, `.`), and, names and values, text without
/// control characters (no NUL, newline or escape sequence reaches a log line or a terminal).
fn check_headers<'a>(headers: impl Iterator<Item = (&'a str, &'a str)>, count: usize) -> Result<(), EventError> {
    if count > MAX_HEADERS {
        return Err(EventError::TooManyHeaders { count, max: MAX_HEADERS });
    }
    for (name, value) in headers {
        let shown = || format!("{:?}", name.chars().take(64).collect::<String>());
        let why = if name.is_empty() {
            Some("it is empty")
        } else if name.chars().count() > MAX_HEADER_NAME_CHARS {
            Some("it is longer than 128 characters")
        } else if name.chars().any(char::is_control) {
            Some("it contains a control character")
        } else if name.starts_with('$') || name.contains('.') {
            Some("it starts with `$` or contains `.`")
        } else {
            None
        };
        if let Some(why) = why {
            return Err(EventError::BadHeaderName { name: shown(), why });
        }
        if value.len() > MAX_HEADER_VALUE_BYTES {
            return Err(EventError::HeaderTooLong { name: shown(), bytes: value.len(), max: MAX_HEADER_VALUE_BYTES });
        }
        if value.chars().any(char::is_control) {
            return Err(EventError::HeaderValueControlCharacter { name: shown() });
        }
    }
    Ok(())
}

/// Refuses a stored event document too large to deliver ([`MAX_EVENT_DOCUMENT_BYTES`]).
pub fn check_document_size(doc: &Document) -> Result<(), EventError> {
    // Encoding it again costs about a microsecond for a usual event, at every fan-out read.
    let bytes = bson::to_vec(doc).map(|encoded| encoded.len()).unwrap_or(usize::MAX);
    if bytes > MAX_EVENT_DOCUMENT_BYTES {
        return Err(EventError::DocumentTooLarge { bytes, max: MAX_EVENT_DOCUMENT_BYTES });
    }
    Ok(())
}

/// A stored event that passed fan-out validation: what a handler receives.
#[derive(Debug, Clone, PartialEq)]
pub struct EventRecord {
    pub id: String,
    pub event_type: String,
    pub payload: Document,
    pub key: Option<String>,
    pub sequence: Option<i64>,
    pub headers: BTreeMap<String, String>,
    pub correlation_id: Option<String>,
    pub causation_id: Option<String>,
    pub priority: Option<i32>,
    pub chain_depth: u32,
    pub chain_budget: Option<u32>,
    pub created_at: DateTime,
}

/// `priority` if it is in [`PRIORITY_RANGE`].
fn priority_in_range(priority: i64) -> Result<i32, EventError> {
    if PRIORITY_RANGE.contains(&priority) { Ok(priority as i32) } else { Err(EventError::BadPriority(priority.to_string())) }
}

/// Describes a BSON value's type for error messages.
pub fn bson_type_name(value: &Bson) -> String {
    match value {
        Bson::Double(_) => "a double",
        Bson::String(_) => "a string",
        Bson::Array(_) => "an array",
        Bson::Document(_) => "a document",
        Bson::Boolean(_) => "a boolean",
        Bson::Null => "null",
        Bson::Int32(_) => "an int32",
        Bson::Int64(_) => "an int64",
        Bson::DateTime(_) => "a date",
        Bson::ObjectId(_) => "an ObjectId",
        Bson::Timestamp(_) => "a timestamp",
        Bson::Binary(_) => "binary data",
        Bson::Decimal128(_) => "a decimal128",
        _ => "an unsupported BSON type",
    }
    .to_string()
}

fn wrong(field: &'static str, expected: &'static str, value: &Bson) -> EventError {
    EventError::WrongType { field, expected, found: bson_type_name(value) }
}

fn optional_text(doc: &Document, field: &'static str, max: usize) -> Result<Option<String>, EventError> {
    match doc.get(field) {
        None | Some(Bson::Null) => Ok(None),
        Some(Bson::String(text)) => check_text(field, text, max).map(|()| Some(text.clone())),
        Some(other) => Err(wrong(field, "a string", other)),
    }
}

impl EventRecord {
    /// Parses a stored event document strictly. The error names the first bad field; the
    /// caller dead-letters such an event instead of delivering it.
    pub fn from_document(doc: &Document) -> Result<Self, EventError> {
        let id = match doc.get(field::ID) {
            Some(Bson::String(id)) => {
                check_text(field::ID, id, MAX_ID_CHARS)?;
                id.clone()
            }
            Some(other) => return Err(wrong(field::ID, "a string", other)),
            None => return Err(EventError::Missing { field: field::ID }),
        };
        let event_type = match doc.get(field::TYPE) {
            Some(Bson::String(t)) => {
                check_text(field::TYPE, t, MAX_TYPE_CHARS)?;
                t.clone()
            }
            Some(other) => return Err(wrong(field::TYPE, "a string", other)),
            None => return Err(EventError::Missing { field: field::TYPE }),
        };
        let payload = match doc.get(field::PAYLOAD) {
            Some(Bson::Document(payload)) => payload.clone(),
            Some(other) => return Err(wrong(field::PAYLOAD, "a document", other)),
            None => return Err(EventError::Missing { field: field::PAYLOAD }),
        };
        let key = optional_text(doc, field::KEY, MAX_KEY_CHARS)?;
        let sequence = match doc.get(field::SEQUENCE) {
            None | Some(Bson::Null) => None,
            Some(Bson::Int64(n)) => Some(*n),
            Some(Bson::Int32(n)) => Some(i64::from(*n)),
            Some(other) => return Err(wrong(field::SEQUENCE, "an integer", other)),
        };
        match (&key, sequence) {
            (Some(_), None) => return Err(EventError::KeyWithoutSequence),
            (None, Some(_)) => return Err(EventError::SequenceWithoutKey),
            (_, Some(n)) if n < 1 => return Err(EventError::BadSequence(n)),
            _ => {}
        }
        let mut headers = BTreeMap::new();
        match doc.get(field::HEADERS) {
            None | Some(Bson::Null) => {}
            Some(Bson::Document(map)) => {
                for (name, value) in map {
                    match value {
                        Bson::String(text) => {
                            headers.insert(name.clone(), text.clone());
                        }
                        other => return Err(wrong(field::HEADERS, "a document of strings", other)),
                    }
                }
            }
            Some(other) => return Err(wrong(field::HEADERS, "a document of strings", other)),
        }
        check_headers(headers.iter().map(|(name, value)| (name.as_str(), value.as_str())), headers.len())?;
        let correlation_id = optional_text(doc, field::CORRELATION_ID, MAX_ID_CHARS)?;
        let causation_id = optional_text(doc, field::CAUSATION_ID, MAX_ID_CHARS)?;
        let priority = match doc.get(field::PRIORITY) {
            None | Some(Bson::Null) => None,
            Some(Bson::Int32(n)) => Some(priority_in_range(i64::from(*n))?),
            Some(Bson::Int64(n)) => Some(priority_in_range(*n)?),
            Some(other) => return Err(EventError::BadPriority(bson_type_name(other))),
        };
        let chain_depth = match doc.get(field::CHAIN_DEPTH) {
            None | Some(Bson::Null) => 0,
            Some(Bson::Int32(n)) => u32::try_from(*n).map_err(|_| EventError::BadChainDepth(n.to_string()))?,
            Some(Bson::Int64(n)) => u32::try_from(*n).map_err(|_| EventError::BadChainDepth(n.to_string()))?,
            Some(other) => return Err(EventError::BadChainDepth(bson_type_name(other))),
        };
        let chain_budget = match doc.get(field::CHAIN_BUDGET) {
            None | Some(Bson::Null) => None,
            Some(Bson::Int32(n)) => Some(u32::try_from(*n).map_err(|_| EventError::BadChainBudget(n.to_string()))?),
            Some(Bson::Int64(n)) => Some(u32::try_from(*n).map_err(|_| EventError::BadChainBudget(n.to_string()))?),
            Some(other) => return Err(EventError::BadChainBudget(bson_type_name(other))),
        };
        let created_at = match doc.get(field::CREATED_AT) {
            Some(Bson::DateTime(at)) => *at,
            Some(other) => return Err(wrong(field::CREATED_AT, "a date", other)),
            None => return Err(EventError::Missing { field: field::CREATED_AT }),
        };
        Ok(Self {
            id,
            event_type,
            payload,
            key,
            sequence,
            headers,
            correlation_id,
            causation_id,
            priority,
            chain_depth,
            chain_budget,
            created_at,
        })
    }
}

/// The readable string key of a raw event document, if any.
pub(crate) fn string_key(doc: &Document) -> Option<&str> {
    match doc.get(field::KEY) {
        Some(Bson::String(key)) => Some(key),
        _ => None,
    }
}

/// A printable id for any `_id` (string ids stay as they are).
pub(crate) fn id_text(id: &Bson) -> String {
    match id {
        Bson::String(text) => text.clone(),
        other => other.clone().into_relaxed_extjson().to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored() -> Document {
        NewEvent::new("e-1", "order.placed", doc! { "orderId": "o-1" })
            .with_key("o-1")
            .with_header("traceparent", "00-abc")
            .to_document(Some(3), DateTime::from_millis(1_000))
    }

    #[test]
    fn a_published_document_parses_back() {
        let record = EventRecord::from_document(&stored()).unwrap();
        assert_eq!(record.id, "e-1");
        assert_eq!(record.key.as_deref(), Some("o-1"));
        assert_eq!(record.sequence, Some(3));
        assert_eq!(record.headers["traceparent"], "00-abc");
        assert_eq!(record.created_at, DateTime::from_millis(1_000));
    }

    #[test]
    fn malformed_documents_name_the_field() {
        let cases: Vec<(Box<dyn Fn(&mut Document)>, &str)> = vec![
            (Box::new(|d| {
                d.remove("type");
            }), "`type` is missing"),
            (Box::new(|d| {
                d.insert("type", 7);
            }), "`type` must be a string, found an int32"),
            (Box::new(|d| {
                d.insert("payload", "text");
            }), "`payload` must be a document, found a string"),
            (Box::new(|d| {
                d.remove("sequence");
            }), "`sequence` is missing"),
            (Box::new(|d| {
                d.insert("sequence", 0_i64);
            }), "positive integer"),
            (Box::new(|d| {
                d.insert("headers", doc! { "a": 1 });
            }), "`headers` must be a document of strings"),
            (Box::new(|d| {
                d.insert("createdAt", "yesterday");
            }), "`createdAt` must be a date"),
            (Box::new(|d| {
                d.insert("_id", bson::oid::ObjectId::new());
            }), "`_id` must be a string, found an ObjectId"),
            (Box::new(|d| {
                d.insert("headers", doc! { "$where": "x" });
            }), "header name \"$where\" is not allowed"),
            (Box::new(|d| {
                d.insert("chainDepth", -1);
            }), "`chainDepth` must be a non-negative integer"),
        ];
        for (mutate, expected) in cases {
            let mut document = stored();
            mutate(&mut document);
            let error = EventRecord::from_document(&document).unwrap_err().to_string();
            assert!(error.contains(expected), "{error:?} should contain {expected:?}");
        }
    }

    #[test]
    fn a_stored_document_too_large_to_mark_is_refused_by_size() {
        let mut document = stored();
        assert!(check_document_size(&document).is_ok());
        document.insert("payload", doc! { "blob": bson::Binary { subtype: bson::spec::BinarySubtype::Generic, bytes: vec![0; MAX_EVENT_DOCUMENT_BYTES] } });
        let error = check_document_size(&document).unwrap_err().to_string();
        assert!(error.contains("the limit is 15728640"), "{error}");
    }

    #[test]
    fn chain_depth_is_stored_only_when_not_zero() {
        let mut event = NewEvent::new("e", "t", doc! {});
        assert!(!event.to_document(None, DateTime::now()).contains_key("chainDepth"));
        event.chain_depth = 3;
        let record = EventRecord::from_document(&event.to_document(None, DateTime::now())).unwrap();
        assert_eq!(record.chain_depth, 3);
    }

    #[test]
    fn a_priority_is_an_integer_from_minus_1000_to_1000_stored_only_when_given() {
        assert!(!NewEvent::new("e", "t", doc! {}).to_document(None, DateTime::now()).contains_key("priority"));
        let urgent = NewEvent::new("e", "t", doc! {}).with_priority(-1000);
        assert_eq!(urgent.validate(1024), Ok(()));
        assert_eq!(EventRecord::from_document(&urgent.to_document(None, DateTime::now())).unwrap().priority, Some(-1000));
        let error = NewEvent::new("e", "t", doc! {}).with_priority(1001).validate(1024).unwrap_err().to_string();
        assert!(error.contains("`priority` must be an integer from -1000 to 1000, found 1001"), "{error}");
        // Other drivers' documents: an int64 in range is read, the rest named.
        for (value, expected) in [(Bson::Int64(7), Ok(Some(7))), (Bson::Int64(5000), Err("found 5000")), (Bson::String("high".into()), Err("found a string"))] {
            let mut document = urgent.to_document(None, DateTime::now());
            document.insert("priority", value);
            match (EventRecord::from_document(&document), expected) {
                (Ok(record), Ok(priority)) => assert_eq!(record.priority, priority),
                (Err(error), Err(named)) => assert!(error.to_string().contains(named), "{error}"),
                (got, wanted) => panic!("{got:?} where {wanted:?} was expected"),
            }
        }
    }

    #[test]
    fn validation_bounds_text_and_payload() {
        let long = "x".repeat(MAX_ID_CHARS + 1);
        assert!(matches!(
            NewEvent::new(long, "t", doc! {}).validate(1024),
            Err(EventError::TooLong { field: "_id", .. })
        ));
        assert!(matches!(NewEvent::new("", "t", doc! {}).validate(1024), Err(EventError::Empty { .. })));
        assert!(matches!(
            NewEvent::new("e", "t\n", doc! {}).validate(1024),
            Err(EventError::ControlCharacter { field: "type" })
        ));
        let mut headers = NewEvent::new("e", "t", doc! {});
        for n in 0..=MAX_HEADERS {
            headers = headers.with_header(format!("h{n}"), "v");
        }
        assert!(matches!(headers.validate(1024), Err(EventError::TooManyHeaders { count: 65, max: 64 })));
        for (name, why) in [("$set", "`$`"), ("a.b", "`.`"), ("a\nb", "control"), ("", "empty")] {
            let error = NewEvent::new("e", "t", doc! {}).with_header(name, "v").validate(1024).unwrap_err().to_string();
            assert!(error.contains(why), "{error}");
        }
        let long_value = NewEvent::new("e", "t", doc! {}).with_header("trace", "v".repeat(MAX_HEADER_VALUE_BYTES + 1));
        assert!(matches!(long_value.validate(1024), Err(EventError::HeaderTooLong { .. })));
        for value in ["a\0b", "line\nbreak", "\u{1b}[2J", "cr\r", "tab\t"] {
            let error = NewEvent::new("e", "t", doc! {}).with_header("trace", value).validate(1024).unwrap_err();
            assert!(matches!(error, EventError::HeaderValueControlCharacter { .. }), "{value:?}: {error}");
        }
        let big = NewEvent::new("e", "t", doc! { "blob": "y".repeat(2048) });
        assert!(matches!(big.validate(1024), Err(EventError::PayloadTooLarge { max: 1024, .. })));
        assert!(big.validate(DEFAULT_MAX_PAYLOAD_BYTES).is_ok());
    }
}
