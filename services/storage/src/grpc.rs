//! The gRPC face of a [`MessageStore`]: `imdedup.v1.StorageService`.

use std::sync::Arc;

use imdedup_core::{convert, store::Insert, store::MessageStore};
use imdedup_proto::v1::{
    self as pb,
    storage_service_server::{StorageService, StorageServiceServer},
};
use tonic::{Request, Response, Status};

/// Storage accepts bodies up to this size; the gateway and ingest enforce the
/// smaller configured limit that phones see.
pub const MAX_STORED_BODY_BYTES: usize = 1 << 20;

/// Serves any [`MessageStore`] over gRPC.
pub struct StorageGrpc {
    store: Arc<dyn MessageStore>,
}

impl StorageGrpc {
    pub fn new(store: Arc<dyn MessageStore>) -> Self {
        Self { store }
    }

    pub fn into_server(self) -> StorageServiceServer<Self> {
        StorageServiceServer::new(self).max_decoding_message_size(2 * MAX_STORED_BODY_BYTES)
    }
}

#[tonic::async_trait]
impl StorageService for StorageGrpc {
    async fn insert_once(
        &self,
        request: Request<pb::InsertOnceRequest>,
    ) -> Result<Response<pb::InsertOnceResponse>, Status> {
        let request = request.into_inner();
        let store_copy = request.store_copy;
        let message = convert::insert_request(request, MAX_STORED_BODY_BYTES)?;
        if store_copy {
            let row = self.store.insert_copy(message).await?;
            return Ok(Response::new(pb::InsertOnceResponse {
                inserted: true,
                message: Some(row.into()),
            }));
        }
        let (inserted, row) = match self.store.insert_once(message).await? {
            Insert::Stored(row) => (true, row),
            Insert::AlreadyStored(row) => (false, row),
        };
        Ok(Response::new(pb::InsertOnceResponse {
            inserted,
            message: Some(row.into()),
        }))
    }

    async fn lookup(
        &self,
        request: Request<pb::LookupRequest>,
    ) -> Result<Response<pb::LookupResponse>, Status> {
        let req = request.into_inner();
        let key = convert::message_key(req.sender, req.client_msg_id)?;
        let message = self.store.lookup(&key).await?.map(Into::into);
        Ok(Response::new(pb::LookupResponse { message }))
    }

    async fn history(
        &self,
        request: Request<pb::HistoryRequest>,
    ) -> Result<Response<pb::HistoryResponse>, Status> {
        let query = convert::history_request(request.into_inner())?;
        let messages = self
            .store
            .history(&query)
            .await?
            .into_iter()
            .map(Into::into)
            .collect();
        Ok(Response::new(pb::HistoryResponse { messages }))
    }
}
