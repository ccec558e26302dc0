//! The error kinds of imdedup, mapped once to gRPC status codes and to the
//! `retryable` flag that phones see.
//!
//! Four kinds are final for the phone: a malformed request, a bad token, a
//! conversation the sender does not belong to, and a client message ID
//! reused for another message. The others ask for a
//! resend with the same ID, which is always safe because a resend is
//! recognised; they say whether the send is surely not stored
//! (`Unavailable`, `Overloaded`) or may be (`MaybeStored`,
//! `DeadlineExceeded`, `Internal`), where only the resend settles it.

use std::{fmt, time::Duration};

use tonic::{Code, Status};

use crate::model::Receipt;

/// What went wrong, at the granularity a caller can act on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The request is malformed or breaks a documented limit. Final.
    InvalidArgument,
    /// The token is missing, forged or expired. Final for this token.
    Unauthenticated,
    /// The sender may not send to or read the conversation (or it does not
    /// exist; the answer does not say which). Final.
    PermissionDenied,
    /// A backend (ingest, storage) cannot be reached, or refused before
    /// storing anything: surely not stored. Retry.
    Unavailable,
    /// The send reached a backend that failed midway: it may be stored (the
    /// insert's outcome is unknown, or the message is stored but its history
    /// row is not written yet). The resend with the same ID settles it.
    MaybeStored,
    /// A backend did not answer within the deadline. Retry.
    DeadlineExceeded,
    /// Too much work in flight; shed before doing any. Retry later.
    Overloaded,
    /// Anything else; nothing was acknowledged. Retry.
    Internal,
    /// The client message ID is stored with another conversation or body:
    /// not a resend but a new message under a used ID. Final.
    IdReused,
}

impl ErrorKind {
    /// Every kind, for tables and metrics.
    pub const ALL: [Self; 9] = [
        Self::InvalidArgument,
        Self::Unauthenticated,
        Self::PermissionDenied,
        Self::Unavailable,
        Self::MaybeStored,
        Self::DeadlineExceeded,
        Self::Overloaded,
        Self::Internal,
        Self::IdReused,
    ];

    /// Whether the phone should resend the same message (same ID) later.
    pub fn retryable(self) -> bool {
        !matches!(
            self,
            Self::InvalidArgument | Self::Unauthenticated | Self::PermissionDenied | Self::IdReused
        )
    }

    /// The stable name used in JSON client frames and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InvalidArgument => "invalid_argument",
            Self::Unauthenticated => "unauthenticated",
            Self::PermissionDenied => "permission_denied",
            Self::Unavailable => "unavailable",
            Self::MaybeStored => "maybe_stored",
            Self::DeadlineExceeded => "deadline_exceeded",
            Self::Overloaded => "overloaded",
            Self::Internal => "internal",
            Self::IdReused => "id_reused",
        }
    }

    /// The gRPC status code for this kind.
    pub fn grpc_code(self) -> Code {
        match self {
            Self::InvalidArgument => Code::InvalidArgument,
            Self::Unauthenticated => Code::Unauthenticated,
            Self::PermissionDenied => Code::PermissionDenied,
            Self::Unavailable => Code::Unavailable,
            Self::MaybeStored => Code::Unknown,
            Self::DeadlineExceeded => Code::DeadlineExceeded,
            Self::Overloaded => Code::ResourceExhausted,
            Self::Internal => Code::Internal,
            Self::IdReused => Code::AlreadyExists,
        }
    }

    /// The kind a gRPC status code stands for, seen from the caller's side.
    pub fn from_grpc_code(code: Code) -> Self {
        match code {
            Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => {
                Self::InvalidArgument
            }
            Code::Unauthenticated => Self::Unauthenticated,
            Code::PermissionDenied => Self::PermissionDenied,
            // Refused or unreachable before the call was taken: not stored.
            Code::Unavailable => Self::Unavailable,
            // A call cut midway (a connection that broke shows up as
            // `Unknown`, "transport error") may have done its work; our
            // servers answer `Unknown` for exactly that.
            Code::Unknown | Code::Cancelled | Code::Aborted => Self::MaybeStored,
            Code::DeadlineExceeded => Self::DeadlineExceeded,
            Code::ResourceExhausted => Self::Overloaded,
            Code::AlreadyExists => Self::IdReused,
            _ => Self::Internal,
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An error with its kind and a message meant for the person reading it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind}: {message}")]
pub struct Error {
    kind: ErrorKind,
    message: String,
    /// For `IdReused`: the receipt of the message stored under the ID.
    original: Option<Receipt>,
    /// For `Overloaded` and `Unavailable`: how long the caller should wait
    /// before trying again, in ms (0: no hint). Kept small: errors travel
    /// in every `Result` of the hot path.
    retry_after_ms: u32,
}

/// The gRPC metadata key that carries [`Error::retry_after`], in ms.
pub const RETRY_AFTER_METADATA: &str = "imdedup-retry-after-ms";
/// The gRPC metadata keys that carry [`Error::original`] (`ALREADY_EXISTS`).
pub const ORIGINAL_SERVER_ID_METADATA: &str = "imdedup-original-server-id";
pub const ORIGINAL_SEQ_METADATA: &str = "imdedup-original-seq";

impl Error {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            original: None,
            retry_after_ms: 0,
        }
    }

    /// `id` is already stored as another message, whose receipt is
    /// `original`.
    pub fn id_reused(original: Receipt) -> Self {
        Self {
            original: Some(original),
            ..Self::new(
                ErrorKind::IdReused,
                format!(
                    "this client message id was already used for another message \
                     (server id {}, seq {}), with another conversation or body; \
                     give every new message a new id",
                    original.server_id, original.seq
                ),
            )
        }
    }

    /// The same error, carrying the receipt of the original message.
    pub fn with_original(mut self, original: Option<Receipt>) -> Self {
        self.original = original;
        self
    }

    /// For `IdReused`: the receipt of the message stored under the ID.
    pub fn original(&self) -> Option<Receipt> {
        self.original
    }

    /// The same error, telling the caller to wait `after` before retrying.
    /// (Whole ms, at least 1.)
    pub fn with_retry_after(mut self, after: Duration) -> Self {
        self.retry_after_ms = u32::try_from(after.as_millis()).unwrap_or(u32::MAX).max(1);
        self
    }

    /// How long to wait before retrying, when the server said.
    pub fn retry_after(&self) -> Option<Duration> {
        (self.retry_after_ms > 0).then(|| Duration::from_millis(u64::from(self.retry_after_ms)))
    }

    /// `Overloaded`, with a hint of when to try again.
    pub fn overloaded(message: impl Into<String>, retry_after: Duration) -> Self {
        Self::new(ErrorKind::Overloaded, message).with_retry_after(retry_after)
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidArgument, message)
    }

    pub fn unauthenticated(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unauthenticated, message)
    }

    pub fn permission_denied(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::PermissionDenied, message)
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unavailable, message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Internal, message)
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    pub fn retryable(&self) -> bool {
        self.kind.retryable()
    }
}

impl From<Error> for Status {
    fn from(err: Error) -> Self {
        let mut status = Status::new(err.kind.grpc_code(), err.message);
        let metadata = status.metadata_mut();
        if err.retry_after_ms > 0 {
            metadata.insert(RETRY_AFTER_METADATA, err.retry_after_ms.into());
        }
        if let Some(original) = err.original {
            metadata.insert(ORIGINAL_SERVER_ID_METADATA, original.server_id.into());
            metadata.insert(ORIGINAL_SEQ_METADATA, original.seq.into());
        }
        status
    }
}

impl From<Status> for Error {
    fn from(status: Status) -> Self {
        let error = Self::new(
            ErrorKind::from_grpc_code(status.code()),
            status.message().to_owned(),
        );
        let number =
            |key: &str| -> Option<u64> { status.metadata().get(key)?.to_str().ok()?.parse().ok() };
        let original = (error.kind == ErrorKind::IdReused)
            .then(|| {
                Some(Receipt {
                    server_id: number(ORIGINAL_SERVER_ID_METADATA)?,
                    seq: number(ORIGINAL_SEQ_METADATA)?,
                })
            })
            .flatten();
        let error = error.with_original(original);
        match number(RETRY_AFTER_METADATA) {
            Some(after) => error.with_retry_after(Duration::from_millis(after)),
            None => error,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_bad_requests_tokens_conversations_and_reused_ids_are_final() {
        let final_kinds: Vec<_> = ErrorKind::ALL
            .into_iter()
            .filter(|k| !k.retryable())
            .collect();
        assert_eq!(
            final_kinds,
            [
                ErrorKind::InvalidArgument,
                ErrorKind::Unauthenticated,
                ErrorKind::PermissionDenied,
                ErrorKind::IdReused
            ]
        );
    }

    #[test]
    fn a_call_cut_midway_may_have_stored_a_refused_one_did_not() {
        assert_eq!(
            ErrorKind::from_grpc_code(Code::Unknown),
            ErrorKind::MaybeStored
        );
        assert_eq!(
            ErrorKind::from_grpc_code(Code::Cancelled),
            ErrorKind::MaybeStored
        );
        assert_eq!(
            ErrorKind::from_grpc_code(Code::Unavailable),
            ErrorKind::Unavailable
        );
        assert!(ErrorKind::MaybeStored.retryable());
    }

    #[test]
    fn kinds_survive_a_trip_through_grpc_status() {
        for kind in ErrorKind::ALL {
            let status: Status = Error::new(kind, "boom").into();
            let back = Error::from(status);
            assert_eq!(back.kind(), kind);
            assert_eq!(back.message(), "boom");
            assert_eq!(back.retry_after(), None);
        }
        let busy = Error::overloaded("busy", Duration::from_millis(250));
        let back = Error::from(Status::from(busy));
        assert_eq!(back.kind(), ErrorKind::Overloaded);
        assert_eq!(back.retry_after(), Some(Duration::from_millis(250)));
    }

    #[test]
    fn a_reused_id_keeps_its_original_through_grpc_status() {
        let original = Receipt {
            server_id: 41,
            seq: 7,
        };
        let back = Error::from(Status::from(Error::id_reused(original)));
        assert_eq!(back.kind(), ErrorKind::IdReused);
        assert_eq!(back.original(), Some(original));
        // Only a reused id has one, whatever the metadata says.
        let mut other = Status::from(Error::new(ErrorKind::Internal, "x"));
        other
            .metadata_mut()
            .insert(ORIGINAL_SERVER_ID_METADATA, 1u64.into());
        other
            .metadata_mut()
            .insert(ORIGINAL_SEQ_METADATA, 1u64.into());
        assert_eq!(Error::from(other).original(), None);
    }
}
