//! The part of MongoDB's query and update language the memory store applies to handlers'
//! collections: what plugin tests need, each operator as MongoDB means it, and a clear refusal
//! naming any other (test that handler on MongoDB). Pure: it reads and changes documents it is
//! given, nothing else.
//!
//! Filters: equality (an array field matches when an element equals), dotted paths, `$eq`,
//! `$ne`, `$gt`, `$gte`, `$lt`, `$lte`, `$in`, `$nin`, `$exists`, and `$and`, `$or`, `$nor`.
//! Updates: a replacement document, or `$set`, `$unset`, `$inc`, `$push`, `$setOnInsert`
//! (no upserts here, so it does nothing). Comparisons compare numbers with numbers, strings with
//! strings and dates with dates; values of other types never compare (MongoDB's type bracketing).

use std::cmp::Ordering;

use bson::{Bson, Document};

/// Whether `document` matches `filter`.
pub(super) fn matches(document: &Document, filter: &Document) -> Result<bool, String> {
    for (key, condition) in filter {
        let holds = match key.as_str() {
            "$and" => clauses(key, condition)?.iter().map(|clause| matches(document, clause)).collect::<Result<Vec<_>, _>>()?.into_iter().all(|m| m),
            "$or" => clauses(key, condition)?.iter().map(|clause| matches(document, clause)).collect::<Result<Vec<_>, _>>()?.into_iter().any(|m| m),
            "$nor" => !clauses(key, condition)?.iter().map(|clause| matches(document, clause)).collect::<Result<Vec<_>, _>>()?.into_iter().any(|m| m),
            operator if operator.starts_with('$') => return Err(unsupported(operator)),
            path => field_matches(lookup(document, path), condition)?,
        };
        if !holds {
            return Ok(false);
        }
    }
    Ok(true)
}

fn clauses<'a>(operator: &str, condition: &'a Bson) -> Result<Vec<&'a Document>, String> {
    match condition {
        Bson::Array(items) if !items.is_empty() => items
            .iter()
            .map(|item| item.as_document().ok_or_else(|| format!("every clause of `{operator}` must be an object")))
            .collect(),
        _ => Err(format!("`{operator}` takes a non-empty array of filters")),
    }
}

fn unsupported(operator: &str) -> String {
    format!("`{operator}` is not supported by the memory store (test this handler on MongoDB)")
}

/// The value at a dotted `path`, if any (not through arrays).
fn lookup<'a>(document: &'a Document, path: &str) -> Option<&'a Bson> {
    let mut parts = path.split('.');
    let mut value = document.get(parts.next()?)?;
    for part in parts {
        value = match value {
            Bson::Document(inner) => inner.get(part)?,
            Bson::Array(items) => items.get(part.parse::<usize>().ok()?)?,
            _ => return None,
        };
    }
    Some(value)
}

fn field_matches(value: Option<&Bson>, condition: &Bson) -> Result<bool, String> {
    let operators = match condition {
        Bson::Document(operators) if operators.keys().next().is_some_and(|key| key.starts_with('$')) => operators,
        _ => return Ok(equals(value, condition)),
    };
    for (operator, operand) in operators {
        let holds = match operator.as_str() {
            "$eq" => equals(value, operand),
            "$ne" => !equals(value, operand),
            "$gt" => compares(value, operand, |o| o == Ordering::Greater),
            "$gte" => compares(value, operand, |o| o != Ordering::Less),
            "$lt" => compares(value, operand, |o| o == Ordering::Less),
            "$lte" => compares(value, operand, |o| o != Ordering::Greater),
            "$in" => members(operator, operand)?.iter().any(|member| equals(value, member)),
            "$nin" => !members(operator, operand)?.iter().any(|member| equals(value, member)),
            "$exists" => value.is_some() == truthy(operand),
            other => return Err(unsupported(other)),
        };
        if !holds {
            return Ok(false);
        }
    }
    Ok(true)
}

fn members<'a>(operator: &str, operand: &'a Bson) -> Result<&'a Vec<Bson>, String> {
    operand.as_array().ok_or_else(|| format!("`{operator}` takes an array"))
}

fn truthy(value: &Bson) -> bool {
    !matches!(value, Bson::Boolean(false) | Bson::Null) && number(value) != Some(0.0)
}

/// Equality as a filter means it: a missing field equals null, and an array field equals a
/// value any of its elements equals.
fn equals(value: Option<&Bson>, expected: &Bson) -> bool {
    match value {
        None => matches!(expected, Bson::Null),
        Some(Bson::Array(items)) if !matches!(expected, Bson::Array(_)) => items.iter().any(|item| same(item, expected)),
        Some(value) => same(value, expected),
    }
}

fn same(a: &Bson, b: &Bson) -> bool {
    match (number(a), number(b)) {
        (Some(a), Some(b)) => a == b,
        _ => a == b,
    }
}

fn number(value: &Bson) -> Option<f64> {
    match value {
        Bson::Int32(n) => Some(f64::from(*n)),
        Bson::Int64(n) => Some(*n as f64),
        Bson::Double(n) => Some(*n),
        _ => None,
    }
}

fn compares(value: Option<&Bson>, operand: &Bson, holds: impl Fn(Ordering) -> bool) -> bool {
    let order = |value: &Bson| match (value, operand) {
        (Bson::String(a), Bson::String(b)) => Some(a.cmp(b)),
        (Bson::DateTime(a), Bson::DateTime(b)) => Some(a.cmp(b)),
        (a, b) => number(a)?.partial_cmp(&number(b)?),
    };
    match value {
        Some(Bson::Array(items)) => items.iter().any(|item| order(item).is_some_and(&holds)),
        Some(value) => order(value).is_some_and(holds),
        None => false,
    }
}

/// Applies `update` (modifications, or a replacement keeping the `_id`) to `document`.
pub(super) fn apply(document: &mut Document, update: &Document) -> Result<(), String> {
    if !update.keys().any(|key| key.starts_with('$')) {
        let id = document.get("_id").cloned();
        *document = update.clone();
        if let Some(id) = id {
            document.insert("_id", id);
        }
        return Ok(());
    }
    for (operator, fields) in update {
        let fields = fields.as_document().ok_or_else(|| format!("`{operator}` takes an object of fields"))?;
        for (path, value) in fields {
            if path == "_id" || path.starts_with("_id.") {
                return Err(format!("`{operator}` may not change `_id`"));
            }
            match operator.as_str() {
                "$set" => set(document, path, value.clone())?,
                "$unset" => unset(document, path),
                "$inc" => {
                    let sum = increment(lookup(document, path), value).ok_or_else(|| format!("`$inc` of {path} needs numbers"))?;
                    set(document, path, sum)?;
                }
                "$push" => match lookup(document, path).cloned() {
                    None => set(document, path, Bson::Array(vec![value.clone()]))?,
                    Some(Bson::Array(mut items)) => {
                        items.push(value.clone());
                        set(document, path, Bson::Array(items))?;
                    }
                    Some(_) => return Err(format!("`$push` to {path}: it is not an array")),
                },
                "$setOnInsert" => {}
                other => return Err(unsupported(other)),
            }
        }
    }
    Ok(())
}

/// `current` plus `by`, keeping integers integers (32 bits while both are and it fits).
fn increment(current: Option<&Bson>, by: &Bson) -> Option<Bson> {
    let integer = |value: &Bson| match value {
        Bson::Int32(n) => Some(i64::from(*n)),
        Bson::Int64(n) => Some(*n),
        _ => None,
    };
    number(by)?;
    let Some(current) = current else { return Some(by.clone()) };
    match (current, by) {
        (Bson::Int32(a), Bson::Int32(b)) => Some(a.checked_add(*b).map_or(Bson::Int64(i64::from(*a) + i64::from(*b)), Bson::Int32)),
        (a, b) if integer(a).is_some() && integer(b).is_some() => Some(Bson::Int64(integer(a)?.checked_add(integer(b)?)?)),
        (a, b) => Some(Bson::Double(number(a)? + number(b)?)),
    }
}

fn set(document: &mut Document, path: &str, value: Bson) -> Result<(), String> {
    match path.split_once('.') {
        None => {
            document.insert(path, value);
            Ok(())
        }
        Some((head, rest)) => {
            let inner = document.entry(head.to_string()).or_insert_with(|| Bson::Document(Document::new()));
            match inner {
                Bson::Document(inner) => set(inner, rest, value),
                _ => Err(format!("cannot set {path}: {head} is not an object")),
            }
        }
    }
}

fn unset(document: &mut Document, path: &str) {
    match path.split_once('.') {
        None => {
            document.remove(path);
        }
        Some((head, rest)) => {
            if let Some(Bson::Document(inner)) = document.get_mut(head) {
                unset(inner, rest);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use bson::doc;

    use super::*;

    #[test]
    fn filters_match_as_mongodb_means_them() {
        let order = doc! { "_id": "o-1", "total": 42, "status": "paid", "tags": ["a", "b"], "customer": { "id": "c-1" } };
        for (filter, expected) in [
            (doc! {}, true),
            (doc! { "status": "paid" }, true),
            (doc! { "total": 42.0 }, true),
            (doc! { "tags": "b" }, true),
            (doc! { "customer.id": "c-1" }, true),
            (doc! { "missing": null }, true),
            (doc! { "total": { "$gt": 40, "$lte": 42 } }, true),
            (doc! { "total": { "$gt": "40" } }, false),
            (doc! { "status": { "$in": ["new", "paid"] } }, true),
            (doc! { "status": { "$nin": ["paid"] } }, false),
            (doc! { "missing": { "$exists": false } }, true),
            (doc! { "$or": [{ "status": "new" }, { "total": 42 }] }, true),
            (doc! { "$and": [{ "status": "paid" }, { "total": 41 }] }, false),
            (doc! { "$nor": [{ "status": "new" }] }, true),
            (doc! { "status": { "$ne": "paid" } }, false),
        ] {
            assert_eq!(matches(&order, &filter), Ok(expected), "{filter}");
        }
        let refused = matches(&order, &doc! { "status": { "$regex": "p" } }).unwrap_err();
        assert!(refused.contains("`$regex` is not supported by the memory store"), "{refused}");
        assert!(matches(&order, &doc! { "$text": { "$search": "x" } }).unwrap_err().contains("`$text`"));
    }

    #[test]
    fn updates_apply_as_mongodb_applies_them() {
        let mut order = doc! { "_id": "o-1", "total": 40, "lines": ["a"] };
        apply(&mut order, &doc! { "$set": { "status": "paid", "customer.id": "c-1" }, "$inc": { "total": 2, "count": 1 }, "$push": { "lines": "b" } })
            .unwrap();
        assert_eq!(order, doc! { "_id": "o-1", "total": 42, "lines": ["a", "b"], "status": "paid", "customer": { "id": "c-1" }, "count": 1 });
        apply(&mut order, &doc! { "$unset": { "customer.id": "" } }).unwrap();
        assert_eq!(order.get_document("customer").unwrap(), &doc! {});
        apply(&mut order, &doc! { "replaced": true }).unwrap();
        assert_eq!(order, doc! { "replaced": true, "_id": "o-1" });
        assert!(apply(&mut order, &doc! { "$rename": { "a": "b" } }).unwrap_err().contains("`$rename` is not supported"));
        assert!(apply(&mut order, &doc! { "$set": { "_id": "other" } }).unwrap_err().contains("may not change `_id`"));
    }
}
