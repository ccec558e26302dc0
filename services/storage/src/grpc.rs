//! The gRPC face of a [`MessageStore`]: `imdedup.v1.StorageService`.

use std::{future::Future, pin::Pin, sync::Arc};

use futures_util::{Stream, stream::FuturesUnordered};
use imdedup_domain::{
    Error,
    store::{Insert, MessageStore},
};
use imdedup_hops::{MAX_BATCH_MESSAGE_BYTES, stream};
use imdedup_proto::convert;
use imdedup_proto::status::to_status;
use imdedup_proto::v1::{
    self as pb, insert_result,
    storage_service_server::{StorageService, StorageServiceServer},
};
use imdedup_runtime::telemetry;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

/// Storage accepts bodies up to this size; the gateway and ingest enforce the
/// smaller configured limit that phones see.
pub const MAX_STORED_BODY_BYTES: usize = 1 << 20;

/// Most inserts one `InsertBatch` call may carry.
pub const MAX_BATCH: usize = 1024;

/// Most inserts one `InsertStream` call may have unfinished at once.
const STREAM_IN_FLIGHT: usize = 1024;

/// Serves any [`MessageStore`] over gRPC.
pub struct StorageGrpc {
    store: Arc<dyn MessageStore>,
    /// Cancelled when storage shuts down: open `InsertStream`s stop taking
    /// inserts then, answer what they took and end.
    stop: CancellationToken,
}

impl StorageGrpc {
    pub fn new(store: Arc<dyn MessageStore>, stop: CancellationToken) -> Self {
        Self { store, stop }
    }

    pub fn into_server(self) -> StorageServiceServer<Self> {
        StorageServiceServer::new(self).max_decoding_message_size(MAX_BATCH_MESSAGE_BYTES)
    }
}

/// Store one insert of a batch or stream, continuing the trace of its send.
fn insert_traced(
    store: Arc<dyn MessageStore>,
    mut request: pb::InsertOnceRequest,
) -> impl Future<Output = insert_result::Result> + Send + 'static {
    let span = tracing::info_span!("imdedup.storage.insert");
    telemetry::set_parent(&span, telemetry::extract_map(&request.trace_context));
    request.trace_context.clear();
    async move {
        match insert(store.as_ref(), request).await {
            Ok(ok) => insert_result::Result::Ok(ok),
            Err(e) => insert_result::Result::Error(e.into()),
        }
    }
    .instrument(span)
}

#[tonic::async_trait]
impl StorageService for StorageGrpc {
    async fn insert_once(
        &self,
        request: Request<pb::InsertOnceRequest>,
    ) -> Result<Response<pb::InsertOnceResponse>, Status> {
        Ok(Response::new(
            insert(self.store.as_ref(), request.into_inner())
                .await
                .map_err(to_status)?,
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
            return Err(to_status(Error::invalid(format!(
                "a batch holds at most {MAX_BATCH} inserts, got {}",
                inserts.len()
            ))));
        }
        // Concurrently, so the store can commit them together; each in its
        // own task, so it finishes even if the caller goes away, and each
        // answered as soon as it is done.
        let results: FuturesUnordered<_> = inserts
            .into_iter()
            .enumerate()
            .map(|(index, request)| {
                let task = tokio::spawn(insert_traced(Arc::clone(&self.store), request));
                async move {
                    let result = task.await.unwrap_or_else(|e| {
                        insert_result::Result::Error(
                            Error::internal(format!("the insert task failed: {e}")).into(),
                        )
                    });
                    Ok(pb::InsertResult {
                        index: u32::try_from(index).unwrap_or(u32::MAX),
                        tag: 0,
                        result: Some(result),
                    })
                }
            })
            .collect();
        Ok(Response::new(Box::pin(results)))
    }

    type InsertStreamStream =
        Pin<Box<dyn Stream<Item = Result<pb::InsertResult, Status>> + Send + 'static>>;

    async fn insert_stream(
        &self,
        request: Request<Streaming<pb::InsertOnceRequest>>,
    ) -> Result<Response<Self::InsertStreamStream>, Status> {
        let store = Arc::clone(&self.store);
        let answers = stream::answer_each(
            request.into_inner(),
            STREAM_IN_FLIGHT,
            self.stop.clone(),
            move |request: pb::InsertOnceRequest| {
                let tag = request.tag;
                let inserted = insert_traced(Arc::clone(&store), request);
                async move {
                    Ok(pb::InsertResult {
                        index: 0,
                        tag,
                        result: Some(inserted.await),
                    })
                }
            },
        );
        Ok(Response::new(Box::pin(answers)))
    }

    async fn lookup(
        &self,
        request: Request<pb::LookupRequest>,
    ) -> Result<Response<pb::LookupResponse>, Status> {
        let req = request.into_inner();
        let key = convert::message_key(req.sender, req.client_msg_id).map_err(to_status)?;
        let message = self
            .store
            .lookup(&key)
            .await
            .map_err(to_status)?
            .map(Into::into);
        Ok(Response::new(pb::LookupResponse { message }))
    }

    async fn history(
        &self,
        request: Request<pb::HistoryRequest>,
    ) -> Result<Response<pb::HistoryResponse>, Status> {
        let query = convert::history_request(request.into_inner()).map_err(to_status)?;
        let messages = self
            .store
            .history(&query)
            .await
            .map_err(to_status)?
            .into_iter()
            .map(Into::into)
            .collect();
        Ok(Response::new(pb::HistoryResponse { messages }))
    }
}

/// Store one message, as `InsertOnce` does and each item of `InsertBatch`
/// and `InsertStream`.
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
