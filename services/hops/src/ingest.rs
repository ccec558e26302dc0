//! The gateway's hop to one ingest shard: sends travel in natural batches
//! (`SendBatch`, see [`crate::batch`]), each answered as soon as it is
//! decided. Which shard a send goes to is the gateway's business.

use std::time::Duration;

use futures_util::StreamExt;
use imdedup_domain::{
    Error, ErrorKind,
    model::{Ack, NewMessage},
};
use imdedup_proto::{
    convert,
    status::from_status,
    v1::{self as pb, ingest_service_client::IngestServiceClient, send_response},
};
use imdedup_runtime::{
    telemetry,
    tls::{self, InternalTls},
};
use tonic::transport::{Channel, Endpoint};

use crate::{
    MAX_BATCH_MESSAGE_BYTES,
    batch::{Answers, BatchLimits, Batcher},
};

/// A lazily connecting client of one ingest shard.
#[derive(Clone)]
pub struct IngestClient {
    batcher: Batcher<pb::SendRequest, pb::SendResponse>,
}

impl IngestClient {
    /// A client of the shard at `url`; it connects when first used (over
    /// `tls`). A batch gets `timeout` as its deadline. Must be called
    /// inside a Tokio runtime.
    pub fn connect_lazy(url: &str, timeout: Duration, tls: &InternalTls) -> Result<Self, Error> {
        let endpoint = Endpoint::from_shared(url.to_owned())
            .map_err(|e| Error::invalid(format!("bad ingest shard url {url:?}: {e}")))?
            .connect_timeout(Duration::from_secs(2))
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(30));
        let client = IngestServiceClient::new(tls::channel(endpoint, tls)?)
            .max_decoding_message_size(MAX_BATCH_MESSAGE_BYTES);
        Ok(Self {
            batcher: Batcher::spawn(BatchLimits::default(), move |sends| {
                send_batch(client.clone(), timeout, sends)
            }),
        })
    }

    /// Send `message` to this shard; its answer within `timeout`.
    pub async fn send(&self, message: NewMessage, timeout: Duration) -> Result<Ack, Error> {
        let request = pb::SendRequest {
            sender: message.key.sender.as_str().to_owned(),
            client_msg_id: message.key.client_msg_id.into_bytes(),
            conversation: message.conversation.as_str().to_owned(),
            body: message.body.into_string(),
            trace_context: telemetry::trace_context(),
            tag: 0,
            // The deadline travels with the send, through the batch.
            budget_ms: u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX),
        };
        let response = tokio::time::timeout(timeout, self.batcher.call(request))
            .await
            .map_err(|_| late(timeout))??;
        match response.result {
            Some(send_response::Result::Ack(ack)) => convert::ack(ack),
            Some(send_response::Result::Error(e)) => Err(e.into()),
            None => Err(Error::internal(
                "ingest answered with neither ack nor error",
            )),
        }
    }
}

fn late(timeout: Duration) -> Error {
    Error::new(
        ErrorKind::DeadlineExceeded,
        format!("ingest shard did not answer within {timeout:?}"),
    )
}

/// One `SendBatch` call; each send is answered as soon as it is decided,
/// matched by its tag (its index in the batch).
async fn send_batch(
    mut client: IngestServiceClient<Channel>,
    timeout: Duration,
    mut sends: Vec<pb::SendRequest>,
) -> Result<Answers<pb::SendResponse>, Error> {
    for (index, send) in sends.iter_mut().enumerate() {
        send.tag = index as u64;
    }
    let mut request = tonic::Request::new(pb::SendBatchRequest { sends });
    request.set_timeout(timeout);
    let answers = tokio::time::timeout(timeout, client.send_batch(request))
        .await
        .map_err(|_| late(timeout))?
        .map_err(from_status)?
        .into_inner()
        .map(|answer| {
            let answer = answer.map_err(from_status)?;
            let index = usize::try_from(answer.tag).unwrap_or(usize::MAX);
            Ok((index, Ok(answer)))
        });
    Ok(Box::pin(answers))
}
