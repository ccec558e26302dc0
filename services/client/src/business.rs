//! A backend system's client of the business API over HTTP/JSON
//! (`POST /v1/messages` on the gateway's port), as the load driver and the
//! tests use it: plain HTTP/1.1 with keep-alive, written out by hand so it
//! shows exactly what goes on the wire.
//!
//! A call that is dropped (a caller's timeout) takes its connection with
//! it; the next call dials again. Only `http://` is spoken.

use std::{
    sync::Mutex,
    time::{Duration, Instant},
};

use serde::Deserialize;
use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader},
    net::TcpStream,
};

use crate::ClientError;

/// The answer to a call that was stored or recognised as a repeat.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BusinessAck {
    pub server_id: u64,
    pub seq: u64,
    pub duplicate: bool,
    /// `stored` or `duplicate_business_key`.
    pub outcome: String,
    /// The `Idempotent-Replayed: true` header was there.
    pub replayed: bool,
}

/// An error answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BusinessError {
    pub status: u16,
    /// `invalid_argument`, `idempotency_key_reused`, `overloaded`, …
    pub code: String,
    pub retryable: bool,
    pub message: String,
    /// `idempotency_key_reused`: the original message's server id and seq.
    pub original: Option<(u64, u64)>,
    /// `retry_after_ms`, when the gateway asked for a pause.
    pub retry_after: Option<Duration>,
    /// The `Retry-After` header, in seconds.
    pub retry_after_header: Option<u64>,
}

/// One HTTP reply as it came.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpReply {
    pub status: u16,
    /// Header names in lower case.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl HttpReply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

#[derive(Deserialize)]
struct AckJson {
    server_id: String,
    seq: u64,
    duplicate: bool,
    outcome: String,
}

#[derive(Deserialize)]
struct ErrorJson {
    code: String,
    retryable: bool,
    message: String,
    #[serde(default)]
    server_id: Option<String>,
    #[serde(default)]
    seq: Option<u64>,
    #[serde(default)]
    retry_after_ms: Option<u64>,
}

type Connection = BufReader<TcpStream>;

/// A client of one gateway, with one service token.
pub struct BusinessHttp {
    /// `host:port` of the gateway.
    addr: String,
    token: String,
    /// Connections kept alive between calls.
    idle: Mutex<Vec<Connection>>,
}

impl BusinessHttp {
    /// A client of the gateway at `url` (`http://host:port`, `ws://host:port/…`
    /// or `host:port`: only the host and port are used).
    pub fn new(url: &str, token: impl Into<String>) -> Self {
        let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
        let addr = rest.split('/').next().unwrap_or(rest).to_owned();
        Self {
            addr,
            token: token.into(),
            idle: Mutex::new(Vec::new()),
        }
    }

    /// Send `body` as `sender` into `conversation`, under `key`.
    pub async fn send(
        &self,
        key: &str,
        sender: &str,
        conversation: &str,
        body: &str,
    ) -> Result<Result<BusinessAck, BusinessError>, ClientError> {
        let json = serde_json::json!({
            "sender": sender,
            "conversation": conversation,
            "body": body,
        })
        .to_string();
        let authorization = format!("Bearer {}", self.token);
        let reply = self
            .post(
                "/v1/messages",
                &[
                    ("Authorization", authorization.as_str()),
                    ("Idempotency-Key", key),
                    ("Content-Type", "application/json"),
                ],
                json.as_bytes(),
            )
            .await?;
        Ok(read_answer(&reply))
    }

    /// A raw `POST` with these headers (besides Host and Content-Length).
    pub async fn post(
        &self,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<HttpReply, ClientError> {
        let mut request = format!(
            "POST {path} HTTP/1.1\r\nHost: {}\r\nContent-Length: {}\r\n",
            self.addr,
            body.len()
        );
        for (name, value) in headers {
            request.push_str(&format!("{name}: {value}\r\n"));
        }
        request.push_str("\r\n");
        let mut bytes = request.into_bytes();
        bytes.extend_from_slice(body);

        let reused = self.idle.lock().map(|mut idle| idle.pop()).unwrap_or(None);
        let (reply, connection) = match reused {
            Some(connection) => match round_trip(connection, &bytes).await {
                Ok(done) => done,
                // A kept connection the gateway closed meanwhile: dial
                // again (the key makes the repeat harmless anyway).
                Err(_) => round_trip(self.dial().await?, &bytes).await?,
            },
            None => round_trip(self.dial().await?, &bytes).await?,
        };
        let close = reply
            .header("connection")
            .is_some_and(|v| v.eq_ignore_ascii_case("close"));
        if !close && let Ok(mut idle) = self.idle.lock() {
            idle.push(connection);
        }
        Ok(reply)
    }

    async fn dial(&self) -> Result<Connection, ClientError> {
        let tcp = TcpStream::connect(&self.addr)
            .await
            .map_err(|e| ClientError::Connect(format!("{}: {e}", self.addr)))?;
        let _ = tcp.set_nodelay(true);
        Ok(BufReader::new(tcp))
    }
}

/// The answer or error a reply carries.
pub fn read_answer(reply: &HttpReply) -> Result<BusinessAck, BusinessError> {
    let malformed = |why: String| BusinessError {
        status: reply.status,
        code: "malformed_reply".into(),
        retryable: true,
        message: why,
        original: None,
        retry_after: None,
        retry_after_header: None,
    };
    if reply.status == 200 {
        let ack: AckJson = serde_json::from_slice(&reply.body)
            .map_err(|e| malformed(format!("not an answer: {e}")))?;
        return Ok(BusinessAck {
            server_id: ack
                .server_id
                .parse()
                .map_err(|e| malformed(format!("server_id: {e}")))?,
            seq: ack.seq,
            duplicate: ack.duplicate,
            outcome: ack.outcome,
            replayed: reply.header("idempotent-replayed") == Some("true"),
        });
    }
    let error: ErrorJson = serde_json::from_slice(&reply.body).map_err(|e| {
        malformed(format!(
            "HTTP {} {:?}: {e}",
            reply.status,
            String::from_utf8_lossy(&reply.body)
        ))
    })?;
    let original = match (error.server_id.as_deref().map(str::parse), error.seq) {
        (Some(Ok(server_id)), Some(seq)) => Some((server_id, seq)),
        _ => None,
    };
    Err(BusinessError {
        status: reply.status,
        code: error.code,
        retryable: error.retryable,
        message: error.message,
        original,
        retry_after: error.retry_after_ms.map(Duration::from_millis),
        retry_after_header: reply.header("retry-after").and_then(|v| v.parse().ok()),
    })
}

/// The largest reply body taken (the gateway's are a few hundred bytes).
const MAX_REPLY_BYTES: usize = 1 << 20;
/// The longest status, header or chunk-size line taken.
const MAX_LINE_BYTES: u64 = 16 * 1024;

/// Read one line of at most [`MAX_LINE_BYTES`] into `line`; the bytes read
/// (0 at the end of the stream).
async fn read_line(connection: &mut Connection, line: &mut String) -> Result<usize, ClientError> {
    let read = (&mut *connection)
        .take(MAX_LINE_BYTES)
        .read_line(line)
        .await
        .map_err(|e| ClientError::Connect(e.to_string()))?;
    if read as u64 == MAX_LINE_BYTES && !line.ends_with('\n') {
        return Err(ClientError::Connect(format!(
            "a reply line longer than {MAX_LINE_BYTES} bytes"
        )));
    }
    Ok(read)
}

/// A reply body (or the part of it announced so far) over the limit.
fn too_large(size: usize) -> ClientError {
    ClientError::Connect(format!(
        "a reply body of {size} bytes or more, over the limit of {MAX_REPLY_BYTES}"
    ))
}

async fn round_trip(
    mut connection: Connection,
    request: &[u8],
) -> Result<(HttpReply, Connection), ClientError> {
    let io = |e: std::io::Error| ClientError::Connect(e.to_string());
    connection.get_mut().write_all(request).await.map_err(io)?;
    let mut line = String::new();
    if read_line(&mut connection, &mut line).await? == 0 {
        return Err(ClientError::Closed);
    }
    let status = line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| ClientError::Connect(format!("not an HTTP reply: {line:?}")))?;
    let mut headers = Vec::new();
    loop {
        line.clear();
        if read_line(&mut connection, &mut line).await? == 0 {
            return Err(ClientError::Closed);
        }
        let header = line.trim_end();
        if header.is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':') {
            headers.push((name.trim().to_ascii_lowercase(), value.trim().to_owned()));
        }
    }
    let find = |name: &str| {
        headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
    };
    let mut body = Vec::new();
    if find("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        loop {
            line.clear();
            read_line(&mut connection, &mut line).await?;
            let size = usize::from_str_radix(line.trim().split(';').next().unwrap_or(""), 16)
                .map_err(|e| ClientError::Connect(format!("bad chunk size {line:?}: {e}")))?;
            let total = body.len().saturating_add(size);
            if total > MAX_REPLY_BYTES {
                return Err(too_large(total));
            }
            // The chunk and its CRLF.
            let start = body.len();
            body.resize(total + 2, 0);
            connection
                .read_exact(&mut body[start..])
                .await
                .map_err(io)?;
            body.truncate(total);
            if size == 0 {
                break;
            }
        }
    } else if let Some(length) = find("content-length").and_then(|v| v.parse::<usize>().ok()) {
        if length > MAX_REPLY_BYTES {
            return Err(too_large(length));
        }
        body.resize(length, 0);
        connection.read_exact(&mut body).await.map_err(io)?;
    } else {
        let limit = MAX_REPLY_BYTES as u64 + 1;
        (&mut connection)
            .take(limit)
            .read_to_end(&mut body)
            .await
            .map_err(io)?;
        if body.len() > MAX_REPLY_BYTES {
            return Err(too_large(body.len()));
        }
    }
    Ok((
        HttpReply {
            status,
            headers,
            body,
        },
        connection,
    ))
}

/// How a call with retries went: every answer and error it got, and how
/// many tries timed out on the client.
#[derive(Debug, Clone, Default)]
pub struct Retried {
    pub answers: Vec<BusinessAck>,
    pub errors: Vec<BusinessError>,
    pub tries: u32,
    pub timed_out: u32,
    /// When the last answer came, from the first try.
    pub latency: Option<Duration>,
}

/// How a backend retries a call: each try given `timeouts[i]` on the
/// client (the last one repeated), up to `max_tries`, pausing at least
/// `pause` between tries (longer when the gateway asks).
#[derive(Debug, Clone)]
pub struct RetryPolicy {
    pub timeouts: Vec<Duration>,
    pub pause: Duration,
    pub max_tries: u32,
}

impl BusinessHttp {
    /// Call until an answer or a final error, as a backend does, with the
    /// same key every time.
    pub async fn send_with_retries(
        &self,
        key: &str,
        sender: &str,
        conversation: &str,
        body: &str,
        policy: &RetryPolicy,
    ) -> Retried {
        let started = Instant::now();
        let mut retried = Retried::default();
        while retried.tries < policy.max_tries {
            let timeout = policy
                .timeouts
                .get(retried.tries as usize)
                .or(policy.timeouts.last())
                .copied()
                .unwrap_or(Duration::from_secs(5));
            retried.tries += 1;
            let mut wait = policy.pause;
            match tokio::time::timeout(timeout, self.send(key, sender, conversation, body)).await {
                Err(_) => retried.timed_out += 1,
                Ok(Err(_)) => {}
                Ok(Ok(Ok(ack))) => {
                    retried.answers.push(ack);
                    retried.latency = Some(started.elapsed());
                    break;
                }
                Ok(Ok(Err(error))) => {
                    let retryable = error.retryable;
                    wait = wait.max(error.retry_after.unwrap_or_default());
                    retried.errors.push(error);
                    if !retryable {
                        break;
                    }
                }
            }
            tokio::time::sleep(wait).await;
        }
        retried
    }
}

#[cfg(test)]
mod tests {
    use tokio::net::TcpListener;

    use super::*;

    /// A server that answers every request with `reply`, then closes.
    async fn answering(reply: &'static [u8]) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut tcp, _) = listener.accept().await.unwrap();
            let mut request = [0u8; 1024];
            let _ = tcp.read(&mut request).await;
            let _ = tcp.write_all(reply).await;
        });
        format!("http://{addr}")
    }

    async fn post_to(reply: &'static [u8]) -> Result<HttpReply, ClientError> {
        BusinessHttp::new(&answering(reply).await, "t")
            .post("/v1/messages", &[], b"{}")
            .await
    }

    #[tokio::test]
    async fn a_reply_is_read_whole_when_it_is_in_bounds() {
        let reply = post_to(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
            .await
            .unwrap();
        assert_eq!((reply.status, reply.body.as_slice()), (200, &b"abcde"[..]));
        let reply = post_to(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            .await
            .unwrap();
        assert_eq!(reply.body, b"ok");
    }

    #[tokio::test]
    async fn a_peer_announcing_a_huge_body_gets_an_error_not_an_allocation_or_a_panic() {
        for reply in [
            &b"HTTP/1.1 200 OK\r\nContent-Length: 999999999999\r\n\r\n"[..],
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffff\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n100001\r\n",
        ] {
            let reply: &'static [u8] = reply;
            match post_to(reply).await {
                Err(ClientError::Connect(why)) => assert!(why.contains("over the limit"), "{why}"),
                other => panic!("{other:?}"),
            }
        }
    }

    #[tokio::test]
    async fn an_endless_header_line_is_refused() {
        static LONG: std::sync::LazyLock<Vec<u8>> = std::sync::LazyLock::new(|| {
            let mut reply = b"HTTP/1.1 200 OK\r\nX: ".to_vec();
            reply.resize(100_000, b'x');
            reply
        });
        match post_to(LONG.as_slice()).await {
            Err(ClientError::Connect(why)) => assert!(why.contains("longer than"), "{why}"),
            other => panic!("{other:?}"),
        }
    }
}
