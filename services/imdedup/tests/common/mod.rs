//! Running the `imdedup` binary's services as processes, for the tests that
//! need them apart (SIGTERM, one trace across processes).

use std::{
    net::{SocketAddr, TcpListener, TcpStream},
    path::Path,
    process::{Child, Command, ExitStatus, Stdio},
    time::{Duration, Instant},
};

pub const BIN: &str = env!("CARGO_BIN_EXE_imdedup");

/// A loopback address nothing listens on right now, below the kernel's
/// ephemeral range (32768 and up): a port from that range can be taken by
/// any outgoing connection between this check and the service's bind.
pub fn free_addr() -> SocketAddr {
    use std::sync::atomic::{AtomicU16, Ordering};
    // Spread over processes (test binaries run side by side) by the pid.
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let base = 20_000 + (std::process::id() % 100) as u16 * 120;
    loop {
        let port = base + NEXT.fetch_add(1, Ordering::Relaxed) % 120;
        if let Ok(listener) = TcpListener::bind(("127.0.0.1", port)) {
            return listener.local_addr().unwrap();
        }
    }
}

/// Wait until something accepts connections on `addr`.
pub fn wait_listening(addr: SocketAddr) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(addr).is_err() {
        assert!(Instant::now() < deadline, "nothing listens on {addr}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `imdedup <args>` with its data in `data_dir`, quiet but for warnings.
pub fn command(args: &[&str], data_dir: &Path) -> Command {
    let mut command = Command::new(BIN);
    command
        .args(args)
        .env("IMDEDUP_DATA_DIR", data_dir)
        // Processes on loopback in a test: the internal hops in plaintext
        // (tests/internal_tls.rs of the cluster crate covers mutual TLS).
        .env("IMDEDUP_INSECURE_PLAINTEXT", "true")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    command
}

/// A token for `user`, minted by `imdedup token` with `secret`.
#[allow(dead_code, reason = "not every test binary mints tokens")]
pub fn mint_token(secret: &str, user: &str) -> String {
    let output = Command::new(BIN)
        .args(["token", "--user", user, "--token-secret", secret])
        .output()
        .unwrap();
    assert!(output.status.success(), "imdedup token failed");
    String::from_utf8(output.stdout).unwrap().trim().to_owned()
}

/// A phone of the user `token` names, on the gateway at `gateway`, in JSON.
#[allow(dead_code, reason = "not every test binary connects phones")]
pub async fn connect_phone(gateway: SocketAddr, token: &str) -> imdedup_client::Client {
    imdedup_client::Client::connect(
        &format!("ws://{gateway}/v1/ws"),
        token,
        imdedup_client::Encoding::Json,
    )
    .await
    .unwrap()
}

/// The command line of a gateway on `listen` in front of `shards`.
#[allow(dead_code, reason = "not every test binary starts a gateway")]
pub fn gateway_args(
    listen: SocketAddr,
    shards: &str,
    storage_url: &str,
    secret: &str,
    admin: SocketAddr,
) -> Vec<String> {
    [
        "gateway",
        "--listen",
        &listen.to_string(),
        "--shards",
        shards,
        "--storage",
        storage_url,
        "--token-secret",
        secret,
        "--admin-listen",
        &admin.to_string(),
    ]
    .map(str::to_owned)
    .to_vec()
}

/// A service process; killed when dropped.
pub struct Service(Child);

impl Service {
    pub fn spawn(mut command: Command) -> Self {
        Self(command.spawn().unwrap())
    }

    #[allow(dead_code, reason = "not every test binary reads a service's output")]
    pub fn from_child(child: Child) -> Self {
        Self(child)
    }

    #[allow(dead_code, reason = "not every test binary stops services gently")]
    pub fn start(args: &[&str], data_dir: &Path) -> Self {
        Self::spawn(command(args, data_dir))
    }

    /// SIGTERM, then the exit status within the grace period.
    #[allow(dead_code, reason = "not every test binary stops services gently")]
    pub fn terminate(mut self) -> ExitStatus {
        let pid = self.0.id().to_string();
        assert!(
            Command::new("kill")
                .args(["-TERM", &pid])
                .status()
                .unwrap()
                .success()
        );
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if let Some(status) = self.0.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "service ignored SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
