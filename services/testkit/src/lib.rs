//! What imdedup's tests and test tools share: the policy for real backends
//! ([`backends`]), domain values built from strings ([`fixtures`]), the
//! store and window contracts as suites every backend runs
//! ([`conformance`]), the reader of the services' metrics text ([`prom`]),
//! processes a test starts itself ([`process`]), and an OTLP trace receiver
//! (`otlp`, feature `otlp`). Never a dependency of a service.

pub mod backends;
pub mod conformance;
pub mod fixtures;
#[cfg(feature = "otlp")]
pub mod otlp;
pub mod process;
pub mod prom;
