//! A secret given on the command line or in the environment: usable where
//! it is needed, shown nowhere else (`Debug` and `Display` print a
//! placeholder), so a config dump or a log line cannot leak it.

use std::{convert::Infallible, fmt, str::FromStr};

#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The secret itself, for the one place that uses it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("..")
    }
}

impl FromStr for Secret {
    type Err = Infallible;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Self::new(s))
    }
}

/// `url` with the password of its user info replaced (`redis://u:pw@h` ->
/// `redis://u:..@h`), for logs and banners.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    // The user info ends at the last '@' before the path.
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let Some(at) = rest[..authority_end].rfind('@') else {
        return url.to_owned();
    };
    let user = rest[..at]
        .split_once(':')
        .map_or(&rest[..at], |(user, _)| user);
    let hidden = if rest[..at].contains(':') { ":.." } else { "" };
    format!("{scheme}://{user}{hidden}{}", &rest[at..])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_password_in_a_url_is_hidden_and_the_rest_kept() {
        assert_eq!(
            redact_url("redis://app:s3cr3t@redis-0:6379/2"),
            "redis://app:..@redis-0:6379/2"
        );
        assert_eq!(redact_url("rediss://:pw@h:6380"), "rediss://:..@h:6380");
        assert_eq!(redact_url("redis://h:6379"), "redis://h:6379");
        assert_eq!(redact_url("redis://a:b@c@h:1"), "redis://a:..@h:1");
        assert_eq!(redact_url("not a url"), "not a url");
    }

    #[test]
    fn a_secret_shows_in_neither_debug_nor_display() {
        let secret: Secret = "hunter2-but-longer".parse().unwrap();
        assert_eq!(secret.expose(), "hunter2-but-longer");
        let shown = format!("{secret:?} {secret} {:?}", Some(&secret));
        assert!(!shown.contains("hunter2"), "{shown}");
    }
}
