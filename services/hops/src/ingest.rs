//! The gateway's hop to one ingest shard: sends travel on one long-lived
//! `SendStream` (see [`crate::stream`]), each answered as soon as it is
//! decided. Which shard a send goes to is the gateway's business, and so is
//! how many go at once: the gateway's admission (its limit by time and the
//! held sends behind it) decides what enters, and each shard's stream keeps
//! an adaptive window ([`SEND_WINDOW`], see [`crate::stream::window`]): it
//! grows while full only on ACKs, and a shard that answers `overloaded`,
//! `deadline_exceeded` or `unavailable` (its database limit is full, the
//! send's time ran out there, or its database is out of reach) halves it;
//! the sends
//! beyond it wait in the gateway, bounded by their deadlines, instead of in
//! the shard's queue for a database place, from which they would come back
//! refused and be sent again.

use std::time::Duration;

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
    stream::{
        HopAnswers, HopCall, HopLimits, ReceiverStream, StreamHop, WindowLimits, grpc_answers,
    },
};

/// The window of sends unanswered per shard: it starts at 64 (the ingest's
/// initial database limit), grows while it is used, up to 1,024 (what a
/// shard reads of one stream at once), and a shard's pushback takes it down
/// to 16 at the least; a pushback at 16 stops new sends to the shard for a
/// quarter of a second.
pub const SEND_WINDOW: WindowLimits = WindowLimits {
    initial: 64,
    min: 16,
    max: 1024,
    rest: Duration::from_millis(250),
};

/// Opens `SendStream` for the [`StreamHop`] of sends.
struct SendStreamCall {
    client: IngestServiceClient<Channel>,
}

impl HopCall for SendStreamCall {
    type Req = pb::SendRequest;
    type Resp = pb::SendResponse;

    async fn open(
        &self,
        requests: ReceiverStream<pb::SendRequest>,
    ) -> Result<HopAnswers<pb::SendResponse>, Error> {
        let answers = self.client.clone().send_stream(requests).await;
        Ok(grpc_answers(answers.map_err(from_status)?.into_inner()))
    }

    fn set_tag(request: &mut pb::SendRequest, tag: u64) {
        request.tag = tag;
    }

    fn tag(answer: &pb::SendResponse) -> u64 {
        answer.tag
    }

    fn is_pushback(answer: &pb::SendResponse) -> bool {
        matches!(
            &answer.result,
            Some(send_response::Result::Error(e))
                if matches!(
                    e.code(),
                    pb::ErrorCode::Overloaded
                        | pb::ErrorCode::DeadlineExceeded
                        | pb::ErrorCode::Unavailable
                )
        )
    }

    fn is_success(answer: &pb::SendResponse) -> bool {
        matches!(&answer.result, Some(send_response::Result::Ack(_)))
    }
}

/// A lazily connecting client of one ingest shard.
#[derive(Clone)]
pub struct IngestClient {
    sends: StreamHop<SendStreamCall>,
}

impl IngestClient {
    /// A client of the shard at `url`; it connects when first used (over
    /// `tls`). A stream that answers nothing for twice `timeout` (at least
    /// 2 s) while sends wait is given up, and its sends fail as
    /// `maybe_stored`. Must be called inside a Tokio runtime.
    pub fn connect_lazy(url: &str, timeout: Duration, tls: &InternalTls) -> Result<Self, Error> {
        let endpoint = Endpoint::from_shared(url.to_owned())
            .map_err(|e| Error::invalid(format!("bad ingest shard url {url:?}: {e}")))?
            .connect_timeout(Duration::from_secs(2))
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(30));
        let client = IngestServiceClient::new(tls::channel(endpoint, tls)?)
            .max_decoding_message_size(MAX_BATCH_MESSAGE_BYTES);
        let limits = HopLimits {
            window: SEND_WINDOW,
            stall: (timeout * 2).max(Duration::from_secs(2)),
            ..HopLimits::default()
        };
        Ok(Self {
            sends: StreamHop::spawn(limits, SendStreamCall { client }),
        })
    }

    /// How many sends may be unanswered by this shard now (the adaptive
    /// window; sends beyond it wait in this process).
    pub fn window(&self) -> usize {
        self.sends.window()
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
            // The deadline travels with the send.
            budget_ms: u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX),
        };
        let response = tokio::time::timeout(timeout, self.sends.call(request))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(result: send_response::Result) -> pb::SendResponse {
        pb::SendResponse {
            tag: 1,
            result: Some(result),
        }
    }

    fn refusal(code: pb::ErrorCode) -> pb::SendResponse {
        answer(send_response::Result::Error(pb::Error {
            code: code.into(),
            retryable: true,
            ..Default::default()
        }))
    }

    #[test]
    fn a_shard_out_of_room_time_or_reach_pushes_back_and_only_acks_grow_the_window() {
        for code in [
            pb::ErrorCode::Overloaded,
            pb::ErrorCode::DeadlineExceeded,
            pb::ErrorCode::Unavailable,
        ] {
            assert!(SendStreamCall::is_pushback(&refusal(code)), "{code:?}");
            assert!(!SendStreamCall::is_success(&refusal(code)), "{code:?}");
        }
        // A bad send or a reused ID says nothing about how many sends the
        // shard can take, either way.
        for code in [
            pb::ErrorCode::InvalidArgument,
            pb::ErrorCode::IdReused,
            pb::ErrorCode::Internal,
        ] {
            assert!(!SendStreamCall::is_pushback(&refusal(code)), "{code:?}");
            assert!(!SendStreamCall::is_success(&refusal(code)), "{code:?}");
        }
        let ack = answer(send_response::Result::Ack(pb::Ack::default()));
        assert!(!SendStreamCall::is_pushback(&ack));
        assert!(SendStreamCall::is_success(&ack));
    }
}
