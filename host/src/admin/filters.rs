//! The filters an operator types, on the command line (`--handler ...`) or in the admin API
//! (`?handler=...`, or a JSON body), and what they become: a [`DeliveryFilter`] whose every
//! value is a literal, or an error naming the filter.

use bson::DateTime;
use serde::Deserialize;

use crate::store::{DeliveryFilter, Listed};

/// Deliveries by state, handler, event type, key, event id and age.
#[derive(Debug, Clone, Default, Deserialize, clap::Args)]
#[serde(default)]
pub struct Filters {
    /// pending (unfinished), running (listed by a live lease), parked or dead.
    #[arg(long)]
    pub status: Option<String>,
    #[arg(long)]
    pub handler: Option<String>,
    /// The event type.
    #[arg(long = "type")]
    #[serde(rename = "type")]
    pub event_type: Option<String>,
    #[arg(long)]
    pub key: Option<String>,
    /// The event id.
    #[arg(long)]
    pub event: Option<String>,
    /// Created longer ago than this (`10m`, `2h`, `3d`).
    #[arg(long)]
    pub older_than: Option<String>,
}

impl Filters {
    /// The store's filter, narrowed to `status` (or `default` when none is given).
    pub fn filter(&self, default: Option<Listed>) -> Result<DeliveryFilter, String> {
        let created_before = match &self.older_than {
            Some(age) => {
                let age = humantime::parse_duration(age).map_err(|e| format!("older_than {age:?} is not a duration like 10m: {e}"))?;
                Some(DateTime::from_millis(DateTime::now().timestamp_millis().saturating_sub(age.as_millis() as i64)))
            }
            None => None,
        };
        let filter = DeliveryFilter {
            handler: self.handler.clone(),
            event_type: self.event_type.clone(),
            key: self.key.clone(),
            event_id: self.event.clone(),
            created_before,
            ..DeliveryFilter::default()
        };
        let status = self.status.as_deref().map(Listed::parse).transpose()?.or(default);
        Ok(match status {
            Some(status) => status.narrow(filter),
            None => filter,
        })
    }

    /// The status asked for, if it is one.
    pub fn status(&self) -> Option<Listed> {
        self.status.as_deref().and_then(|status| Listed::parse(status).ok())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_become_literals_or_name_what_is_wrong() {
        let filters = Filters { status: Some("parked".into()), key: Some("{\"$gt\": \"\"}".into()), ..Filters::default() };
        let filter = filters.filter(None).unwrap();
        assert_eq!((filter.parked, filter.key.as_deref()), (Some(true), Some("{\"$gt\": \"\"}")));
        assert!(Filters { status: Some("stuck".into()), ..Filters::default() }.filter(None).unwrap_err().contains("none of pending"));
        assert!(Filters { older_than: Some("soon".into()), ..Filters::default() }.filter(None).unwrap_err().contains("older_than"));
        assert_eq!(Filters::default().filter(Some(Listed::Dead)).unwrap().status, Some(crate::store::DeliveryStatus::Dead));
    }
}
