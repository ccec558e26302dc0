//! Connection tokens: compact JWTs signed with HMAC-SHA256 (`alg: HS256`),
//! carrying the sender in `sub` and an expiry in `exp` (Unix seconds). Any
//! JWT library can mint them; the gateway only verifies.
//!
//! The sender of every message is taken from the verified token, never from
//! a frame, so nobody can send as another user or touch their dedup keys.

use base64::{Engine, engine::general_purpose::URL_SAFE_NO_PAD};
use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use crate::{Error, model::Sender};

type HmacSha256 = Hmac<Sha256>;

/// The shortest secret accepted, in bytes.
pub const MIN_SECRET_BYTES: usize = 16;

#[derive(Serialize, Deserialize)]
struct Header {
    alg: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    typ: Option<String>,
}

#[derive(Serialize, Deserialize)]
struct Claims {
    sub: String,
    exp: u64,
}

/// Mints and verifies tokens with one shared secret.
#[derive(Clone)]
pub struct TokenKey {
    secret: Vec<u8>,
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
        Ok(Self { secret })
    }

    fn mac(&self) -> HmacSha256 {
        // HMAC takes a key of any length; this cannot fail.
        HmacSha256::new_from_slice(&self.secret).expect("hmac accepts any key length")
    }

    /// A token for `sender` that expires at `exp` (Unix seconds).
    pub fn mint(&self, sender: &Sender, exp: u64) -> String {
        let header = URL_SAFE_NO_PAD.encode(br#"{"alg":"HS256","typ":"JWT"}"#);
        let claims = serde_json::to_vec(&Claims {
            sub: sender.as_str().to_owned(),
            exp,
        })
        .unwrap_or_default();
        let signing_input = format!("{header}.{}", URL_SAFE_NO_PAD.encode(claims));
        let mut mac = self.mac();
        mac.update(signing_input.as_bytes());
        let signature = URL_SAFE_NO_PAD.encode(mac.finalize().into_bytes());
        format!("{signing_input}.{signature}")
    }

    /// The sender named by a genuine, unexpired token, and its expiry.
    pub fn verify(&self, token: &str, now_unix: u64) -> Result<(Sender, u64), Error> {
        let mut parts = token.split('.');
        let (Some(header), Some(claims), Some(signature), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(Error::unauthenticated("token is not a compact JWT"));
        };
        let signature = URL_SAFE_NO_PAD
            .decode(signature)
            .map_err(|_| Error::unauthenticated("token signature is not base64url"))?;
        let mut mac = self.mac();
        mac.update(header.as_bytes());
        mac.update(b".");
        mac.update(claims.as_bytes());
        mac.verify_slice(&signature)
            .map_err(|_| Error::unauthenticated("token signature does not match"))?;

        let header: Header = decode_part(header)?;
        if header.alg != "HS256" {
            return Err(Error::unauthenticated(format!(
                "token algorithm {} is not HS256",
                header.alg
            )));
        }
        let claims: Claims = decode_part(claims)?;
        if claims.exp <= now_unix {
            return Err(Error::unauthenticated("token has expired"));
        }
        let sender = Sender::parse(claims.sub)
            .map_err(|e| Error::unauthenticated(format!("token subject: {}", e.message())))?;
        Ok((sender, claims.exp))
    }
}

fn decode_part<T: for<'de> Deserialize<'de>>(part: &str) -> Result<T, Error> {
    let bytes = URL_SAFE_NO_PAD
        .decode(part)
        .map_err(|_| Error::unauthenticated("token part is not base64url"))?;
    serde_json::from_slice(&bytes)
        .map_err(|e| Error::unauthenticated(format!("token part is not the expected JSON: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    fn key() -> TokenKey {
        TokenKey::new("0123456789abcdef-test").unwrap()
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
        let expired = key().verify(&token, 2_000).unwrap_err();
        assert_eq!(expired.kind(), ErrorKind::Unauthenticated);
        assert!(expired.message().contains("expired"));

        let other = TokenKey::new("another-secret-of-16").unwrap();
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
    fn short_secrets_are_refused() {
        assert!(TokenKey::new("short").is_err());
    }
}
