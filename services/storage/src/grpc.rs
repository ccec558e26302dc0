//! The gRPC face of a [`MessageStore`]: `imdedup.v1.StorageService`.

use std::{pin::Pin, sync::Arc};

use futures_util::{Stream, stream::FuturesUnordered};
use imdedup_core::{Error, convert, store::Insert, store::MessageStore, telemetry};
use imdedup_proto::v1::{
    self as pb, insert_result,
    storage_service_server::{StorageService, StorageServiceServer},
};
use tonic::{Request, Response, Status};
use tracing::Instrument;

/// Storage accepts bodies up to this size; the gateway and ingest enforce the
/// smaller configured limit that phones see.
pub const MAX_STORED_BODY_BYTES: usize = 1 << 20;

/// Most inserts one `InsertBatch` call may carry.
pub const MAX_BATCH: usize = 1024;

/// Serves any [`MessageStore`] over gRPC.
pub struct StorageGrpc {
    store: Arc<dyn MessageStore>,
}

impl StorageGrpc {
    pub fn new(store: Arc<dyn MessageStore>) -> Self {
        Self { store }
    }

    pub fn into_server(self) -> StorageServiceServer<Self> {
        StorageServiceServer::new(self)
            .max_decoding_message_size(imdedup_core::batch::MAX_BATCH_MESSAGE_BYTES)
    }
}

#[tonic::async_trait]
impl StorageService for StorageGrpc {
    async fn insert_once(
        &self,
        request: Request<pb::InsertOnceRequest>,
    ) -> Result<Response<pb::InsertOnceResponse>, Status> {
        Ok(Response::new(
            insert(self.store.as_ref(), request.into_inner()).await?,
        ))
    }

    type InsertBatchStream =
        Pin<Box<dyn Stream<Item = Result<pb::InsertResult, Status>> + Send + 'static>>;

    async fn insert_batch(
        &self,
        request: Request<pb::InsertBatchRequest>,
    ) -> Result<Response<Self::InsertBatchStream>, Status> {
        let inserts = request.into_inner().inserts;
        if inserts.len() > MAX_BATCH {
            return Err(Error::invalid(format!(
                "a batch holds at most {MAX_BATCH} inserts, got {}",
                inserts.len()
            ))
            .into());
        }
        // Concurrently, so the store can commit them together; each in its
        // own task, so it finishes even if the caller goes away, and each
        // answered as soon as it is done.
        let results: FuturesUnordered<_> = inserts
            .into_iter()
            .enumerate()
            .map(|(index, mut insert_request)| {
                let store = Arc::clone(&self.store);
                // Each insert continues the trace of its own send.
                let span = tracing::info_span!("imdedup.storage.insert");
                telemetry::set_parent(&span, telemetry::extract_map(&insert_request.trace_context));
                insert_request.trace_context.clear();
                let task = tokio::spawn(
                    async move { insert(store.as_ref(), insert_request).await }.instrument(span),
                );
                async move {
                    let result = task.await.unwrap_or_else(|e| {
                        Err(Error::internal(format!("the insert task failed: {e}")))
                    });
                    Ok(pb::InsertResult {
                        index: u32::try_from(index).unwrap_or(u32::MAX),
                        result: Some(match result {
                            Ok(ok) => insert_result::Result::Ok(ok),
                            Err(e) => insert_result::Result::Error(e.into()),
                        }),
                    })
                }
            })
            .collect();
        Ok(Response::new(Box::pin(results)))
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

/// Store one message, as `InsertOnce` does and each item of `InsertBatch`.
async fn insert(
    store: &dyn MessageStore,
    request: pb::InsertOnceRequest,
) -> Result<pb::InsertOnceResponse, Error> {
    let message = convert::insert_request(request, MAX_STORED_BODY_BYTES)?;
    let (inserted, row) = match store.insert_once(message).await? {
        Insert::Stored(row) => (true, row),
        Insert::AlreadyStored(row) => (false, row),
    };
    Ok(pb::InsertOnceResponse {
        inserted,
        message: Some(row.into()),
    })
}
