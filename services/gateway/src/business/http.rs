//! `POST /v1/messages`: the business API over HTTP/JSON, on the gateway's
//! port.
//!
//! ```text
//! POST /v1/messages
//! Authorization: Bearer <service token>
//! Idempotency-Key: order-1234:shipped
//! Content-Type: application/json
//!
//! {"sender":"orders-bot","conversation":"dm:ana:orders-bot","body":"Your order shipped"}
//! ```
//!
//! answers 200 `{"server_id":"7","seq":3,"duplicate":false,"outcome":"stored"}`
//! (a retry: the same ids, `"duplicate":true`, `"outcome":"duplicate_business_key"`
//! and the header `Idempotent-Replayed: true`), or an error
//! `{"code":..,"retryable":..,"message":..}` with the status of
//! [`status_of`].

use std::sync::Arc;

use axum::{
    Json,
    body::Body,
    http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};
use imdedup_domain::{Error, ErrorKind};
use serde::Deserialize;

use super::{Answer, Request, error_code};
use crate::Gateway;

/// The header that carries the idempotency key.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// Set on the answer to a repeat, as payment APIs do.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// Largest request body read; a message body has its own, smaller limit.
pub const MAX_REQUEST_BYTES: usize = crate::MAX_FRAME_BYTES;

/// The JSON body of a call.
#[derive(Debug, Deserialize)]
struct MessageJson {
    sender: String,
    conversation: String,
    body: String,
}

/// The HTTP status of an error answer.
pub fn status_of(kind: ErrorKind) -> StatusCode {
    match kind {
        ErrorKind::InvalidArgument => StatusCode::BAD_REQUEST,
        ErrorKind::Unauthenticated => StatusCode::UNAUTHORIZED,
        ErrorKind::PermissionDenied => StatusCode::FORBIDDEN,
        ErrorKind::IdReused => StatusCode::CONFLICT,
        ErrorKind::Overloaded => StatusCode::TOO_MANY_REQUESTS,
        ErrorKind::Unavailable | ErrorKind::MaybeStored => StatusCode::SERVICE_UNAVAILABLE,
        ErrorKind::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        ErrorKind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// The call's fields from its headers and body. Errors are final
/// (`invalid_argument`); the values themselves are validated by
/// [`super::send`].
pub fn parse(headers: &HeaderMap, body: &[u8]) -> Result<Request, Error> {
    let mut keys = headers.get_all(&IDEMPOTENCY_KEY).iter();
    let key = match (keys.next(), keys.next()) {
        (Some(key), None) => key.as_bytes().to_vec(),
        (None, _) => {
            return Err(Error::invalid(
                "no Idempotency-Key header: give every request a key (1 to 255 bytes) and \
                 reuse it on every retry",
            ));
        }
        (Some(_), Some(_)) => return Err(Error::invalid("more than one Idempotency-Key header")),
    };
    if let Some(content_type) = headers.get(header::CONTENT_TYPE) {
        let json = content_type
            .to_str()
            .ok()
            .and_then(|v| v.split(';').next())
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"));
        if !json {
            return Err(Error::invalid("the body must be application/json"));
        }
    }
    let shape = || "the body is not {\"sender\":..,\"conversation\":..,\"body\":..}";
    // An object, not the same fields in an array (which serde would take).
    let value: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| Error::invalid(format!("{}: {e}", shape())))?;
    if !value.is_object() {
        return Err(Error::invalid(shape()));
    }
    let message: MessageJson =
        serde_json::from_value(value).map_err(|e| Error::invalid(format!("{}: {e}", shape())))?;
    Ok(Request {
        idempotency_key: key,
        sender: message.sender,
        conversation: message.conversation,
        body: message.body,
    })
}

/// Answer one `POST /v1/messages`. `authenticated` is called once the
/// service token has passed (the connection is then no longer held to the
/// deadline of unauthenticated ones).
pub async fn post(
    gateway: &Arc<Gateway>,
    headers: HeaderMap,
    body: Body,
    authenticated: impl FnOnce(),
) -> Response {
    if gateway.config.service_tokens.is_none() {
        return error_response(&Error::new(
            ErrorKind::InvalidArgument,
            "the business API is not enabled on this gateway",
        ))
        .with_status(StatusCode::NOT_FOUND, "not_found");
    }
    let token = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(super::bearer)
        .map(str::to_owned);
    let request = match axum::body::to_bytes(body, MAX_REQUEST_BYTES).await {
        Ok(bytes) => parse(&headers, &bytes),
        Err(_) => Err(Error::invalid(format!(
            "the request body is over {MAX_REQUEST_BYTES} bytes, or was cut off"
        ))),
    };
    let result = super::send(gateway, token, request).await;
    if !matches!(&result, Err(e) if e.kind() == ErrorKind::Unauthenticated) {
        authenticated();
    }
    match result {
        Ok(answer) => ok_response(answer),
        Err(error) => error_response(&error).into_response(),
    }
}

fn ok_response(answer: Answer) -> Response {
    let body = serde_json::json!({
        "server_id": answer.receipt.server_id.to_string(),
        "seq": answer.receipt.seq,
        "duplicate": answer.duplicate,
        "outcome": answer.outcome(),
    });
    let mut response = (StatusCode::OK, Json(body)).into_response();
    if answer.duplicate {
        response
            .headers_mut()
            .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    }
    response
}

/// An error answer being built.
struct ErrorResponse {
    status: StatusCode,
    body: serde_json::Value,
    headers: HeaderMap,
}

impl ErrorResponse {
    fn with_status(mut self, status: StatusCode, code: &str) -> Response {
        self.status = status;
        self.body["code"] = code.into();
        self.into_response()
    }
}

impl IntoResponse for ErrorResponse {
    fn into_response(self) -> Response {
        (self.status, self.headers, Json(self.body)).into_response()
    }
}

fn error_response(error: &Error) -> ErrorResponse {
    let mut body = serde_json::json!({
        "code": error_code(error.kind()),
        "retryable": error.retryable(),
        "message": error.message(),
    });
    let mut headers = HeaderMap::new();
    if let Some(original) = error.original() {
        body["server_id"] = original.server_id.to_string().into();
        body["seq"] = original.seq.into();
    }
    if let Some(after) = error.retry_after() {
        let ms = u64::try_from(after.as_millis()).unwrap_or(u64::MAX);
        body["retry_after_ms"] = ms.into();
        // Whole seconds, rounded up: the header has no finer unit.
        headers.insert(header::RETRY_AFTER, HeaderValue::from(ms.div_ceil(1000)));
    }
    if error.kind() == ErrorKind::Unauthenticated {
        headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
    ErrorResponse {
        status: status_of(error.kind()),
        body,
        headers,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use imdedup_domain::model::Receipt;

    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            headers.append(
                HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_str(value).unwrap(),
            );
        }
        headers
    }

    const BODY: &[u8] =
        br#"{"sender":"orders-bot","conversation":"dm:ana:orders-bot","body":"shipped"}"#;

    #[test]
    fn a_well_formed_call_is_read_whole() {
        let request = parse(
            &headers(&[
                ("idempotency-key", "order-1234:shipped"),
                ("content-type", "application/json; charset=utf-8"),
            ]),
            BODY,
        )
        .unwrap();
        assert_eq!(
            request,
            Request {
                idempotency_key: b"order-1234:shipped".to_vec(),
                sender: "orders-bot".into(),
                conversation: "dm:ana:orders-bot".into(),
                body: "shipped".into(),
            }
        );
        // A call without a content type is read as JSON too.
        assert!(parse(&headers(&[("Idempotency-Key", "k")]), BODY).is_ok());
    }

    #[test]
    fn a_missing_or_doubled_key_is_refused() {
        let err = parse(&headers(&[]), BODY).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidArgument);
        assert!(err.message().contains("Idempotency-Key"), "{err}");
        let twice = headers(&[("idempotency-key", "a"), ("idempotency-key", "b")]);
        assert!(
            parse(&twice, BODY)
                .unwrap_err()
                .message()
                .contains("more than one")
        );
    }

    #[test]
    fn bodies_that_are_not_the_message_json_are_refused() {
        let key = [("idempotency-key", "k")];
        for (body, why) in [
            (&b"sender=ana"[..], "not JSON"),
            (br#"{"sender":"a","conversation":"c"}"#, "no body"),
            (
                br#"{"sender":"a","conversation":"c","body":7}"#,
                "body not a string",
            ),
            (br#"["a","c","b"]"#, "not an object"),
            (b"", "empty"),
        ] {
            let err = parse(&headers(&key), body).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{why}");
        }
        let form = headers(&[
            ("idempotency-key", "k"),
            ("content-type", "application/x-www-form-urlencoded"),
        ]);
        assert!(
            parse(&form, BODY)
                .unwrap_err()
                .message()
                .contains("application/json")
        );
    }

    #[test]
    fn each_error_has_its_status_and_a_reused_key_its_original() {
        let statuses: Vec<u16> = ErrorKind::ALL
            .iter()
            .map(|k| status_of(*k).as_u16())
            .collect();
        assert_eq!(statuses, [400, 401, 403, 503, 503, 504, 429, 500, 409]);

        let original = Receipt {
            server_id: 12_345_678_901,
            seq: 4,
        };
        let reused = error_response(&Error::id_reused(original));
        assert_eq!(reused.status, StatusCode::CONFLICT);
        assert_eq!(reused.body["code"], "idempotency_key_reused");
        assert_eq!(reused.body["retryable"], false);
        assert_eq!(reused.body["server_id"], "12345678901");
        assert_eq!(reused.body["seq"], 4);

        let busy = error_response(&Error::overloaded("busy", Duration::from_millis(1200)));
        assert_eq!(busy.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(busy.body["retry_after_ms"], 1200);
        assert_eq!(busy.headers[header::RETRY_AFTER], "2");

        let denied = error_response(&Error::unauthenticated("no token"));
        assert_eq!(denied.headers[header::WWW_AUTHENTICATE], "Bearer");
    }
}
