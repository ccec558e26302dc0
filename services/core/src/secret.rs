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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_shows_in_neither_debug_nor_display() {
        let secret: Secret = "hunter2-but-longer".parse().unwrap();
        assert_eq!(secret.expose(), "hunter2-but-longer");
        let shown = format!("{secret:?} {secret} {:?}", Some(&secret));
        assert!(!shown.contains("hunter2"), "{shown}");
    }
}
