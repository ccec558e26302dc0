//! Group membership from the deployer's membership service
//! (`imdedup.v1.MembershipService`, see `proto/imdedup/v1/membership.proto`),
//! asked with a deadline and cached: answers are kept a short while (a
//! "member" longer than a "not a member", so a user added to a group can
//! post soon), concurrent questions about one pair make one call, and the
//! cache is bounded. When the service cannot answer, the check fails closed
//! with a retryable `unavailable`: nothing is sent or read.
//!
//! [`GroupsServer`] answers the same API from a groups file
//! (`imdedup membership`), for deployments whose groups change rarely and as
//! a reference for writing your own.

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use imdedup_domain::{
    Error,
    model::{ConversationId, Sender},
};
use imdedup_proto::v1::{
    CheckMembershipRequest, CheckMembershipResponse,
    membership_service_client::MembershipServiceClient,
    membership_service_server::{self, MembershipServiceServer},
};
use imdedup_runtime::tls::{self, InternalTls};
use moka::{Expiry, future::Cache};
use tonic::transport::{Channel, Endpoint};

use super::{GroupsFile, Membership};
use imdedup_proto::status::to_status;

/// The fully qualified name of the service.
pub const SERVICE_NAME: &str = "imdedup.v1.MembershipService";

/// How the gateway asks the membership service.
#[derive(Debug, Clone)]
pub struct ServiceOptions {
    /// `http://host:port` of the service.
    pub url: String,
    /// Deadline of one question.
    pub timeout: Duration,
    /// How long a "member" answer is kept.
    pub member_ttl: Duration,
    /// How long a "not a member" answer is kept.
    pub not_member_ttl: Duration,
    /// Most answers kept.
    pub capacity: u64,
}

impl ServiceOptions {
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            timeout: Duration::from_millis(500),
            member_ttl: Duration::from_secs(60),
            not_member_ttl: Duration::from_secs(5),
            capacity: 1_000_000,
        }
    }
}

/// Keeps each answer for the TTL of its kind.
struct AnswerExpiry {
    member: Duration,
    not_member: Duration,
}

impl Expiry<(String, String), bool> for AnswerExpiry {
    fn expire_after_create(
        &self,
        _key: &(String, String),
        member: &bool,
        _created_at: std::time::Instant,
    ) -> Option<Duration> {
        Some(if *member {
            self.member
        } else {
            self.not_member
        })
    }
}

/// A cached client of the deployer's membership service.
pub struct MembershipService {
    client: MembershipServiceClient<Channel>,
    timeout: Duration,
    answers: Cache<(String, String), bool>,
}

impl MembershipService {
    /// Connects on first use (over `tls`) and reconnects by itself.
    pub fn connect_lazy(options: &ServiceOptions, tls: &InternalTls) -> Result<Self, Error> {
        let endpoint = Endpoint::from_shared(options.url.clone())
            .map_err(|e| Error::invalid(format!("bad membership url {:?}: {e}", options.url)))?
            .connect_timeout(options.timeout.max(Duration::from_secs(1)))
            .tcp_nodelay(true);
        let answers = Cache::builder()
            .max_capacity(options.capacity)
            .expire_after(AnswerExpiry {
                member: options.member_ttl,
                not_member: options.not_member_ttl,
            })
            .build();
        Ok(Self {
            client: MembershipServiceClient::new(tls::channel(endpoint, tls)?),
            timeout: options.timeout,
            answers,
        })
    }

    async fn ask(&self, user: &str, conversation: &str) -> Result<bool, Error> {
        let mut request = tonic::Request::new(CheckMembershipRequest {
            user: user.to_owned(),
            conversation: conversation.to_owned(),
        });
        request.set_timeout(self.timeout);
        match self.client.clone().check_membership(request).await {
            Ok(reply) => Ok(reply.into_inner().member),
            Err(status) => {
                tracing::warn!(code = ?status.code(), message = status.message(), "membership service did not answer");
                Err(Error::unavailable(
                    "membership cannot be checked now; nothing was sent: retry",
                ))
            }
        }
    }
}

#[async_trait]
impl Membership for MembershipService {
    async fn is_member(&self, user: &Sender, conversation: &ConversationId) -> Result<bool, Error> {
        let key = (user.as_str().to_owned(), conversation.as_str().to_owned());
        // The question is only sent on a miss; a hit costs the key alone.
        self.answers
            .try_get_with(key, self.ask(user.as_str(), conversation.as_str()))
            .await
            .map_err(|e: Arc<Error>| (*e).clone())
    }
}

/// `imdedup.v1.MembershipService` answered from a groups file.
pub struct GroupsServer {
    groups: Arc<GroupsFile>,
}

impl GroupsServer {
    pub fn new(groups: GroupsFile) -> Self {
        Self {
            groups: Arc::new(groups),
        }
    }

    pub fn into_server(self) -> MembershipServiceServer<Self> {
        MembershipServiceServer::new(self)
    }
}

#[tonic::async_trait]
impl membership_service_server::MembershipService for GroupsServer {
    async fn check_membership(
        &self,
        request: tonic::Request<CheckMembershipRequest>,
    ) -> Result<tonic::Response<CheckMembershipResponse>, tonic::Status> {
        let request = request.into_inner();
        let user = Sender::parse(request.user).map_err(to_status)?;
        let conversation = ConversationId::parse(request.conversation).map_err(to_status)?;
        let member = self
            .groups
            .is_member(&user, &conversation)
            .await
            .map_err(to_status)?;
        Ok(tonic::Response::new(CheckMembershipResponse { member }))
    }
}

/// Serve [`GroupsServer`] (plus health, and reflection if `options` say so)
/// on `listener` until `shutdown` is cancelled.
pub async fn serve_groups(
    listener: tokio::net::TcpListener,
    groups: GroupsFile,
    options: imdedup_runtime::server::ServeOptions,
    shutdown: tokio_util::sync::CancellationToken,
) -> Result<(), tonic::transport::Error> {
    let routes = tonic::service::Routes::new(GroupsServer::new(groups).into_server());
    imdedup_runtime::server::serve_grpc(listener, &[SERVICE_NAME], routes, 1024, options, shutdown)
        .await
}
