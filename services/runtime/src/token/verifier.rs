//! The gateway's token check: the signature by `jsonwebtoken` against an
//! HS256 secret or a public key from a JWKS file (chosen by `kid`; several
//! keys may be active at once, so an identity provider can rotate them), and
//! then the policy: `exp` and `nbf` with a small leeway against the
//! service's clock, `iss` and `aud` when configured, a longest lifetime.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use jsonwebtoken::{
    Algorithm, DecodingKey, Validation,
    jwk::{AlgorithmParameters, EllipticCurve, Jwk, JwkSet},
};

use super::{Claims, TokenKey};
use crate::watched::WatchedFile;
use imdedup_domain::{Error, model::Sender};

/// What a token must satisfy besides its signature.
#[derive(Debug, Clone)]
pub struct TokenPolicy {
    /// Clock difference allowed on `exp` and `nbf`.
    pub leeway: Duration,
    /// Required `iss`, when set.
    pub issuer: Option<String>,
    /// Required `aud` (one of the token's), when set.
    pub audience: Option<String>,
    /// Longest lifetime: `exp` minus `iat` (or minus now, without `iat`).
    pub max_lifetime: Duration,
}

impl Default for TokenPolicy {
    fn default() -> Self {
        Self {
            leeway: Duration::from_secs(30),
            issuer: None,
            audience: None,
            max_lifetime: Duration::from_secs(24 * 3600),
        }
    }
}

/// A token that passed: its sender and expiry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    /// A phone token's user; a service token's system.
    pub sender: Sender,
    pub expires_at_unix: u64,
    /// Service tokens: the accounts the service may send as. `None` for a
    /// phone token.
    pub senders: Option<SenderScope>,
}

/// The accounts a service token may send as: its `senders` claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SenderScope {
    /// `"*"` in the claim: any account.
    Any,
    /// Exactly these accounts (none, for an empty claim).
    Only(Vec<Sender>),
}

impl SenderScope {
    fn parse(senders: Vec<String>) -> Result<Self, Error> {
        if senders.iter().any(|s| s == "*") {
            return Ok(Self::Any);
        }
        senders
            .into_iter()
            .map(|s| {
                Sender::parse(s).map_err(|e| refused(format!("token senders: {}", e.message())))
            })
            .collect::<Result<_, _>>()
            .map(Self::Only)
    }

    /// Whether `sender` is in the scope.
    pub fn allows(&self, sender: &Sender) -> bool {
        match self {
            Self::Any => true,
            Self::Only(senders) => senders.contains(sender),
        }
    }
}

/// Which kind of token a verifier accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// Phone tokens: no `senders` claim.
    Phone,
    /// Service tokens: a `senders` claim.
    Service,
}

/// Public keys by `kid`, each with the one algorithm it verifies.
type Keys = HashMap<String, (Algorithm, DecodingKey)>;

/// The public keys of a JWKS file (`{"keys": [...]}`), read again when the
/// file changes.
pub struct Jwks(WatchedFile<Keys>);

impl std::fmt::Debug for Jwks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Jwks({})", self.0.path().display())
    }
}

impl Jwks {
    pub fn open(path: impl Into<PathBuf>) -> Result<Self, Error> {
        WatchedFile::open(path, read_jwks).map(Self)
    }
}

fn read_jwks(path: &Path) -> Result<Keys, Error> {
    let what = || format!("JWKS file {}", path.display());
    let text =
        std::fs::read(path).map_err(|e| Error::invalid(format!("cannot read {}: {e}", what())))?;
    let set: JwkSet = serde_json::from_slice(&text)
        .map_err(|e| Error::invalid(format!("{} is not a JWK set: {e}", what())))?;
    let mut keys = Keys::new();
    for jwk in &set.keys {
        let kid = jwk.common.key_id.clone().ok_or_else(|| {
            Error::invalid(format!(
                "{}: every key needs a kid, to be chosen by",
                what()
            ))
        })?;
        let algorithm = algorithm_of(jwk).ok_or_else(|| {
            Error::invalid(format!(
                "{}: key {kid:?} is not an RS256, ES256 or EdDSA public key",
                what()
            ))
        })?;
        let key = DecodingKey::from_jwk(jwk)
            .map_err(|e| Error::invalid(format!("{}: key {kid:?}: {e}", what())))?;
        if keys.insert(kid.clone(), (algorithm, key)).is_some() {
            return Err(Error::invalid(format!(
                "{}: two keys have kid {kid:?}",
                what()
            )));
        }
    }
    Ok(keys)
}

/// The algorithm a public key verifies: its `alg`, or else its kind.
/// Symmetric keys have no place in a JWKS file the gateway reads.
fn algorithm_of(jwk: &Jwk) -> Option<Algorithm> {
    let inferred = match &jwk.algorithm {
        AlgorithmParameters::RSA(_) => Algorithm::RS256,
        AlgorithmParameters::EllipticCurve(ec) if ec.curve == EllipticCurve::P256 => {
            Algorithm::ES256
        }
        AlgorithmParameters::EllipticCurve(ec) if ec.curve == EllipticCurve::P384 => {
            Algorithm::ES384
        }
        AlgorithmParameters::OctetKeyPair(_) => Algorithm::EdDSA,
        _ => return None,
    };
    match jwk.common.key_algorithm {
        None => Some(inferred),
        Some(declared) => Algorithm::try_from(declared)
            .ok()
            .filter(|a| a.family() == inferred.family()),
    }
}

/// Verifies the tokens phones connect with.
#[derive(Clone)]
pub struct TokenVerifier {
    hs256: Option<DecodingKey>,
    jwks: Option<Arc<Jwks>>,
    policy: TokenPolicy,
    role: Role,
}

impl std::fmt::Debug for TokenVerifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenVerifier")
            .field("hs256", &self.hs256.as_ref().map(|_| ".."))
            .field("jwks", &self.jwks.as_ref().map(|j| j.0.path().to_owned()))
            .field("policy", &self.policy)
            .field("role", &self.role)
            .finish()
    }
}

fn refused(reason: impl Into<String>) -> Error {
    Error::unauthenticated(reason)
}

impl TokenVerifier {
    /// HS256 tokens signed with `key`, under the default policy.
    pub fn hs256(key: TokenKey) -> Self {
        Self::new(Some(key), None, TokenPolicy::default()).expect("one key is given")
    }

    /// Tokens signed with `hs256` and/or by a key of `jwks`.
    pub fn new(
        hs256: Option<TokenKey>,
        jwks: Option<Jwks>,
        policy: TokenPolicy,
    ) -> Result<Self, Error> {
        if hs256.is_none() && jwks.is_none() {
            return Err(Error::invalid(
                "tokens need a secret (HS256) or a JWKS file, or both",
            ));
        }
        Ok(Self {
            hs256: hs256.map(|k| k.decoding_key().clone()),
            jwks: jwks.map(Arc::new),
            policy,
            role: Role::Phone,
        })
    }

    /// The same keys and policy, for service tokens (the business API):
    /// only tokens with a `senders` claim pass. A phone verifier refuses
    /// them, and this one refuses phone tokens.
    pub fn for_services(mut self) -> Self {
        self.role = Role::Service;
        self
    }

    /// The sender named by a genuine token that the policy accepts now.
    pub fn verify(&self, token: &str, now_unix: u64) -> Result<Verified, Error> {
        let header =
            jsonwebtoken::decode_header(token).map_err(|_| refused("token is not a JWT"))?;
        let keys;
        let (algorithm, key) = match header.alg {
            Algorithm::HS256 => (
                Algorithm::HS256,
                self.hs256
                    .as_ref()
                    .ok_or_else(|| refused("HS256 tokens are not accepted here"))?,
            ),
            alg => {
                let jwks = self
                    .jwks
                    .as_ref()
                    .ok_or_else(|| refused(format!("{alg:?} tokens are not accepted here")))?;
                let kid = header
                    .kid
                    .as_deref()
                    .ok_or_else(|| refused("token has no kid"))?;
                keys = jwks.0.get();
                let (algorithm, key) = keys
                    .get(kid)
                    .ok_or_else(|| refused("token's kid names no known key"))?;
                if *algorithm != alg {
                    return Err(refused("token's algorithm is not its key's"));
                }
                (*algorithm, key)
            }
        };
        let claims = jsonwebtoken::decode::<Claims>(token, key, &self.validation(algorithm))
            .map_err(|e| refused(format!("token refused: {e}")))?
            .claims;
        self.check_times(&claims, now_unix)?;
        let senders = match (self.role, claims.senders) {
            (Role::Phone, None) => None,
            (Role::Phone, Some(_)) => {
                return Err(refused(
                    "a service token (it has a senders claim) cannot connect as a phone",
                ));
            }
            (Role::Service, Some(senders)) => Some(SenderScope::parse(senders)?),
            (Role::Service, None) => {
                return Err(refused(
                    "not a service token: it has no senders claim (a phone token cannot use the business API)",
                ));
            }
        };
        let sender = Sender::parse(claims.sub)
            .map_err(|e| refused(format!("token subject: {}", e.message())))?;
        Ok(Verified {
            sender,
            expires_at_unix: claims.exp,
            senders,
        })
    }

    /// The library checks signature, algorithm, `iss` and `aud`; times are
    /// checked against the service's clock, so tests can move it.
    fn validation(&self, algorithm: Algorithm) -> Validation {
        let mut validation = Validation::new(algorithm);
        validation.validate_exp = false;
        validation.validate_nbf = false;
        let mut required = vec!["exp", "sub"];
        match &self.policy.issuer {
            Some(issuer) => {
                validation.set_issuer(&[issuer]);
                required.push("iss");
            }
            None => validation.iss = None,
        }
        match &self.policy.audience {
            Some(audience) => {
                validation.set_audience(&[audience]);
                required.push("aud");
            }
            None => validation.validate_aud = false,
        }
        validation.set_required_spec_claims(&required);
        validation
    }

    fn check_times(&self, claims: &Claims, now: u64) -> Result<(), Error> {
        let leeway = self.policy.leeway.as_secs();
        if claims.exp.saturating_add(leeway) <= now {
            return Err(refused("token has expired"));
        }
        if claims
            .nbf
            .is_some_and(|nbf| nbf > now.saturating_add(leeway))
        {
            return Err(refused("token is not valid yet"));
        }
        let from = claims.iat.unwrap_or(now).min(now.saturating_add(leeway));
        let lifetime = claims.exp.saturating_sub(from);
        if lifetime > self.policy.max_lifetime.as_secs().saturating_add(leeway) {
            return Err(refused(format!(
                "token lives {lifetime} s, longer than the {} s allowed",
                self.policy.max_lifetime.as_secs()
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aws_lc_rs::{
        rand::SystemRandom,
        signature::{ECDSA_P256_SHA256_FIXED_SIGNING, EcdsaKeyPair, Ed25519KeyPair, KeyPair},
    };
    use base64::{Engine, engine::general_purpose::URL_SAFE_NO_PAD};
    use imdedup_domain::ErrorKind;
    use jsonwebtoken::{EncodingKey, Header};
    use serde_json::json;

    const NOW: u64 = 1_800_000_000;

    fn secret() -> TokenKey {
        TokenKey::new("a-test-secret-of-at-least-32-bytes!!").unwrap()
    }

    fn sign(header: Header, claims: serde_json::Value, key: &EncodingKey) -> String {
        jsonwebtoken::encode(&header, &claims, key).unwrap()
    }

    fn hs(claims: serde_json::Value) -> String {
        let key = EncodingKey::from_secret(b"a-test-secret-of-at-least-32-bytes!!").unwrap();
        sign(Header::new(Algorithm::HS256), claims, &key)
    }

    fn kind(result: Result<Verified, Error>) -> ErrorKind {
        result.unwrap_err().kind()
    }

    #[test]
    fn times_are_checked_with_a_small_leeway_and_a_longest_lifetime() {
        let verifier = TokenVerifier::hs256(secret());
        let ok = hs(json!({"sub": "ana", "exp": NOW + 600, "iat": NOW}));
        assert_eq!(verifier.verify(&ok, NOW).unwrap().sender.as_str(), "ana");
        // Just expired, within the 30 s leeway: still accepted; beyond: not.
        let expired = hs(json!({"sub": "ana", "exp": NOW - 10}));
        assert!(verifier.verify(&expired, NOW).is_ok());
        assert_eq!(
            kind(verifier.verify(&expired, NOW + 40)),
            ErrorKind::Unauthenticated
        );
        let early = hs(json!({"sub": "ana", "exp": NOW + 600, "nbf": NOW + 120}));
        let error = verifier.verify(&early, NOW).unwrap_err();
        assert!(error.message().contains("not valid yet"), "{error}");
        let forever = hs(json!({"sub": "ana", "exp": NOW + 30 * 86_400, "iat": NOW}));
        let error = verifier.verify(&forever, NOW).unwrap_err();
        assert!(error.message().contains("longer than"), "{error}");
        let no_subject = hs(json!({"exp": NOW + 600}));
        assert_eq!(
            kind(verifier.verify(&no_subject, NOW)),
            ErrorKind::Unauthenticated
        );
    }

    #[test]
    fn phone_and_service_tokens_are_told_apart_by_the_senders_claim() {
        // One secret for both, the worst case: the claim still decides.
        let phones = TokenVerifier::hs256(secret());
        let services = TokenVerifier::hs256(secret()).for_services();
        let phone = hs(json!({"sub": "ana", "exp": NOW + 600}));
        let service =
            hs(json!({"sub": "orders", "exp": NOW + 600, "senders": ["orders-bot", "ana"]}));
        let any = hs(json!({"sub": "notify", "exp": NOW + 600, "senders": ["*"]}));
        assert!(phones.verify(&phone, NOW).unwrap().senders.is_none());
        let refused = phones.verify(&service, NOW).unwrap_err();
        assert_eq!(refused.kind(), ErrorKind::Unauthenticated);
        assert!(refused.message().contains("service token"), "{refused}");
        let refused = services.verify(&phone, NOW).unwrap_err();
        assert_eq!(refused.kind(), ErrorKind::Unauthenticated);
        assert!(refused.message().contains("no senders claim"), "{refused}");

        let verified = services.verify(&service, NOW).unwrap();
        assert_eq!(verified.sender.as_str(), "orders");
        let scope = verified.senders.unwrap();
        let user = |name: &str| Sender::parse(name).unwrap();
        assert!(scope.allows(&user("orders-bot")) && scope.allows(&user("ana")));
        assert!(!scope.allows(&user("ben")));
        assert!(
            !scope.allows(&user("orders")),
            "the system is not its own sender"
        );
        let scope = services.verify(&any, NOW).unwrap().senders.unwrap();
        assert_eq!(scope, SenderScope::Any);
        assert!(scope.allows(&user("ben")));
        // A sender that is not a valid account name spoils the token.
        let bad = hs(json!({"sub": "orders", "exp": NOW + 600, "senders": [""]}));
        assert_eq!(kind(services.verify(&bad, NOW)), ErrorKind::Unauthenticated);
        // Service tokens live no longer than phone tokens.
        let forever = hs(json!({"sub": "orders", "exp": NOW + 30 * 86_400, "senders": ["*"]}));
        assert_eq!(
            kind(services.verify(&forever, NOW)),
            ErrorKind::Unauthenticated
        );
    }

    #[test]
    fn issuer_and_audience_are_required_when_configured() {
        let policy = TokenPolicy {
            issuer: Some("https://id.example".into()),
            audience: Some("imdedup".into()),
            ..TokenPolicy::default()
        };
        let verifier = TokenVerifier::new(Some(secret()), None, policy).unwrap();
        let good = hs(
            json!({"sub": "ana", "exp": NOW + 60, "iss": "https://id.example", "aud": ["other", "imdedup"]}),
        );
        verifier.verify(&good, NOW).unwrap();
        for claims in [
            json!({"sub": "ana", "exp": NOW + 60, "aud": "imdedup"}),
            json!({"sub": "ana", "exp": NOW + 60, "iss": "https://evil.example", "aud": "imdedup"}),
            json!({"sub": "ana", "exp": NOW + 60, "iss": "https://id.example", "aud": "other"}),
        ] {
            assert_eq!(
                kind(verifier.verify(&hs(claims.clone()), NOW)),
                ErrorKind::Unauthenticated,
                "{claims}"
            );
        }
    }

    /// A JWKS file of an Ed25519 key ("ed-1") and a P-256 key ("ec-1"), and
    /// their signing keys.
    fn jwks(dir: &Path) -> (PathBuf, EncodingKey, EncodingKey) {
        let rng = SystemRandom::new();
        let ed = Ed25519KeyPair::generate_pkcs8(&rng).unwrap();
        let ed_public = Ed25519KeyPair::from_pkcs8(ed.as_ref())
            .unwrap()
            .public_key()
            .as_ref()
            .to_vec();
        let ec = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &rng).unwrap();
        let ec_public = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, ec.as_ref())
            .unwrap()
            .public_key()
            .as_ref()
            .to_vec();
        let b64 = |bytes: &[u8]| URL_SAFE_NO_PAD.encode(bytes);
        let set = json!({"keys": [
            {"kty": "OKP", "crv": "Ed25519", "kid": "ed-1", "x": b64(&ed_public)},
            {"kty": "EC", "crv": "P-256", "kid": "ec-1", "alg": "ES256",
             "x": b64(&ec_public[1..33]), "y": b64(&ec_public[33..])},
        ]});
        let path = dir.join("jwks.json");
        std::fs::write(&path, set.to_string()).unwrap();
        (
            path,
            EncodingKey::from_ed_der(ed.as_ref()),
            EncodingKey::from_ec_der(ec.as_ref()),
        )
    }

    fn with_kid(alg: Algorithm, kid: &str) -> Header {
        let mut header = Header::new(alg);
        header.kid = Some(kid.to_owned());
        header
    }

    #[test]
    fn public_key_tokens_are_verified_by_the_key_their_kid_names() {
        let dir = tempfile::tempdir().unwrap();
        let (path, ed, ec) = jwks(dir.path());
        let verifier = TokenVerifier::new(
            None,
            Some(Jwks::open(&path).unwrap()),
            TokenPolicy::default(),
        )
        .unwrap();
        let claims = json!({"sub": "ana", "exp": NOW + 600});
        // Two keys active at once, as during a rotation.
        let by_ed = sign(with_kid(Algorithm::EdDSA, "ed-1"), claims.clone(), &ed);
        let by_ec = sign(with_kid(Algorithm::ES256, "ec-1"), claims.clone(), &ec);
        assert_eq!(verifier.verify(&by_ed, NOW).unwrap().sender.as_str(), "ana");
        assert_eq!(verifier.verify(&by_ec, NOW).unwrap().sender.as_str(), "ana");
        // A kid naming the other key, an unknown kid, no kid, an HS256 token
        // where no secret is configured: all refused.
        let wrong_key = sign(with_kid(Algorithm::EdDSA, "ec-1"), claims.clone(), &ed);
        let unknown = sign(with_kid(Algorithm::EdDSA, "ed-2"), claims.clone(), &ed);
        let no_kid = sign(Header::new(Algorithm::EdDSA), claims.clone(), &ed);
        for token in [wrong_key, unknown, no_kid, hs(claims)] {
            assert_eq!(
                kind(verifier.verify(&token, NOW)),
                ErrorKind::Unauthenticated
            );
        }
    }

    #[test]
    fn a_jwks_file_without_kids_or_with_a_secret_key_is_refused_at_start() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("jwks.json");
        std::fs::write(
            &path,
            r#"{"keys": [{"kty": "oct", "kid": "s", "k": "c2VjcmV0"}]}"#,
        )
        .unwrap();
        assert!(Jwks::open(&path).is_err());
        std::fs::write(
            &path,
            r#"{"keys": [{"kty": "OKP", "crv": "Ed25519", "x": "AAAA"}]}"#,
        )
        .unwrap();
        assert!(Jwks::open(&path).unwrap_err().message().contains("kid"));
        assert!(TokenVerifier::new(None, None, TokenPolicy::default()).is_err());
    }
}
