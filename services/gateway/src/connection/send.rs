//! A send's trip to its shard, and the errors from behind the gateway as a
//! phone gets them.

use std::time::Duration;

use imdedup_domain::{
    Error, ErrorKind,
    model::{Ack, ClientMsgId, Sender},
};
use imdedup_proto::convert;

use crate::{Gateway, frames::SendCmd};

/// One send is one trace, and this span is its root: the phone carries no
/// trace context. Kind server (the gateway answers the phone); the hops to
/// ingest and storage continue it (see `imdedup_runtime::telemetry`).
#[tracing::instrument(
    name = "imdedup.send",
    skip_all,
    fields(
        otel.kind = "server",
        otel.status_code = tracing::field::Empty,
        network.protocol.name = "websocket",
        imdedup.outcome = tracing::field::Empty,
        error.type = tracing::field::Empty,
    )
)]
pub(super) async fn send(gateway: &Gateway, sender: Sender, cmd: SendCmd) -> Result<Ack, Error> {
    let validated = if ClientMsgId::is_reserved_for_business(&cmd.id) {
        // Those IDs are derived from business idempotency keys: a phone
        // must not be able to answer for, or collide with, a business call.
        Err(Error::invalid(
            "client message ids starting with \"bk:\" are reserved for the business API",
        ))
    } else {
        convert::new_message(
            sender.as_str().to_owned(),
            cmd.id,
            cmd.conversation,
            cmd.body,
            gateway.config.max_body_bytes,
        )
    };
    let authorized = match validated {
        Ok(message) => gateway
            .config
            .authz
            .check(&sender, &message.conversation)
            .await
            .map(|()| message),
        Err(e) => Err(e),
    };
    let result = match authorized {
        Ok(message) => {
            let (shard, result) = gateway
                .shards
                .send(message, gateway.config.send_timeout)
                .await;
            gateway
                .metrics()
                .shard_replied(shard, result.as_ref().map(|_| ()).map_err(Error::kind));
            result.map_err(for_phone)
        }
        Err(e) => Err(e),
    };
    let span = tracing::Span::current();
    match &result {
        Ok(ack) => {
            span.record("imdedup.outcome", ack.outcome.as_str());
        }
        Err(error) => {
            span.record("error.type", error.kind().as_str());
            if error.retryable() {
                span.record("otel.status_code", "ERROR");
            }
        }
    }
    result
}

/// An error from ingest or storage, as the phone gets it. The gateway has
/// validated the frame already, so a refusal further on is not final for the
/// phone (a rolling update can change limits between hops): not stored,
/// resend. The text says what to do, never which node, file or driver
/// failed; the full cause goes to the log.
pub(crate) fn for_phone(error: Error) -> Error {
    if error.kind() == ErrorKind::IdReused {
        return error;
    }
    if error.kind() == ErrorKind::Overloaded {
        // Refusals under load come by the thousand and are counted in the
        // metrics: a log line each would add to the load.
        tracing::debug!(error = %error, "backend busy");
    } else {
        tracing::warn!(error = %error, "backend error");
    }
    let (kind, message) = match error.kind() {
        ErrorKind::MaybeStored => (
            ErrorKind::MaybeStored,
            "this send may be stored; resend with the same id to settle it",
        ),
        ErrorKind::DeadlineExceeded => (
            ErrorKind::DeadlineExceeded,
            "no answer in time; this send may be stored: resend with the same id",
        ),
        ErrorKind::Overloaded => (
            ErrorKind::Overloaded,
            "the service is busy; not stored: resend with the same id after a pause",
        ),
        ErrorKind::Internal => (
            ErrorKind::Internal,
            "internal error; resend with the same id",
        ),
        ErrorKind::Unavailable
        | ErrorKind::InvalidArgument
        | ErrorKind::Unauthenticated
        | ErrorKind::PermissionDenied
        | ErrorKind::IdReused => (
            ErrorKind::Unavailable,
            "the service is unavailable; not stored: resend with the same id",
        ),
    };
    // The backend's hint when it gave one, else a pause that spreads
    // resends out instead of bringing them straight back.
    let retry_after = error.retry_after().or(match kind {
        ErrorKind::Overloaded => Some(crate::BUSY_RETRY_AFTER),
        ErrorKind::Unavailable => Some(UNAVAILABLE_RETRY_AFTER),
        _ => None,
    });
    let phone = Error::new(kind, message);
    match retry_after {
        Some(after) => phone.with_retry_after(after),
        None => phone,
    }
}

/// How long a phone is asked to wait after `unavailable`.
pub(super) const UNAVAILABLE_RETRY_AFTER: Duration = Duration::from_secs(1);

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_backend_refusal_is_not_final_and_tells_no_internals() {
        let refused = for_phone(Error::invalid(
            "body is 20000 bytes, more than the limit of 16384 (ingest 10.1.2.3:7200)",
        ));
        assert_eq!(refused.kind(), ErrorKind::Unavailable);
        assert!(refused.retryable());
        let cases = [
            Error::unavailable("cql insert: connection refused by 10.1.2.3:9042"),
            Error::new(
                ErrorKind::MaybeStored,
                "cql history write: /var/lib/scylla timeout",
            ),
            Error::new(ErrorKind::DeadlineExceeded, "ingest-0.ingest:7200 slow"),
            Error::internal("sqlite: /data/messages.db is locked"),
            Error::new(ErrorKind::Overloaded, "queue of ingest-1 full"),
        ];
        for error in cases {
            let kind = error.kind();
            let phone = for_phone(error);
            assert_eq!(phone.kind(), kind, "the kind is kept");
            assert_eq!(
                phone.retry_after().is_some(),
                matches!(kind, ErrorKind::Overloaded | ErrorKind::Unavailable),
                "{kind:?}: busy and unavailable answers say when to come back"
            );
            for internal in ["10.1.2.3", "cql", "/var", "/data", "ingest-", "sqlite"] {
                assert!(
                    !phone.message().contains(internal),
                    "{internal} leaked: {}",
                    phone.message()
                );
            }
            assert!(phone.message().contains("same id"), "{}", phone.message());
        }
        let receipt = imdedup_domain::model::Receipt {
            server_id: 7,
            seq: 3,
        };
        let hinted = for_phone(Error::overloaded("db limit", Duration::from_millis(70)));
        assert_eq!(
            hinted.retry_after(),
            Some(Duration::from_millis(70)),
            "the backend's hint is kept"
        );
        let reused = for_phone(Error::id_reused(receipt));
        assert_eq!(
            reused.original(),
            Some(receipt),
            "id_reused keeps its answer"
        );
    }
}
