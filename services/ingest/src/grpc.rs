//! The gRPC face of the ingest: `imdedup.v1.IngestService`.

use std::{
    pin::Pin,
    sync::Arc,
    time::{Duration, Instant},
};

use futures_util::{Stream, stream::FuturesUnordered};
use imdedup_domain::Error;
use imdedup_hops::{MAX_BATCH_MESSAGE_BYTES, stream};
use imdedup_proto::convert;
use imdedup_proto::v1::{
    self as pb,
    ingest_service_server::{IngestService, IngestServiceServer},
    send_response,
};
use imdedup_runtime::telemetry;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

use crate::dedup::Dedup;
use imdedup_proto::status::to_status;

/// Most sends one `SendStream` call may have undecided at once.
const STREAM_IN_FLIGHT: usize = 1024;

/// Most sends one `SendBatch` call may carry.
pub const MAX_BATCH: usize = 1024;

pub struct IngestGrpc {
    dedup: Arc<Dedup>,
    max_body_bytes: usize,
    /// Cancelled when the shard shuts down: open `SendStream`s stop taking
    /// sends then, answer what they took and end.
    stop: CancellationToken,
}

impl IngestGrpc {
    pub fn new(dedup: Arc<Dedup>, max_body_bytes: usize, stop: CancellationToken) -> Self {
        Self {
            dedup,
            max_body_bytes,
            stop,
        }
    }

    pub fn into_server(self) -> IngestServiceServer<Self> {
        IngestServiceServer::new(self).max_decoding_message_size(MAX_BATCH_MESSAGE_BYTES)
    }
}

async fn decide(
    dedup: &Dedup,
    req: pb::SendRequest,
    max_body_bytes: usize,
) -> Result<pb::Ack, Error> {
    // The caller's deadline, from when the send arrived here.
    let deadline = (req.budget_ms > 0)
        .then(|| Instant::now() + Duration::from_millis(u64::from(req.budget_ms)));
    let message = convert::send_request(req, max_body_bytes).inspect_err(|e| {
        dedup.metrics().refused(e.kind());
    })?;
    Ok(dedup.send_within(message, deadline).await?.into())
}

/// Decide one send of a batch or stream, continuing the trace its gateway
/// started (a unary `Send` gets its parent from the call's metadata).
async fn decide_traced(
    dedup: &Dedup,
    mut req: pb::SendRequest,
    max_body_bytes: usize,
) -> send_response::Result {
    let span = tracing::info_span!("imdedup.ingest.send");
    telemetry::set_parent(&span, telemetry::extract_map(&req.trace_context));
    req.trace_context.clear();
    match decide(dedup, req, max_body_bytes).instrument(span).await {
        Ok(ack) => send_response::Result::Ack(ack),
        Err(e) => send_response::Result::Error(e.into()),
    }
}

#[tonic::async_trait]
impl IngestService for IngestGrpc {
    async fn send(
        &self,
        request: Request<pb::SendRequest>,
    ) -> Result<Response<pb::SendResponse>, Status> {
        let req = request.into_inner();
        let tag = req.tag;
        let ack = decide(&self.dedup, req, self.max_body_bytes)
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::SendResponse {
            tag,
            result: Some(send_response::Result::Ack(ack)),
        }))
    }

    type SendBatchStream =
        Pin<Box<dyn Stream<Item = Result<pb::SendResponse, Status>> + Send + 'static>>;

    async fn send_batch(
        &self,
        request: Request<pb::SendBatchRequest>,
    ) -> Result<Response<Self::SendBatchStream>, Status> {
        let sends = request.into_inner().sends;
        if sends.len() > MAX_BATCH {
            return Err(to_status(Error::invalid(format!(
                "a batch holds at most {MAX_BATCH} sends, got {}",
                sends.len()
            ))));
        }
        // Each send is decided in its own task, so it runs to the end even
        // if the caller goes away, and is answered as soon as it is decided.
        let decisions: FuturesUnordered<_> = sends
            .into_iter()
            .map(|req| {
                let dedup = Arc::clone(&self.dedup);
                let max_body_bytes = self.max_body_bytes;
                let tag = req.tag;
                let decision =
                    tokio::spawn(async move { decide_traced(&dedup, req, max_body_bytes).await });
                async move {
                    let result = decision.await.unwrap_or_else(|e| {
                        send_response::Result::Error(
                            Error::internal(format!("the decision task failed: {e}")).into(),
                        )
                    });
                    Ok(pb::SendResponse {
                        tag,
                        result: Some(result),
                    })
                }
            })
            .collect();
        Ok(Response::new(Box::pin(decisions)))
    }

    type SendStreamStream =
        Pin<Box<dyn Stream<Item = Result<pb::SendResponse, Status>> + Send + 'static>>;

    async fn send_stream(
        &self,
        request: Request<Streaming<pb::SendRequest>>,
    ) -> Result<Response<Self::SendStreamStream>, Status> {
        let dedup = Arc::clone(&self.dedup);
        let max_body_bytes = self.max_body_bytes;
        let answers = stream::answer_each(
            request.into_inner(),
            STREAM_IN_FLIGHT,
            self.stop.clone(),
            move |req: pb::SendRequest| {
                let dedup = Arc::clone(&dedup);
                async move {
                    let tag = req.tag;
                    let result = decide_traced(&dedup, req, max_body_bytes).await;
                    Ok(pb::SendResponse {
                        tag,
                        result: Some(result),
                    })
                }
            },
        );
        Ok(Response::new(Box::pin(answers)))
    }
}
