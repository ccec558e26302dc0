//! Connection tokens: JWTs naming the sender in `sub`, verified with a
//! well-kept JWT library (`jsonwebtoken`).
//!
//! [`TokenKey`] is a shared HS256 secret; it mints tokens for local runs,
//! tests and the load driver, and verifies them. [`TokenVerifier`] is what
//! the gateway runs: an HS256 secret and/or public keys from a JWKS file
//! (RS256, ES256, EdDSA, chosen by the token's `kid`), with the policy of
//! [`TokenPolicy`] (leeway, issuer, audience, longest lifetime).
//!
//! The sender of every message is taken from the verified token, never from
//! a frame, so nobody can send as another user or touch their dedup keys.
//!
//! Service tokens, for the business API, are the same JWTs with one more
//! claim, `senders`: the accounts the system (`sub`) may send as (`"*"`:
//! any). A verifier is for phones or for services
//! ([`TokenVerifier::for_services`]) and refuses the other kind by that
//! claim, so even one secret for both cannot turn one into the other.

mod verifier;

use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header};
use serde::{Deserialize, Serialize};

pub use verifier::{Jwks, SenderScope, TokenPolicy, TokenVerifier, Verified};

use imdedup_domain::{Error, model::Sender};

/// The shortest HS256 secret accepted, in bytes (RFC 7518: at least the
/// hash's size).
pub const MIN_SECRET_BYTES: usize = 32;

/// The claims imdedup reads. Others are ignored.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Claims {
    pub sub: String,
    pub exp: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbf: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iat: Option<u64>,
    /// Service tokens only: the accounts the service may send as.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub senders: Option<Vec<String>>,
}

/// One shared HS256 secret: mints tokens and verifies them.
#[derive(Clone)]
pub struct TokenKey {
    encoding: EncodingKey,
    decoding: DecodingKey,
}

impl std::fmt::Debug for TokenKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenKey(..)")
    }
}

impl TokenKey {
    pub fn new(secret: impl Into<Vec<u8>>) -> Result<Self, Error> {
        let secret = secret.into();
        if secret.len() < MIN_SECRET_BYTES {
            return Err(Error::invalid(format!(
                "token secret must be at least {MIN_SECRET_BYTES} bytes"
            )));
        }
        let invalid = |e: jsonwebtoken::errors::Error| Error::invalid(format!("token secret: {e}"));
        Ok(Self {
            encoding: EncodingKey::from_secret(&secret).map_err(invalid)?,
            decoding: DecodingKey::from_secret(&secret).map_err(invalid)?,
        })
    }

    pub(crate) fn decoding_key(&self) -> &DecodingKey {
        &self.decoding
    }

    /// A token for `sender` that expires at `exp` (Unix seconds).
    pub fn mint(&self, sender: &Sender, exp: u64) -> String {
        let claims = Claims {
            sub: sender.as_str().to_owned(),
            exp,
            nbf: None,
            iat: None,
            senders: None,
        };
        self.sign(&claims)
    }

    /// A service token for the system `service` that may send as each of
    /// `senders` (`"*"`: any account), expiring at `exp` (Unix seconds).
    pub fn mint_service(&self, service: &Sender, senders: &[String], exp: u64) -> String {
        let claims = Claims {
            sub: service.as_str().to_owned(),
            exp,
            nbf: None,
            iat: None,
            senders: Some(senders.to_vec()),
        };
        self.sign(&claims)
    }

    fn sign(&self, claims: &Claims) -> String {
        jsonwebtoken::encode(&Header::new(Algorithm::HS256), claims, &self.encoding)
            // Only a key of another family than the header's can fail.
            .expect("an HS256 key signs an HS256 header")
    }

    /// The sender named by a genuine, unexpired token, and its expiry, with
    /// the default policy.
    pub fn verify(&self, token: &str, now_unix: u64) -> Result<(Sender, u64), Error> {
        let verified = TokenVerifier::hs256(self.clone()).verify(token, now_unix)?;
        Ok((verified.sender, verified.expires_at_unix))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::{Engine, engine::general_purpose::URL_SAFE_NO_PAD};
    use imdedup_domain::ErrorKind;

    fn key() -> TokenKey {
        TokenKey::new("0123456789abcdef0123456789abcdef-test").unwrap()
    }

    #[test]
    fn a_minted_token_names_its_sender() {
        let ana = Sender::parse("ana").unwrap();
        let token = key().mint(&ana, 2_000);
        assert_eq!(key().verify(&token, 1_000).unwrap(), (ana, 2_000));
    }

    #[test]
    fn expired_forged_and_garbled_tokens_are_refused() {
        let ana = Sender::parse("ana").unwrap();
        let token = key().mint(&ana, 2_000);
        // Past its expiry and the leeway.
        let expired = key().verify(&token, 2_100).unwrap_err();
        assert_eq!(expired.kind(), ErrorKind::Unauthenticated);
        assert!(expired.message().contains("expired"), "{expired}");

        let other = TokenKey::new("another-secret-of-thirty-two-bytes!").unwrap();
        assert!(other.verify(&token, 1_000).is_err());

        // Swap in claims for another user, keeping the signature.
        let forged_claims = URL_SAFE_NO_PAD.encode(br#"{"sub":"ben","exp":2000}"#);
        let mut parts: Vec<&str> = token.split('.').collect();
        parts[1] = &forged_claims;
        assert!(key().verify(&parts.join("."), 1_000).is_err());

        for garbage in ["", "a.b", "a.b.c.d", "!!.??.**"] {
            assert_eq!(
                key().verify(garbage, 1_000).unwrap_err().kind(),
                ErrorKind::Unauthenticated
            );
        }
    }

    #[test]
    fn secrets_shorter_than_32_bytes_are_refused() {
        assert!(TokenKey::new("short").is_err());
        assert!(TokenKey::new(vec![b'x'; 31]).is_err());
        assert!(TokenKey::new(vec![b'x'; 32]).is_ok());
    }

    #[test]
    fn the_key_never_shows_in_debug_output() {
        let shown = format!("{:?}", key());
        assert!(!shown.contains("0123456789abcdef"), "{shown}");
    }
}
