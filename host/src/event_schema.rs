//! Event schemas: a JSON Schema per event type (`[schemas]` in the configuration), compiled
//! once with the `jsonschema` crate, that an event's payload must match. Publishers that
//! know them (`relayhost publish`, a Rust [`crate::publish::Publisher`] given them) refuse an
//! invalid payload; a fan-out makes an invalid event that another driver published dead for
//! every handler, the failing path in the reason. It owns loading and checking; it never
//! writes anything.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bson::{Bson, Document};

/// The schemas of the event types that have one. Clones share them.
#[derive(Clone, Default)]
pub struct Schemas {
    by_type: Arc<BTreeMap<String, (PathBuf, jsonschema::Validator)>>,
}

impl std::fmt::Debug for Schemas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.by_type.iter().map(|(event_type, (path, _))| (event_type, path))).finish()
    }
}

/// The schemas in force while a host runs: a reload of its configuration replaces them, and
/// readers take the set in force at each use. Clones share it.
#[derive(Debug, Clone, Default)]
pub struct SchemaSource(Arc<std::sync::RwLock<Schemas>>);

impl SchemaSource {
    pub fn new(schemas: Schemas) -> Self {
        Self(Arc::new(std::sync::RwLock::new(schemas)))
    }

    /// The schemas in force.
    pub fn current(&self) -> Schemas {
        self.0.read().expect("schemas").clone()
    }

    /// Puts `schemas` in force.
    pub fn replace(&self, schemas: Schemas) {
        *self.0.write().expect("schemas") = schemas;
    }
}

/// Two sets of schemas are the same when they are the same load (or both empty).
impl PartialEq for Schemas {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.by_type, &other.by_type) || (self.is_empty() && other.is_empty())
    }
}

impl Eq for Schemas {}

impl Schemas {
    /// Reads and compiles each schema file, by event type; an error names the file and why.
    pub fn load(files: &BTreeMap<String, PathBuf>) -> Result<Self, String> {
        let mut by_type = BTreeMap::new();
        for (event_type, path) in files {
            by_type.insert(event_type.clone(), (path.clone(), compile(path)?));
        }
        Ok(Self { by_type: Arc::new(by_type) })
    }

    /// Whether no event type has a schema.
    pub fn is_empty(&self) -> bool {
        self.by_type.is_empty()
    }

    /// Why `payload` does not match the schema of `event_type`: the failing path (a JSON
    /// pointer into the payload) and the rule it breaks; `Ok` without a schema.
    pub fn check(&self, event_type: &str, payload: &Document) -> Result<(), String> {
        let Some((path, validator)) = self.by_type.get(event_type) else { return Ok(()) };
        let instance = Bson::Document(payload.clone()).into_relaxed_extjson();
        validator.validate(&instance).map_err(|error| {
            let at = error.instance_path().to_string();
            let at = if at.is_empty() { "/".to_string() } else { at };
            format!("the payload does not match the schema of {event_type:?} ({}): at {at}: {error}", path.display())
        })
    }
}

fn compile(path: &Path) -> Result<jsonschema::Validator, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("schema {}: {e}", path.display()))?;
    let schema: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("schema {} is not JSON: {e}", path.display()))?;
    jsonschema::validator_for(&schema).map_err(|e| format!("schema {} is not a valid JSON Schema: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use bson::doc;

    use super::*;

    #[test]
    fn a_payload_is_checked_against_its_types_schema_naming_the_failing_path() {
        let dir = std::env::temp_dir().join(format!("relayhost-schemas-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("order.json");
        std::fs::write(&file, r#"{"type": "object", "required": ["orderId"], "properties": {"total": {"type": "number", "minimum": 0}}}"#).unwrap();
        let schemas = Schemas::load(&BTreeMap::from([("order.placed".to_string(), file.clone())])).unwrap();
        assert_eq!(schemas.check("order.placed", &doc! { "orderId": "o-1", "total": 5 }), Ok(()));
        assert_eq!(schemas.check("other", &doc! {}), Ok(()), "a type without a schema takes anything");
        let negative = schemas.check("order.placed", &doc! { "orderId": "o-1", "total": -5 }).unwrap_err();
        assert!(negative.contains("at /total:") && negative.contains("minimum"), "{negative}");
        let missing = schemas.check("order.placed", &doc! { "total": 5 }).unwrap_err();
        assert!(missing.contains("at /:") && missing.contains("orderId"), "{missing}");
        std::fs::write(dir.join("broken.json"), "{not json").unwrap();
        let error = Schemas::load(&BTreeMap::from([("t".to_string(), dir.join("broken.json"))])).unwrap_err();
        assert!(error.contains("broken.json is not JSON"), "{error}");
        std::fs::write(dir.join("wrong.json"), r#"{"type": 12}"#).unwrap();
        let error = Schemas::load(&BTreeMap::from([("t".to_string(), dir.join("wrong.json"))])).unwrap_err();
        assert!(error.contains("wrong.json is not a valid JSON Schema"), "{error}");
        let error = Schemas::load(&BTreeMap::from([("t".to_string(), dir.join("absent.json"))])).unwrap_err();
        assert!(error.contains("absent.json"), "{error}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
