//! `imdedup certs`: a throwaway CA and one certificate per service, for
//! running the services by hand over mutual TLS on one machine. In a
//! cluster, cert-manager (or your PKI) issues them instead.

use std::{
    fs,
    path::{Path, PathBuf},
};

use anyhow::Context;
use clap::Args;
use imdedup_runtime::tls::names;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};

#[derive(Debug, Args)]
pub struct CertsArgs {
    /// Directory to write into: `<service>/tls.crt`, `tls.key` and `ca.crt`
    /// for gateway, ingest and storage (and membership).
    #[arg(long, default_value = "imdedup-tls")]
    pub out: PathBuf,
    /// Host names and IP addresses every certificate is also valid for: the
    /// hosts of the URLs the services dial.
    #[arg(long, value_delimiter = ',', default_values = ["localhost", "127.0.0.1"])]
    pub hosts: Vec<String>,
}

/// Each service, with the name its certificate carries.
const SERVICES: [(&str, &str); 4] = [
    ("gateway", names::GATEWAY),
    ("ingest", names::INGEST),
    ("storage", names::STORAGE),
    ("membership", "imdedup-membership"),
];

pub fn run(args: CertsArgs) -> anyhow::Result<()> {
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, "imdedup local CA");
    let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate()?)?;
    for (service, name) in SERVICES {
        let dir = args.out.join(service);
        fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let mut san = vec![name.to_owned()];
        san.extend(args.hosts.iter().cloned());
        let key = KeyPair::generate()?;
        let cert = CertificateParams::new(san)
            .with_context(|| format!("--hosts {:?}", args.hosts))?
            .signed_by(&key, &ca)?;
        write(&dir.join("tls.crt"), &cert.pem(), 0o644)?;
        write(&dir.join("tls.key"), &key.serialize_pem(), 0o600)?;
        write(&dir.join("ca.crt"), &ca.pem(), 0o644)?;
    }
    let out = args.out.display();
    println!(
        "wrote a throwaway CA and certificates for {} into {out}/",
        args.hosts.join(", ")
    );
    println!("start each service with its own directory's files, for example:");
    println!(
        "  imdedup storage --tls-cert {out}/storage/tls.crt --tls-key {out}/storage/tls.key --tls-ca {out}/storage/ca.crt"
    );
    println!("and dial https://<host>:<port>; for local runs only (the CA key is not kept)");
    Ok(())
}

fn write(path: &Path, text: &str, mode: u32) -> anyhow::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    std::io::Write::write_all(&mut file, text.as_bytes())
        .with_context(|| format!("cannot write {}", path.display()))
}
