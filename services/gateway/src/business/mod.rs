//! The business API: trusted backend systems (an order service, a
//! notification service) send messages as an account, deduplicated by their
//! own idempotency key. HTTP/JSON `POST /v1/messages` on the phones' port
//! ([`http`]) and gRPC `imdedup.v1.BusinessService` on a port of its own
//! ([`grpc`]) both come down to [`send`].
//!
//! The idempotency key *is* the message's identity: the message ID is
//! derived from it ([`ClientMsgId::for_business_key`]) and the sender is
//! the account, so (account, key) dedup is the send path's own (sender,
//! client message ID) dedup: the recent-ID window, the in-flight join, the
//! store's unique key, seqs never spent on a repeat, and a key that enters
//! the window only after its insert succeeded, so a failed call never
//! poisons it. Phones may not use the `bk:` prefix of those IDs.

pub mod grpc;
pub mod http;

use std::{sync::Arc, time::Instant};

use imdedup_domain::{
    Error, ErrorKind,
    model::{ClientMsgId, IdempotencyKey, Outcome, Receipt, Sender},
};

use imdedup_proto::convert;

use crate::{Gateway, connection::for_phone};

/// The fully qualified name of the gRPC service.
pub const SERVICE_NAME: &str = "imdedup.v1.BusinessService";

/// The `outcome` of a call answered as a repeat.
pub const DUPLICATE_BUSINESS_KEY: &str = crate::metrics::DUPLICATE_BUSINESS_KEY;

/// One call's fields as they arrived, not yet validated.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Request {
    pub idempotency_key: Vec<u8>,
    pub sender: String,
    pub conversation: String,
    pub body: String,
}

/// A call that was stored now or recognised as a repeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Answer {
    pub receipt: Receipt,
    /// A repeat of an earlier call with this key: the original's receipt.
    pub duplicate: bool,
}

impl Answer {
    /// `stored` or `duplicate_business_key`.
    pub fn outcome(&self) -> &'static str {
        if self.duplicate {
            DUPLICATE_BUSINESS_KEY
        } else {
            "stored"
        }
    }
}

/// The stable name of an error on the business API: the kind's, except a
/// reused key, `idempotency_key_reused`.
pub fn error_code(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::IdReused => "idempotency_key_reused",
        kind => kind.as_str(),
    }
}

/// The service token from an `Authorization: Bearer <token>` value.
pub fn bearer(value: &str) -> Option<&str> {
    value
        .strip_prefix("Bearer ")
        .or_else(|| value.strip_prefix("bearer "))
        .map(str::trim)
        .filter(|token| !token.is_empty())
}

/// One business call, from arrival to answer: the service token, the
/// sender within its scope, the fields, membership, the gateway's limits,
/// then the send to the conversation's ingest shard. `request` is `Err`
/// when the call could not even be read (answered after the token check,
/// so a caller without a token learns nothing).
///
/// The decision runs in its own task: a caller that gives up (a short
/// client timeout) does not cut it off, and it is counted all the same.
pub async fn send(
    gateway: &Arc<Gateway>,
    token: Option<String>,
    request: Result<Request, Error>,
) -> Result<Answer, Error> {
    let gateway = Arc::clone(gateway);
    tokio::spawn(async move {
        let started = Instant::now();
        let _in_flight = gateway.metrics().send_started();
        let result = decide(&gateway, token.as_deref(), request).await;
        gateway.metrics().business_send_answered(
            result.as_ref().map(outcome_of).map_err(Error::kind),
            started.elapsed(),
        );
        result
    })
    .await
    .unwrap_or_else(|e| Err(Error::internal(format!("the send task failed: {e}"))))
}

fn outcome_of(answer: &Answer) -> Outcome {
    if answer.duplicate {
        Outcome::DuplicateUniqueKey
    } else {
        Outcome::Stored
    }
}

#[tracing::instrument(
    name = "imdedup.business.send",
    skip_all,
    fields(
        otel.kind = "server",
        otel.status_code = tracing::field::Empty,
        imdedup.service = tracing::field::Empty,
        imdedup.outcome = tracing::field::Empty,
        error.type = tracing::field::Empty,
    )
)]
async fn decide(
    gateway: &Gateway,
    token: Option<&str>,
    request: Result<Request, Error>,
) -> Result<Answer, Error> {
    let result = authorized_send(gateway, token, request).await;
    let span = tracing::Span::current();
    match &result {
        Ok(answer) => {
            span.record("imdedup.outcome", answer.outcome());
        }
        Err(error) => {
            span.record("error.type", error_code(error.kind()));
            if error.retryable() {
                span.record("otel.status_code", "ERROR");
            }
        }
    }
    result
}

async fn authorized_send(
    gateway: &Gateway,
    token: Option<&str>,
    request: Result<Request, Error>,
) -> Result<Answer, Error> {
    let Some(verifier) = &gateway.config.service_tokens else {
        return Err(Error::unavailable("the business API is not enabled"));
    };
    let token = token.ok_or_else(|| {
        Error::unauthenticated("no service token: send Authorization: Bearer <token>")
    })?;
    let verified = verifier
        .verify(token, gateway.config.clock.unix_seconds())
        .inspect_err(|e| {
            tracing::debug!(reason = e.message(), "business call refused: bad token")
        })?;
    tracing::Span::current().record("imdedup.service", verified.sender.as_str());
    let request = request?;
    let sender = Sender::parse(request.sender)?;
    let allowed = verified
        .senders
        .as_ref()
        .is_some_and(|scope| scope.allows(&sender));
    if !allowed {
        return Err(Error::permission_denied(
            "this service token may not send as this account (see its senders claim)",
        ));
    }
    let key = IdempotencyKey::parse(request.idempotency_key)?;
    let message = convert::new_message(
        sender.as_str().to_owned(),
        ClientMsgId::for_business_key(&key).into_bytes(),
        request.conversation,
        request.body,
        gateway.config.max_body_bytes,
    )?;
    gateway
        .config
        .authz
        .check(&sender, &message.conversation)
        .await?;
    let admitted = gateway
        .admit(&sender, message.key.client_msg_id.as_bytes())
        .map_err(for_business)?;
    let (shard, result) = gateway
        .shards
        .send(message, gateway.config.send_timeout)
        .await;
    admitted.finish(crate::admission::Completion::of(&result));
    gateway
        .metrics()
        .shard_replied(shard, result.as_ref().map(|_| ()).map_err(Error::kind));
    let ack = result.map_err(|e| for_business(for_phone(e)))?;
    Ok(Answer {
        receipt: ack.receipt,
        duplicate: ack.outcome.is_duplicate(),
    })
}

/// An error past the checks, as a business system gets it: what to do, in
/// terms of its idempotency key; no internals (those were logged by
/// [`for_phone`]). The kind, the original receipt and the retry hint are
/// kept.
fn for_business(error: Error) -> Error {
    let message = match error.kind() {
        ErrorKind::IdReused => {
            let original = error
                .original()
                .map(|r| format!(" (server id {}, seq {})", r.server_id, r.seq))
                .unwrap_or_default();
            format!(
                "this idempotency key was already used for another message{original}, with \
                 another conversation or body; nothing stored: use a new key for a new request"
            )
        }
        ErrorKind::Overloaded => "the service or this sender is busy; not stored: retry with \
                                  the same idempotency key after the pause it asks for"
            .to_owned(),
        ErrorKind::Unavailable => {
            "the service is unavailable; not stored: retry with the same idempotency key".to_owned()
        }
        ErrorKind::MaybeStored => {
            "this call may be stored; retry with the same idempotency key to settle it".to_owned()
        }
        ErrorKind::DeadlineExceeded => "no answer in time; this call may be stored: retry with \
                                        the same idempotency key"
            .to_owned(),
        ErrorKind::Internal => "internal error; retry with the same idempotency key".to_owned(),
        ErrorKind::InvalidArgument | ErrorKind::Unauthenticated | ErrorKind::PermissionDenied => {
            return error;
        }
    };
    let business = Error::new(error.kind(), message).with_original(error.original());
    match error.retry_after() {
        Some(after) => business.with_retry_after(after),
        None => business,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_reused_key_is_named_for_the_business_and_keeps_the_original() {
        let original = Receipt {
            server_id: 41,
            seq: 7,
        };
        let reused = for_business(for_phone(Error::id_reused(original)));
        assert_eq!(reused.kind(), ErrorKind::IdReused);
        assert_eq!(error_code(reused.kind()), "idempotency_key_reused");
        assert_eq!(reused.original(), Some(original));
        assert!(reused.message().contains("idempotency key"), "{reused}");
        assert!(!reused.retryable());
    }

    #[test]
    fn backend_failures_say_to_retry_with_the_same_key_and_keep_the_hint() {
        let busy = for_business(for_phone(Error::overloaded(
            "ingest-3 queue full at 10.0.0.7",
            Duration::from_millis(300),
        )));
        assert_eq!(busy.kind(), ErrorKind::Overloaded);
        assert_eq!(busy.retry_after(), Some(Duration::from_millis(300)));
        for error in [
            Error::unavailable("cql: connection refused by 10.1.2.3:9042"),
            Error::new(ErrorKind::MaybeStored, "sqlite: /data/messages.db"),
            Error::new(ErrorKind::DeadlineExceeded, "ingest-0 slow"),
            Error::internal("panic in ingest-1"),
            busy,
        ] {
            let kind = error.kind();
            let business = for_business(for_phone(error));
            assert_eq!(business.kind(), kind);
            assert!(business.retryable());
            assert!(
                business.message().contains("same idempotency key"),
                "{business}"
            );
            for internal in ["10.", "cql", "/data", "ingest-", "sqlite"] {
                assert!(!business.message().contains(internal), "{business}");
            }
        }
    }

    #[test]
    fn bearer_tokens_are_read_from_the_header_value() {
        assert_eq!(bearer("Bearer abc.def.ghi"), Some("abc.def.ghi"));
        assert_eq!(bearer("bearer abc"), Some("abc"));
        assert_eq!(bearer("Bearer "), None);
        assert_eq!(bearer("Basic YWxhZGRpbjpvcGVuc2VzYW1l"), None);
        assert_eq!(bearer("abc.def.ghi"), None);
    }
}
