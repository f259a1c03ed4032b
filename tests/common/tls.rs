//! TLS material made at test time: a CA, a server certificate it signed (for `localhost` and
//! 127.0.0.1), and a second CA that signed nothing, as PEM files; plus the arguments that make a
//! `redis-server` (or a sentinel) speak TLS only, and `redis-cli` trust it.
//!
//! A store verifies the server against the platform's trust store, which `SSL_CERT_FILE`
//! replaces: point it at [`Pki::ca`].

use std::path::{Path, PathBuf};

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};

#[derive(Clone)]
pub struct Pki {
    pub dir: PathBuf,
    pub ca: PathBuf,
    pub other_ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
}

fn ca(name: &str) -> (CertificateParams, KeyPair) {
    let mut params = CertificateParams::new(Vec::new()).expect("CA parameters");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    (params, KeyPair::generate().expect("a CA key"))
}

impl Pki {
    /// Generates the certificates into `dir` (created if missing).
    pub fn generate(dir: &Path) -> Self {
        std::fs::create_dir_all(dir).expect("create a directory for the certificates");
        let (ca_params, ca_key) = ca("tower-idempotency test CA");
        let ca_cert = ca_params.self_signed(&ca_key).expect("self-sign the CA");
        let (other_params, other_key) = ca("an unrelated CA");
        let other_cert = other_params
            .self_signed(&other_key)
            .expect("self-sign the other CA");
        let issuer = Issuer::new(ca_params, ca_key);
        let server_key = KeyPair::generate().expect("a server key");
        // rcgen makes "127.0.0.1" an IP address SAN: clients given an IP verify against it.
        let server_params = CertificateParams::new(vec!["localhost".into(), "127.0.0.1".into()])
            .expect("server certificate parameters");
        let server_cert = server_params
            .signed_by(&server_key, &issuer)
            .expect("sign the server certificate");
        let write = |name: &str, pem: String| {
            let path = dir.join(name);
            std::fs::write(&path, pem).expect("write a PEM file");
            path
        };
        Self {
            dir: dir.to_owned(),
            ca: write("ca.pem", ca_cert.pem()),
            other_ca: write("other-ca.pem", other_cert.pem()),
            server_cert: write("server.pem", server_cert.pem()),
            server_key: write("server.key", server_key.serialize_pem()),
        }
    }

    /// `redis-server` arguments for a server that listens for TLS only, on `{port}` (see
    /// `RedisServer::start_with`), and replicates over TLS. Clients need no certificate.
    pub fn server_args(&self) -> Vec<String> {
        let mut args: Vec<String> = ["--port", "0", "--tls-port", "{port}", "--tls-replication", "yes"]
            .map(str::to_owned)
            .to_vec();
        for (name, value) in self.config() {
            args.push(format!("--{name}"));
            args.push(value);
        }
        args
    }

    /// The same settings as lines of a config file (for sentinels), without the ports.
    pub fn config_lines(&self) -> String {
        (self.config().into_iter())
            .map(|(name, value)| format!("{name} {value}\n"))
            .chain(["tls-replication yes\n".to_owned()])
            .collect()
    }

    fn config(&self) -> [(&'static str, String); 4] {
        // Absolute paths: the server changes to its `dir` before it reads them.
        let path = |p: &PathBuf| p.to_str().expect("a UTF-8 temp path").to_owned();
        [
            ("tls-cert-file", path(&self.server_cert)),
            ("tls-key-file", path(&self.server_key)),
            ("tls-ca-cert-file", path(&self.ca)),
            ("tls-auth-clients", "no".to_owned()),
        ]
    }

    /// `redis-cli` arguments to reach a server started with [`server_args`](Self::server_args).
    pub fn cli_args(&self) -> Vec<String> {
        let ca = self.ca.to_str().expect("a UTF-8 temp path").to_owned();
        vec!["--tls".into(), "--cacert".into(), ca]
    }
}
