//! A handler's collections in MongoDB: each call one statement in the delivery's session, so
//! that the handler's writes commit with its completion. The server aborts the transaction
//! after a call it refused, which is what the [`HandlerDocuments`] contract asks. It never
//! commits; it reads a `find` one small batch at a time so that the host holds at most one
//! batch beyond what the plugin may be handed.

use bson::{Bson, Document};
use futures::TryStreamExt;

use super::MongoTx;
use crate::store::StoreError;
use crate::store::handler_documents::{Found, HandlerDocuments, Update, take_within};

impl HandlerDocuments for MongoTx {
    async fn insert_document(&mut self, collection: &str, document: Document) -> Result<Bson, StoreError> {
        let result = self.database.collection::<Document>(collection).insert_one(document).session(&mut self.session).await?;
        Ok(result.inserted_id)
    }

    async fn update_documents(&mut self, collection: &str, filter: Document, update: Update) -> Result<u64, StoreError> {
        let update: mongodb::options::UpdateModifications = match update {
            Update::Document(document) => document.into(),
            Update::Pipeline(stages) => stages.into(),
        };
        let result = self.database.collection::<Document>(collection).update_many(filter, update).session(&mut self.session).await?;
        Ok(result.matched_count)
    }

    async fn delete_documents(&mut self, collection: &str, filter: Document) -> Result<u64, StoreError> {
        let result = self.database.collection::<Document>(collection).delete_many(filter).session(&mut self.session).await?;
        Ok(result.deleted_count)
    }

    async fn find_documents(&mut self, collection: &str, filter: Document, limit: u32, max_bytes: usize) -> Result<Found, StoreError> {
        let mut cursor = self
            .database
            .collection::<Document>(collection)
            .find(filter)
            .limit(i64::from(limit.clamp(1, 1_000)))
            .batch_size(16)
            .session(&mut self.session)
            .await?;
        let (mut found, mut bytes) = (Vec::new(), 0_usize);
        let mut stream = cursor.stream(&mut self.session);
        while let Some(document) = stream.try_next().await? {
            if !take_within(&mut found, &mut bytes, document, max_bytes) {
                return Ok(Found::TooLarge);
            }
        }
        Ok(Found::Documents(found))
    }
}
