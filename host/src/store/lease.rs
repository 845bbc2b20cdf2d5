//! Lease tokens: the fence every change to a claimed delivery must pass.
//!
//! A token is `<laneId>:<epoch>:<claims>`: the lane's lease epoch when the delivery was
//! claimed and the delivery's claim generation. The generation grows whenever a claim ends
//! (retry, release, burial, lost lease), so an old lease never matches a newer claim, even by
//! the same owner in the same lane epoch.

use std::fmt;
use std::str::FromStr;

use bson::oid::ObjectId;

use super::{DeliveryId, StoreError};
use crate::lane::LaneId;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Lease {
    pub delivery: DeliveryId,
    pub lane: LaneId,
    pub epoch: i64,
    pub claims: i64,
}

impl Lease {
    /// The `<laneId>:<epoch>:<claims>` part.
    pub fn token(&self) -> String {
        format!("{}:{}:{}", self.lane, self.epoch, self.claims)
    }

    /// Parses `<deliveryId>@<laneId>:<epoch>:<claims>` (the [`fmt::Display`] form). A token no
    /// store can have issued (lane out of range, epoch below 1, negative generation) is refused.
    pub fn parse(text: &str) -> Result<Self, StoreError> {
        let bad = || StoreError::InvalidArgument(format!("{text:?} is not a lease (<delivery>@<lane>:<epoch>:<claims>)"));
        let (delivery, token) = text.split_once('@').ok_or_else(bad)?;
        let delivery = ObjectId::parse_str(delivery).map_err(|_| bad())?;
        let mut parts = token.split(':');
        let (Some(lane), Some(epoch), Some(claims), None) = (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(bad());
        };
        let lane = LaneId::from_str(lane).map_err(|_| bad())?;
        let epoch = i64::from_str(epoch).map_err(|_| bad())?;
        let claims = i64::from_str(claims).map_err(|_| bad())?;
        if epoch < 1 || claims < 0 {
            return Err(bad());
        }
        Ok(Self { delivery, lane, epoch, claims })
    }
}

impl fmt::Display for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.delivery.to_hex(), self.token())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn display_and_parse_round_trip(lane in any::<u8>(), epoch in 1..i64::MAX, claims in 0..i64::MAX) {
            let lease = Lease { delivery: ObjectId::new(), lane, epoch, claims };
            prop_assert_eq!(Lease::parse(&lease.to_string()).unwrap(), lease);
        }

        #[test]
        fn parse_never_panics(text in ".{0,80}") {
            let _ = Lease::parse(&text);
        }
    }

    #[test]
    fn tokens_no_store_issues_are_refused() {
        let id = ObjectId::new().to_hex();
        for bad in [format!("{id}@256:1:0"), format!("{id}@1:0:0"), format!("{id}@1:1:-1"), format!("{id}@1:1"), "x@1:1:1".into()] {
            assert!(Lease::parse(&bad).is_err(), "{bad}");
        }
        assert_eq!(Lease::parse(&format!("{id}@7:3:2")).unwrap().token(), "7:3:2");
    }
}
