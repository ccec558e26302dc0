//! The one codec between imdedup's errors and gRPC statuses, used on every
//! hop (unary, batch and stream alike) and by the business API: the kind
//! travels as the status code, the retry-after hint and a reused ID's
//! original receipt as metadata, so nothing an [`Error`] says is lost on
//! the way.

use std::time::Duration;

use imdedup_domain::{Error, ErrorKind, model::Receipt};
use tonic::{Code, Status};

/// The gRPC metadata key that carries [`Error::retry_after`], in ms.
pub const RETRY_AFTER_METADATA: &str = "imdedup-retry-after-ms";
/// The gRPC metadata keys that carry [`Error::original`] (`ALREADY_EXISTS`).
pub const ORIGINAL_SERVER_ID_METADATA: &str = "imdedup-original-server-id";
pub const ORIGINAL_SEQ_METADATA: &str = "imdedup-original-seq";

/// The gRPC status code of `kind`.
pub fn code(kind: ErrorKind) -> Code {
    match kind {
        ErrorKind::InvalidArgument => Code::InvalidArgument,
        ErrorKind::Unauthenticated => Code::Unauthenticated,
        ErrorKind::PermissionDenied => Code::PermissionDenied,
        ErrorKind::Unavailable => Code::Unavailable,
        ErrorKind::MaybeStored => Code::Unknown,
        ErrorKind::DeadlineExceeded => Code::DeadlineExceeded,
        ErrorKind::Overloaded => Code::ResourceExhausted,
        ErrorKind::Internal => Code::Internal,
        ErrorKind::IdReused => Code::AlreadyExists,
    }
}

/// The kind a gRPC status code stands for, seen from the caller's side.
pub fn kind(code: Code) -> ErrorKind {
    match code {
        Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => {
            ErrorKind::InvalidArgument
        }
        Code::Unauthenticated => ErrorKind::Unauthenticated,
        Code::PermissionDenied => ErrorKind::PermissionDenied,
        // Refused or unreachable before the call was taken: not stored.
        Code::Unavailable => ErrorKind::Unavailable,
        // A call cut midway (a connection that broke shows up as
        // `Unknown`, "transport error") may have done its work; our
        // servers answer `Unknown` for exactly that.
        Code::Unknown | Code::Cancelled | Code::Aborted => ErrorKind::MaybeStored,
        Code::DeadlineExceeded => ErrorKind::DeadlineExceeded,
        Code::ResourceExhausted => ErrorKind::Overloaded,
        Code::AlreadyExists => ErrorKind::IdReused,
        _ => ErrorKind::Internal,
    }
}

/// `error` as a gRPC status.
pub fn to_status(error: Error) -> Status {
    let mut status = Status::new(code(error.kind()), error.message());
    let metadata = status.metadata_mut();
    if let Some(after) = error.retry_after() {
        let ms = u64::try_from(after.as_millis()).unwrap_or(u64::MAX);
        metadata.insert(RETRY_AFTER_METADATA, ms.into());
    }
    if let Some(original) = error.original() {
        metadata.insert(ORIGINAL_SERVER_ID_METADATA, original.server_id.into());
        metadata.insert(ORIGINAL_SEQ_METADATA, original.seq.into());
    }
    status
}

/// The error a gRPC status stands for.
pub fn from_status(status: Status) -> Error {
    let kind = match kind(status.code()) {
        // Made on this side from the connection's failure (an HTTP/2
        // error when the peer went away mid-call), so it carries its
        // cause; the peer's own `INTERNAL` answers never do. A call cut
        // midway may have done its work.
        ErrorKind::Internal if std::error::Error::source(&status).is_some() => {
            ErrorKind::MaybeStored
        }
        kind => kind,
    };
    let error = Error::new(kind, status.message().to_owned());
    let number =
        |key: &str| -> Option<u64> { status.metadata().get(key)?.to_str().ok()?.parse().ok() };
    let original = (error.kind() == ErrorKind::IdReused)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_cut_midway_may_have_stored_a_refused_one_did_not() {
        assert_eq!(kind(Code::Unknown), ErrorKind::MaybeStored);
        assert_eq!(kind(Code::Cancelled), ErrorKind::MaybeStored);
        assert_eq!(kind(Code::Unavailable), ErrorKind::Unavailable);
        assert!(ErrorKind::MaybeStored.retryable());
    }

    #[test]
    fn a_call_cut_by_its_connection_may_have_stored() {
        let mut cut = Status::internal("h2 protocol error: http2 error");
        cut.set_source(std::sync::Arc::new(std::io::Error::other(
            "connection reset",
        )));
        assert_eq!(from_status(cut).kind(), ErrorKind::MaybeStored);
        // The peer's own answer stays what it said.
        assert_eq!(
            from_status(Status::internal("bug")).kind(),
            ErrorKind::Internal
        );
    }

    #[test]
    fn kinds_survive_a_trip_through_grpc_status() {
        for kind in ErrorKind::ALL {
            let status = to_status(Error::new(kind, "boom"));
            let back = from_status(status);
            assert_eq!(back.kind(), kind);
            assert_eq!(back.message(), "boom");
            assert_eq!(back.retry_after(), None);
        }
        let busy = Error::overloaded("busy", Duration::from_millis(250));
        let back = from_status(to_status(busy));
        assert_eq!(back.kind(), ErrorKind::Overloaded);
        assert_eq!(back.retry_after(), Some(Duration::from_millis(250)));
    }

    #[test]
    fn a_reused_id_keeps_its_original_through_grpc_status() {
        let original = Receipt {
            server_id: 41,
            seq: 7,
        };
        let back = from_status(to_status(Error::id_reused(original)));
        assert_eq!(back.kind(), ErrorKind::IdReused);
        assert_eq!(back.original(), Some(original));
        // Only a reused id has one, whatever the metadata says.
        let mut other = to_status(Error::new(ErrorKind::Internal, "x"));
        other
            .metadata_mut()
            .insert(ORIGINAL_SERVER_ID_METADATA, 1u64.into());
        other
            .metadata_mut()
            .insert(ORIGINAL_SEQ_METADATA, 1u64.into());
        assert_eq!(from_status(other).original(), None);
    }
}
