//! Logs and traces for a process: the `fmt` log on stderr as always, and
//! OpenTelemetry traces over OTLP/gRPC when the standard `OTEL_*` environment
//! variables ask for them; plus the W3C trace context that makes one send one
//! trace across gateway, ingest and storage.
//!
//! # Turning traces on
//!
//! [`init`] exports spans when `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or
//! `OTEL_EXPORTER_OTLP_ENDPOINT` is set, or `OTEL_TRACES_EXPORTER=otlp`
//! (then to `http://localhost:4317`). `OTEL_TRACES_EXPORTER=none` or
//! `OTEL_SDK_DISABLED=true` keep it off. The SDK reads the rest:
//! `OTEL_SERVICE_NAME` (else the default the binary passes, e.g.
//! `imdedup-ingest`), `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER[_ARG]`,
//! `OTEL_BSP_*`, `OTEL_EXPORTER_OTLP_[TRACES_]{HEADERS,TIMEOUT,COMPRESSION}`.
//! Only the gRPC protocol is built in: another `OTEL_EXPORTER_OTLP_PROTOCOL`
//! is refused at start. Traces take the spans at INFO and above, whatever
//! `RUST_LOG` says (which still decides the log).
//!
//! # The log takes events, not spans
//!
//! The `fmt` log writes events only: a log line carries its own fields, not
//! the fields of the spans around it. A span the log took would be built,
//! its fields formatted into a string and entered on every poll for every
//! send on every hop: in a profile of `imdedup dev` at 3,000 msgs/s that
//! was 5% of the process's CPU (tracing and its span slab), against under
//! 2% without. With traces off no layer wants the spans, and
//! `#[instrument]` costs next to nothing; with traces on, the
//! OpenTelemetry layer takes them.
//!
//! # Carrying a send's trace between services
//!
//! Every helper reads or writes the W3C `traceparent` / `tracestate` of the
//! *current* tracing span, and does nothing when traces are off.
//!
//! - Unary call, client side: inside the span of the work,
//!   `inject_metadata(request.metadata_mut())`.
//! - Unary call, server side: nothing to do. [`serve_grpc`] serves every
//!   call inside a server span (`imdedup.v1.IngestService/Send`, with
//!   `rpc.*` attributes and the gRPC status) whose parent comes from the
//!   call's metadata ([`GrpcServerTraceLayer`]).
//! - A batch (one call, many sends): the client takes [`trace_context`]
//!   inside each send's span and puts the map in that send's
//!   `trace_context` field; the server continues each send from its own map:
//!
//!   ```ignore
//!   use tracing::Instrument;
//!   let span = tracing::info_span!("imdedup.ingest.send");
//!   telemetry::set_parent(&span, telemetry::extract_map(&item.trace_context));
//!   dedup.send(message).instrument(span).await
//!   ```
//!
//! [`set_parent`] must come before the span is entered or has children.
//!
//! [`serve_grpc`]: crate::server::serve_grpc

use std::{
    collections::HashMap,
    future::Future,
    pin::Pin,
    task::{Context as TaskContext, Poll},
};

use opentelemetry::{
    global,
    propagation::{Extractor, Injector},
    trace::{TraceContextExt, TracerProvider as _},
};
use opentelemetry_sdk::{Resource, propagation::TraceContextPropagator, trace::SdkTracerProvider};
use tonic::{
    codegen::http::{self, HeaderMap, HeaderName, HeaderValue},
    metadata::MetadataMap,
};
use tracing::{Instrument, Span, level_filters::LevelFilter};
use tracing_subscriber::{
    EnvFilter, Layer,
    filter::{FilterExt, Targets, filter_fn},
    layer::SubscriberExt,
    util::SubscriberInitExt,
};

pub use opentelemetry::Context;
pub use tracing_opentelemetry::OpenTelemetrySpanExt;

/// Why [`init`] failed.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("{0}")]
    Config(String),
    #[error("cannot build the OTLP span exporter: {0}")]
    Exporter(#[from] opentelemetry_otlp::ExporterBuildError),
    #[error("cannot install the tracing subscriber: {0}")]
    Subscriber(#[from] tracing_subscriber::util::TryInitError),
}

/// What the `OTEL_*` variables ask of [`init`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OtelConfig {
    /// Export spans over OTLP/gRPC.
    pub export: bool,
    /// `service.name` is set by `OTEL_SERVICE_NAME` or
    /// `OTEL_RESOURCE_ATTRIBUTES`, so the caller's default is not used.
    pub service_name_from_env: bool,
}

impl OtelConfig {
    /// Read the configuration through `get` (the process environment in
    /// [`init`], a map in tests).
    pub fn read(get: impl Fn(&str) -> Option<String>) -> Result<Self, TelemetryError> {
        let var = |name: &str| {
            get(name)
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty())
        };
        let service_name_from_env = var("OTEL_SERVICE_NAME").is_some()
            || var("OTEL_RESOURCE_ATTRIBUTES").is_some_and(|attrs| {
                attrs
                    .split(',')
                    .any(|kv| kv.split('=').next().map(str::trim) == Some("service.name"))
            });
        let off = Self {
            export: false,
            service_name_from_env,
        };
        if var("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
            return Ok(off);
        }
        let exporter = var("OTEL_TRACES_EXPORTER").map(|v| v.to_ascii_lowercase());
        let export = match exporter.as_deref() {
            Some("none") => return Ok(off),
            Some("otlp") => true,
            Some(other) => {
                return Err(TelemetryError::Config(format!(
                    "OTEL_TRACES_EXPORTER={other:?} is not supported: use otlp or none"
                )));
            }
            None => {
                var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_some()
                    || var("OTEL_EXPORTER_OTLP_ENDPOINT").is_some()
            }
        };
        if !export {
            return Ok(off);
        }
        let protocol = var("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            .or_else(|| var("OTEL_EXPORTER_OTLP_PROTOCOL"));
        if let Some(protocol) = protocol.filter(|p| p != "grpc") {
            return Err(TelemetryError::Config(format!(
                "OTEL_EXPORTER_OTLP_PROTOCOL={protocol:?} is not supported: only grpc is"
            )));
        }
        Ok(Self {
            export: true,
            service_name_from_env,
        })
    }
}

/// Owns the span exporter; flush and stop it with [`Telemetry::shutdown`]
/// before the runtime stops (dropping it does the same, blocking).
#[must_use = "dropping it stops exporting spans"]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Whether spans are exported.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Export the spans still queued, then stop the exporter.
    pub async fn shutdown(mut self) {
        if let Some(provider) = self.provider.take() {
            let _ = tokio::task::spawn_blocking(move || stop(&provider)).await;
        }
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        let Some(provider) = self.provider.take() else {
            return;
        };
        // The exporter's gRPC connection lives on the runtime: let it run.
        match tokio::runtime::Handle::try_current() {
            Ok(handle) if handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
                tokio::task::block_in_place(|| stop(&provider));
            }
            _ => stop(&provider),
        }
    }
}

fn stop(provider: &SdkTracerProvider) {
    if let Err(e) = provider.shutdown() {
        tracing::warn!(error = %e, "span exporter did not shut down cleanly");
    }
}

/// Install the process's subscriber: the `fmt` log of events on stderr
/// filtered by `RUST_LOG` (else `default_filter`), and, when the `OTEL_*` variables ask
/// for it (see the module docs), span export over OTLP/gRPC with a batch
/// processor, `service.name` = `OTEL_SERVICE_NAME` or `default_service_name`,
/// and the W3C trace-context propagator.
///
/// Call it inside the Tokio runtime: the exporter's connection runs on it.
pub fn init(default_service_name: &str, default_filter: &str) -> Result<Telemetry, TelemetryError> {
    let config = OtelConfig::read(|name| std::env::var(name).ok())?;
    let log_filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let provider = if config.export {
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .build()?;
        let mut resource = Resource::builder();
        if !config.service_name_from_env {
            resource = resource.with_service_name(default_service_name.to_owned());
        }
        Some(
            SdkTracerProvider::builder()
                .with_batch_exporter(exporter)
                .with_resource(resource.build())
                .build(),
        )
    } else {
        None
    };
    let tracer = provider.as_ref().map(|provider| provider.tracer("imdedup"));
    subscriber(log_filter, std::io::stderr, tracer).try_init()?;
    if let Some(provider) = &provider {
        global::set_text_map_propagator(TraceContextPropagator::new());
        global::set_tracer_provider(provider.clone());
    }
    Ok(Telemetry { provider })
}

/// The process's subscriber: the `fmt` log of the events `log_filter` lets
/// through, written to `writer`, and the spans to `tracer` when there is
/// one. Without a tracer no layer takes a span, so none is built (an
/// absent layer, `Option::None`, would take every span).
fn subscriber<W>(
    log_filter: EnvFilter,
    writer: W,
    tracer: Option<opentelemetry_sdk::trace::Tracer>,
) -> Box<dyn tracing::Subscriber + Send + Sync>
where
    W: for<'writer> tracing_subscriber::fmt::MakeWriter<'writer> + Send + Sync + 'static,
{
    let log = tracing_subscriber::fmt::layer()
        .with_writer(writer)
        .with_filter(events_only(log_filter));
    let logged = tracing_subscriber::registry().with(log);
    match tracer {
        Some(tracer) => Box::new(
            logged.with(
                tracing_opentelemetry::layer()
                    .with_tracer(tracer)
                    .with_filter(trace_filter()),
            ),
        ),
        None => Box::new(logged),
    }
}

/// What `filter` lets through, of events.
fn events_only<S>(filter: EnvFilter) -> impl tracing_subscriber::layer::Filter<S> {
    // The events-only part says nothing of levels; without a hint of its own
    // the pair would have none, and the process would ask for every level
    // (`log` records at TRACE from the WebSocket library each dispatched).
    filter.and(filter_fn(|metadata| metadata.is_event()).with_max_level_hint(LevelFilter::TRACE))
}

/// INFO and above, without the transport crates (the exporter itself runs on
/// them).
fn trace_filter() -> Targets {
    Targets::new().with_default(LevelFilter::INFO).with_targets(
        [
            "h2",
            "hyper",
            "hyper_util",
            "tonic",
            "tower",
            "opentelemetry",
            "opentelemetry_sdk",
            "opentelemetry_otlp",
        ]
        .map(|target| (target, LevelFilter::OFF)),
    )
}

/// Write the current span's trace context into outgoing gRPC metadata.
pub fn inject_metadata(metadata: &mut MetadataMap) {
    inject(&mut HeaderInjector(metadata.as_mut()));
}

/// The current span's trace context as a map (`traceparent`, and
/// `tracestate` when there is one); empty when traces are off.
pub fn trace_context() -> HashMap<String, String> {
    let mut carrier = HashMap::new();
    inject(&mut carrier);
    carrier
}

/// The remote parent carried by incoming gRPC metadata.
pub fn extract_metadata(metadata: &MetadataMap) -> Context {
    extract(&HeaderExtractor(metadata.as_ref()))
}

/// The remote parent carried by a map from [`trace_context`].
pub fn extract_map(carrier: &HashMap<String, String>) -> Context {
    extract(carrier)
}

/// Make `parent` (from [`extract_map`] or [`extract_metadata`]) the parent
/// of `span`, if it carries a trace. Call it before `span` is entered.
pub fn set_parent(span: &Span, parent: Context) {
    if parent.span().span_context().is_valid() {
        // Fails only when traces are off or the span is disabled.
        let _ = span.set_parent(parent);
    }
}

fn inject(injector: &mut dyn Injector) {
    let context = Span::current().context();
    global::get_text_map_propagator(|propagator| propagator.inject_context(&context, injector));
}

fn extract(extractor: &dyn Extractor) -> Context {
    global::get_text_map_propagator(|propagator| propagator.extract(extractor))
}

struct HeaderInjector<'a>(&'a mut HeaderMap);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(key.as_bytes()),
            HeaderValue::from_str(&value),
        ) {
            self.0.insert(name, value);
        }
    }
}

struct HeaderExtractor<'a>(&'a HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(HeaderName::as_str).collect()
    }
}

/// A tower layer for tonic servers: each call runs in a server span named
/// after its path (`imdedup.v1.IngestService/Send`) with `rpc.system`,
/// `rpc.service`, `rpc.method` and `rpc.grpc.status_code`, continuing the
/// trace of the call's metadata. Health checks and reflection are not traced.
#[derive(Debug, Clone, Copy, Default)]
pub struct GrpcServerTraceLayer;

impl<S> tower::Layer<S> for GrpcServerTraceLayer {
    type Service = GrpcServerTrace<S>;

    fn layer(&self, inner: S) -> Self::Service {
        GrpcServerTrace { inner }
    }
}

/// The service of [`GrpcServerTraceLayer`].
#[derive(Debug, Clone)]
pub struct GrpcServerTrace<S> {
    inner: S,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, B, RB> tower::Service<http::Request<B>> for GrpcServerTrace<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<RB>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    RB: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let Some(span) = server_span(request.uri().path(), request.headers()) else {
            return Box::pin(self.inner.call(request));
        };
        let response = {
            let _entered = span.enter();
            self.inner.call(request)
        };
        let recorder = span.clone();
        Box::pin(
            async move {
                let result = response.await;
                if let Ok(response) = &result {
                    record_status(&recorder, response);
                }
                result
            }
            .instrument(span),
        )
    }
}

fn server_span(path: &str, headers: &HeaderMap) -> Option<Span> {
    let (service, method) = path.trim_start_matches('/').split_once('/')?;
    if service.starts_with("grpc.health.") || service.starts_with("grpc.reflection.") {
        return None;
    }
    let span = tracing::info_span!(
        "grpc.server",
        otel.name = %format_args!("{service}/{method}"),
        otel.kind = "server",
        otel.status_code = tracing::field::Empty,
        rpc.system = "grpc",
        rpc.service = %service,
        rpc.method = %method,
        rpc.grpc.status_code = tracing::field::Empty,
    );
    set_parent(&span, extract(&HeaderExtractor(headers)));
    Some(span)
}

/// A failed call answers with `grpc-status` in its headers (trailers-only);
/// one that did not has it in the trailers, after a body the handler has
/// already produced: 0 (OK).
fn record_status<RB>(span: &Span, response: &http::Response<RB>) {
    let code = response
        .headers()
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<i64>().ok())
        .unwrap_or(0);
    span.record("rpc.grpc.status_code", code);
    // Server errors per the gRPC semantic conventions: UNKNOWN,
    // DEADLINE_EXCEEDED, UNIMPLEMENTED, INTERNAL, UNAVAILABLE, DATA_LOSS.
    if matches!(code, 2 | 4 | 12 | 13 | 14 | 15) {
        span.record("otel.status_code", "ERROR");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(vars: &[(&str, &str)]) -> Result<OtelConfig, TelemetryError> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        OtelConfig::read(|name| vars.get(name).cloned())
    }

    fn exports(vars: &[(&str, &str)]) -> bool {
        config(vars).unwrap().export
    }

    #[test]
    fn traces_are_off_unless_an_endpoint_or_the_exporter_is_named() {
        assert!(!exports(&[]));
        assert!(!exports(&[("OTEL_SERVICE_NAME", "x")]));
        assert!(exports(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317")]));
        assert!(exports(&[(
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "http://c:4317"
        )]));
        assert!(exports(&[("OTEL_TRACES_EXPORTER", "otlp")]));
        assert!(!exports(&[("OTEL_EXPORTER_OTLP_ENDPOINT", " ")]));
    }

    #[test]
    fn none_and_sdk_disabled_switch_traces_off() {
        let endpoint = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317");
        assert!(!exports(&[endpoint, ("OTEL_TRACES_EXPORTER", "none")]));
        assert!(!exports(&[endpoint, ("OTEL_SDK_DISABLED", "TRUE")]));
        assert!(exports(&[endpoint, ("OTEL_SDK_DISABLED", "false")]));
    }

    #[test]
    fn unsupported_exporters_and_protocols_are_refused() {
        let endpoint = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317");
        assert!(config(&[("OTEL_TRACES_EXPORTER", "zipkin")]).is_err());
        assert!(config(&[endpoint, ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")]).is_err());
        assert!(exports(&[
            endpoint,
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        ]));
        // Only checked when exporting.
        assert!(config(&[("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")]).is_ok());
    }

    /// A writer the test reads back.
    #[derive(Clone, Default)]
    struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn the_log_writes_events_and_no_span_is_built_without_traces() {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = subscriber(EnvFilter::new("info"), move || writer.clone(), None);
        let everything = tracing_subscriber::registry().with(tracing_subscriber::fmt::layer());
        let span = tracing::subscriber::with_default(everything, || {
            tracing::info_span!("imdedup.send").metadata().unwrap()
        });
        // Asked of the subscriber itself: with other tests' subscribers
        // alive at once, tracing asks each span again and mixes answers.
        assert!(
            subscriber.register_callsite(span).is_never(),
            "a span nobody exports is never built"
        );
        assert_eq!(
            subscriber.max_level_hint(),
            Some(LevelFilter::INFO),
            "levels the log filters out are never asked for"
        );
        tracing::subscriber::with_default(subscriber, || {
            tracing::warn!(shard = "ingest-0", "backend error");
            tracing::debug!("below the filter");
        });
        let log = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
        assert!(
            log.contains("backend error") && log.contains("\"ingest-0\""),
            "{log}"
        );
        assert!(!log.contains("below the filter"), "{log}");
    }

    #[test]
    fn spans_are_built_when_traces_are_exported() {
        let provider = SdkTracerProvider::builder().build();
        let subscriber = subscriber(
            EnvFilter::new("info"),
            std::io::sink,
            Some(provider.tracer("test")),
        );
        tracing::subscriber::with_default(subscriber, || {
            let send = tracing::info_span!("imdedup.send");
            assert!(!send.is_disabled());
            assert!(send.context().span().span_context().is_valid());
        });
    }

    #[test]
    fn the_service_name_from_the_environment_wins() {
        assert!(!config(&[]).unwrap().service_name_from_env);
        assert!(
            config(&[("OTEL_SERVICE_NAME", "mine")])
                .unwrap()
                .service_name_from_env
        );
        assert!(
            config(&[("OTEL_RESOURCE_ATTRIBUTES", "team=im, service.name=mine")])
                .unwrap()
                .service_name_from_env
        );
        assert!(
            !config(&[("OTEL_RESOURCE_ATTRIBUTES", "service.namespace=im")])
                .unwrap()
                .service_name_from_env
        );
    }

    #[test]
    fn the_trace_context_travels_through_a_map_and_through_metadata() {
        global::set_text_map_propagator(TraceContextPropagator::new());
        let provider = SdkTracerProvider::builder().build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        tracing::subscriber::with_default(subscriber, || {
            let send = tracing::info_span!("send");
            let trace_id = send.context().span().span_context().trace_id();
            let (map, mut metadata) = send.in_scope(|| {
                let mut metadata = MetadataMap::new();
                inject_metadata(&mut metadata);
                (trace_context(), metadata)
            });
            assert!(map.contains_key("traceparent"), "{map:?}");
            metadata.insert("other", "x".parse().unwrap());

            for parent in [extract_map(&map), extract_metadata(&metadata)] {
                let child = tracing::info_span!("remote");
                set_parent(&child, parent);
                assert_eq!(child.context().span().span_context().trace_id(), trace_id);
            }
            let orphan = tracing::info_span!("orphan");
            set_parent(&orphan, extract_map(&HashMap::new()));
            assert_ne!(orphan.context().span().span_context().trace_id(), trace_id);
        });
    }

    /// Answers with the trace id of the span it runs in.
    struct Handler;

    impl tower::Service<http::Request<()>> for Handler {
        type Response = http::Response<()>;
        type Error = std::convert::Infallible;
        type Future = std::future::Ready<Result<Self::Response, Self::Error>>;

        fn poll_ready(&mut self, _: &mut TaskContext<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, _: http::Request<()>) -> Self::Future {
            let trace_id = Span::current().context().span().span_context().trace_id();
            let mut response = http::Response::new(());
            response
                .headers_mut()
                .insert("x-trace", trace_id.to_string().parse().unwrap());
            std::future::ready(Ok(response))
        }
    }

    #[tokio::test]
    async fn a_grpc_call_runs_in_a_server_span_continuing_the_callers_trace() {
        use tower::{Layer as _, Service as _};

        global::set_text_map_propagator(TraceContextPropagator::new());
        let provider = SdkTracerProvider::builder().build();
        let _subscriber = tracing::subscriber::set_default(
            tracing_subscriber::registry()
                .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test"))),
        );
        let mut service = GrpcServerTraceLayer.layer(Handler);
        let request = http::Request::builder()
            .uri("/imdedup.v1.IngestService/Send")
            .header(
                "traceparent",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            )
            .body(())
            .unwrap();
        let response = service.call(request).await.unwrap();
        assert_eq!(
            response.headers()["x-trace"],
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
    }

    #[test]
    fn grpc_paths_name_the_server_span_and_health_is_not_traced() {
        let headers = HeaderMap::new();
        assert!(server_span("/imdedup.v1.IngestService/Send", &headers).is_some());
        assert!(server_span("/grpc.health.v1.Health/Check", &headers).is_none());
        assert!(server_span("/nonsense", &headers).is_none());
    }
}
