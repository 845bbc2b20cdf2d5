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
    pub const CREATED_AT: &str = "createdAt";
    /// Written by the host at fan-out; absent until then.
    pub const FANNED_OUT_AT: &str = "fannedOutAt";
    /// Every handler the event ever had a delivery for, completed ones included.
    pub const HANDLERS: &str = "handlers";
    /// The time of the latest completion of any of its deliveries.
    pub const COMPLETED_AT: &str = "completedAt";
    /// Handlers whose delivery of it its fan-out handed out without writing a document for
    /// it (MongoDB); each leaves the list when that delivery completes or gets its document.
    pub const HANDED_OUT: &str = "handedOut";
    /// The fan-out that marked it, when that mark was no transaction (MongoDB): racing
    /// fan-outs tell by it which events each marked.
    pub const FAN_OUT: &str = "fanOut";
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
            created_at: None,
        }
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
    pub created_at: DateTime,
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
        let correlation_id = optional_text(doc, field::CORRELATION_ID, MAX_ID_CHARS)?;
        let causation_id = optional_text(doc, field::CAUSATION_ID, MAX_ID_CHARS)?;
        let created_at = match doc.get(field::CREATED_AT) {
            Some(Bson::DateTime(at)) => *at,
            Some(other) => return Err(wrong(field::CREATED_AT, "a date", other)),
            None => return Err(EventError::Missing { field: field::CREATED_AT }),
        };
        Ok(Self { id, event_type, payload, key, sequence, headers, correlation_id, causation_id, created_at })
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
        ];
        for (mutate, expected) in cases {
            let mut document = stored();
            mutate(&mut document);
            let error = EventRecord::from_document(&document).unwrap_err().to_string();
            assert!(error.contains(expected), "{error:?} should contain {expected:?}");
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
        let big = NewEvent::new("e", "t", doc! { "blob": "y".repeat(2048) });
        assert!(matches!(big.validate(1024), Err(EventError::PayloadTooLarge { max: 1024, .. })));
        assert!(big.validate(DEFAULT_MAX_PAYLOAD_BYTES).is_ok());
    }
}
