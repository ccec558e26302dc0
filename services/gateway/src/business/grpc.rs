//! `imdedup.v1.BusinessService`: the business API over gRPC, on its own
//! listener (`--business-grpc-listen`). The service token travels in the
//! `authorization` metadata (`Bearer <token>`).

use std::sync::Arc;

use imdedup_runtime::server::ServeOptions;

use imdedup_domain::Error;
use imdedup_proto::v1::{
    BusinessOutcome, BusinessSendRequest, BusinessSendResponse,
    business_service_server::{BusinessService, BusinessServiceServer},
};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, metadata::MetadataValue};

use super::{SERVICE_NAME, error_code};
use crate::Gateway;

/// Metadata of an error: its code as the HTTP API names it.
pub const ERROR_CODE_METADATA: &str = "imdedup-error-code";
/// Metadata of `ALREADY_EXISTS` (a reused key): the original message
/// (written by the error's own gRPC codec).
pub use imdedup_proto::status::{ORIGINAL_SEQ_METADATA, ORIGINAL_SERVER_ID_METADATA};

/// Most calls in flight on one client connection.
const MAX_CALLS_PER_CONNECTION: usize = 256;

pub struct BusinessGrpc {
    gateway: Arc<Gateway>,
}

impl BusinessGrpc {
    pub fn new(gateway: Arc<Gateway>) -> Self {
        Self { gateway }
    }

    pub fn into_server(self) -> BusinessServiceServer<Self> {
        BusinessServiceServer::new(self)
    }
}

/// The status of an error answer: the error's own gRPC form (the original
/// message of a reused key and the retry hint in its metadata), with the
/// code named as the HTTP API names it.
pub fn status(error: Error) -> Status {
    let code = error_code(error.kind());
    let mut status = imdedup_proto::status::to_status(error);
    status
        .metadata_mut()
        .insert(ERROR_CODE_METADATA, MetadataValue::from_static(code));
    status
}

/// A call larger than the server decodes (4 MiB) is answered by tonic
/// itself, before any handler, as `OUT_OF_RANGE` with no metadata; the API
/// answers a call it cannot take as `INVALID_ARGUMENT` with the code named,
/// like any other bad call. tonic answers such a call with its status in
/// the headers (trailers-only), and no handler of ours answers
/// `OUT_OF_RANGE`.
fn too_large_is_invalid<B>(mut response: axum::http::Response<B>) -> axum::http::Response<B> {
    // `tonic::Code::OutOfRange` as the header carries it.
    const OUT_OF_RANGE: &[u8] = b"11";
    let headers = response.headers_mut();
    if headers
        .get("grpc-status")
        .is_some_and(|status| status.as_bytes() == OUT_OF_RANGE)
    {
        headers.insert(
            "grpc-status",
            axum::http::HeaderValue::from(tonic::Code::InvalidArgument as i32),
        );
        headers.insert(
            ERROR_CODE_METADATA,
            axum::http::HeaderValue::from_static(error_code(
                imdedup_domain::ErrorKind::InvalidArgument,
            )),
        );
    }
    response
}

#[tonic::async_trait]
impl BusinessService for BusinessGrpc {
    async fn send(
        &self,
        request: Request<BusinessSendRequest>,
    ) -> Result<Response<BusinessSendResponse>, Status> {
        if self.gateway.config.service_tokens.is_none() {
            return Err(Status::unimplemented(
                "the business API is not enabled on this gateway",
            ));
        }
        let token = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(super::bearer)
            .map(str::to_owned);
        let call = request.into_inner();
        let request = super::Request {
            idempotency_key: call.idempotency_key.into_bytes(),
            sender: call.sender,
            conversation: call.conversation,
            body: call.body,
        };
        let answer = super::send(&self.gateway, token, Ok(request))
            .await
            .map_err(status)?;
        Ok(Response::new(BusinessSendResponse {
            server_id: answer.receipt.server_id,
            seq: answer.receipt.seq,
            duplicate: answer.duplicate,
            outcome: if answer.duplicate {
                BusinessOutcome::DuplicateBusinessKey
            } else {
                BusinessOutcome::Stored
            } as i32,
        }))
    }
}

/// Serve `imdedup.v1.BusinessService` (and health, and reflection when
/// `options` say so) on `listener` until `shutdown` is cancelled; calls in
/// flight then finish.
pub async fn serve(
    listener: TcpListener,
    gateway: Arc<Gateway>,
    options: ServeOptions,
    shutdown: CancellationToken,
) -> Result<(), tonic::transport::Error> {
    let routes = tonic::service::Routes::new(BusinessGrpc::new(gateway).into_server())
        .into_axum_router()
        .layer(tower::util::MapResponseLayer::new(too_large_is_invalid))
        .into();
    imdedup_runtime::server::serve_grpc(
        listener,
        &[SERVICE_NAME],
        routes,
        MAX_CALLS_PER_CONNECTION,
        options,
        shutdown,
    )
    .await
}

#[cfg(test)]
mod tests {
    use imdedup_domain::{ErrorKind, model::Receipt};
    use tonic::Code;

    use super::*;

    #[test]
    fn a_reused_key_is_already_exists_with_the_original_in_the_metadata() {
        let status = status(Error::id_reused(Receipt {
            server_id: 9,
            seq: 2,
        }));
        assert_eq!(status.code(), Code::AlreadyExists);
        let meta = |key| status.metadata().get(key).unwrap().to_str().unwrap();
        assert_eq!(meta(ERROR_CODE_METADATA), "idempotency_key_reused");
        assert_eq!(meta(ORIGINAL_SERVER_ID_METADATA), "9");
        assert_eq!(meta(ORIGINAL_SEQ_METADATA), "2");
        let busy = super::status(Error::overloaded(
            "busy",
            std::time::Duration::from_millis(40),
        ));
        assert_eq!(busy.code(), Code::ResourceExhausted);
        assert_eq!(
            busy.metadata()
                .get(imdedup_proto::status::RETRY_AFTER_METADATA)
                .unwrap(),
            "40"
        );
        assert_eq!(
            super::status(Error::new(ErrorKind::PermissionDenied, "no")).code(),
            Code::PermissionDenied
        );
    }
}
