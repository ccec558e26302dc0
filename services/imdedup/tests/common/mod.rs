//! Running the `imdedup` binary's services as processes, for the tests that
//! need them apart (SIGTERM, one trace across processes).

use std::{
    net::SocketAddr,
    path::Path,
    process::{Child, Command, ExitStatus, Stdio},
    time::Duration,
};

use imdedup_testkit::process::Process;
pub use imdedup_testkit::process::free_addr;

pub const BIN: &str = env!("CARGO_BIN_EXE_imdedup");

/// Wait until something accepts connections on `addr` (a service started).
pub fn wait_listening(addr: SocketAddr) {
    imdedup_testkit::process::wait_listening(addr, Duration::from_secs(10));
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
pub struct Service(Process);

impl Service {
    pub fn spawn(command: Command) -> Self {
        Self(Process::spawn(command))
    }

    #[allow(dead_code, reason = "not every test binary reads a service's output")]
    pub fn from_child(child: Child) -> Self {
        Self(Process::from_child(child))
    }

    #[allow(dead_code, reason = "not every test binary stops services gently")]
    pub fn start(args: &[&str], data_dir: &Path) -> Self {
        Self::spawn(command(args, data_dir))
    }

    /// SIGTERM, then the exit status within the grace period.
    #[allow(dead_code, reason = "not every test binary stops services gently")]
    pub fn terminate(self) -> ExitStatus {
        self.0.terminate(Duration::from_secs(15))
    }
}
