//! A real PostgreSQL server for the fleet tests, in a temporary directory: `initdb` and
//! `pg_ctl` from Debian's `postgresql` package, listening on a unix socket only, stopped (by
//! its PID, through pg_ctl) when dropped. PostgreSQL refuses to run as root: as root the
//! server runs as `nobody` (setpriv), in a directory that user owns.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// Where Debian puts the server's binaries (`postgresql-15` on Debian 12).
fn bindir() -> PathBuf {
    if let Ok(dir) = std::env::var("VFIOD_PG_BINDIR") {
        return dir.into();
    }
    for v in ["17", "16", "15", "14", "13"] {
        let d = PathBuf::from(format!("/usr/lib/postgresql/{v}/bin"));
        if d.join("pg_ctl").exists() {
            return d;
        }
    }
    panic!("no PostgreSQL server binaries under /usr/lib/postgresql (apt-get install postgresql)")
}

pub const SUPERUSER: &str = "postgres";
pub const SUPERUSER_PASSWORD: &str = "test-superuser-secret";
const PORT: u16 = 5432;

pub struct Postgres {
    pub dir: tempfile::TempDir,
    data: PathBuf,
    pub socket_dir: PathBuf,
    /// Run the server's tools as this user (uid, gid) when the test runs as root.
    as_user: Option<(u32, u32)>,
    /// Commits wait for the disk (the benchmark); off for the tests, whose data is thrown away.
    durable: bool,
    /// TLS on loopback TCP, when started so: (port, certificate, key).
    tls: Option<Tls>,
}

/// A server certificate for 127.0.0.1 signed by a test CA, made with the openssl tool.
pub struct Tls {
    pub port: u16,
    /// The CA's certificate (PEM), what clients must trust.
    pub ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
}

/// A directory in memory (`/dev/shm`) unless `TMPDIR` says otherwise (as tests/common's).
fn memory_tempdir() -> tempfile::TempDir {
    let shm = Path::new("/dev/shm");
    if std::env::var_os("TMPDIR").is_none() && shm.is_dir() {
        if let Ok(d) = tempfile::Builder::new().prefix("vfiod-pg.").tempdir_in(shm) {
            return d;
        }
    }
    tempfile::Builder::new()
        .prefix("vfiod-pg.")
        .tempdir()
        .expect("tempdir")
}

impl Postgres {
    /// initdb (scram-sha-256 everywhere, a superuser with a password), then start: in memory,
    /// without fsync (the tests).
    pub fn start() -> Postgres {
        Self::start_in(memory_tempdir(), false)
    }

    /// As [`Postgres::start`], also listening on 127.0.0.1 (a free port) with TLS only
    /// (`hostssl`), its certificate signed by a CA made for the test.
    pub fn start_tls() -> Postgres {
        let dir = memory_tempdir();
        let certs = dir.path().join("certs");
        std::fs::create_dir(&certs).unwrap();
        let openssl = |args: &[&str]| {
            let out = Command::new("openssl")
                .args(args)
                .current_dir(&certs)
                .output()
                .expect("run openssl");
            assert!(
                out.status.success(),
                "openssl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        openssl(
            &[
                &["req", "-x509"][..],
                &ec,
                &[
                    "-keyout",
                    "ca.key",
                    "-out",
                    "ca.pem",
                    "-days",
                    "2",
                    "-subj",
                    "/CN=vfiod test CA",
                ],
            ]
            .concat(),
        );
        openssl(
            &[
                &["req"][..],
                &ec,
                &[
                    "-keyout",
                    "server.key",
                    "-out",
                    "server.csr",
                    "-subj",
                    "/CN=127.0.0.1",
                ],
            ]
            .concat(),
        );
        std::fs::write(certs.join("ext"), "subjectAltName=IP:127.0.0.1\n").unwrap();
        openssl(&[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "server.pem",
            "-days",
            "2",
            "-extfile",
            "ext",
        ]);
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let tls = Tls {
            port,
            ca: certs.join("ca.pem"),
            cert: certs.join("server.pem"),
            key: certs.join("server.key"),
        };
        std::fs::set_permissions(&tls.key, std::fs::Permissions::from_mode(0o600)).unwrap();
        if nix::unistd::geteuid().is_root() {
            for p in [&certs, &tls.cert, &tls.key] {
                std::os::unix::fs::chown(p, Some(65534), Some(65534)).unwrap();
            }
        }
        Self::start_full(dir, false, Some(tls))
    }

    /// The TLS set-up, when started with [`Postgres::start_tls`].
    pub fn tls(&self) -> Option<&Tls> {
        self.tls.as_ref()
    }

    /// The same in `dir`, with `fsync` and synchronous commits when `durable` (a benchmark
    /// wants the real cost of a commit: give it a directory on disk).
    pub fn start_in(dir: tempfile::TempDir, durable: bool) -> Postgres {
        Self::start_full(dir, durable, None)
    }

    fn start_full(dir: tempfile::TempDir, durable: bool, tls: Option<Tls>) -> Postgres {
        let as_user = nix::unistd::geteuid()
            .is_root()
            .then_some((65534u32, 65534u32));
        let socket_dir = dir.path().join("sock");
        let data = dir.path().join("data");
        std::fs::create_dir(&socket_dir).unwrap();
        let pwfile = dir.path().join("pw");
        std::fs::write(&pwfile, SUPERUSER_PASSWORD).unwrap();
        if let Some((uid, gid)) = as_user {
            for p in [dir.path(), &socket_dir, &pwfile] {
                std::os::unix::fs::chown(p, Some(uid), Some(gid)).unwrap();
            }
            std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        }
        let pg = Postgres {
            dir,
            data,
            socket_dir,
            as_user,
            durable,
            tls,
        };
        let pwfile_arg = pwfile.to_str().unwrap().to_string();
        let data_arg = pg.data.to_str().unwrap().to_string();
        let mut args = vec![
            "-D",
            &data_arg,
            "-U",
            SUPERUSER,
            "--pwfile",
            &pwfile_arg,
            "--auth",
            "scram-sha-256",
            "-E",
            "UTF8",
            "--locale",
            "C",
        ];
        if !durable {
            args.push("--no-sync");
        }
        pg.run("initdb", &args);
        pg.start_server();
        pg
    }

    fn command(&self, tool: &str) -> Command {
        let exe = bindir().join(tool);
        match self.as_user {
            Some((uid, gid)) => {
                let mut c = Command::new("setpriv");
                c.args([
                    &format!("--reuid={uid}"),
                    &format!("--regid={gid}"),
                    "--clear-groups",
                    "--",
                ])
                .arg(exe);
                c
            }
            None => Command::new(exe),
        }
    }

    fn run(&self, tool: &str, args: &[&str]) {
        let out = self
            .command(tool)
            .args(args)
            .current_dir(self.dir.path())
            .output()
            .unwrap_or_else(|e| panic!("cannot run {tool}: {e}"));
        assert!(
            out.status.success(),
            "{tool} failed: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Starts the server (after [`Postgres::stop`] too) and waits until it accepts connections.
    pub fn start_server(&self) {
        let durability = if self.durable {
            ""
        } else {
            " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        };
        // With TLS: loopback TCP on the chosen port (the unix socket's name follows the port),
        // TLS only there.
        let (port, network) = match &self.tls {
            None => (PORT, " -c listen_addresses=''".to_string()),
            Some(t) => (
                t.port,
                format!(
                    " -c listen_addresses=127.0.0.1 -c ssl=on -c ssl_cert_file={} -c ssl_key_file={}",
                    t.cert.display(),
                    t.key.display()
                ),
            ),
        };
        if self.tls.is_some() {
            // Only TLS over TCP: a plain TCP connection is refused by pg_hba.conf.
            let hba = self.data.join("pg_hba.conf");
            let text = std::fs::read_to_string(&hba).unwrap();
            let text: String = text
                .lines()
                .map(|l| {
                    if l.starts_with("host ") {
                        format!("hostssl{}\n", &l[4..])
                    } else {
                        format!("{l}\n")
                    }
                })
                .collect();
            std::fs::write(&hba, text).unwrap();
        }
        let options = format!(
            "-k {} -p {port} -c max_connections=300{network}{durability}",
            self.socket_dir.display()
        );
        let log = self.dir.path().join("server.log");
        self.run(
            "pg_ctl",
            &[
                "-D",
                self.data.to_str().unwrap(),
                "-l",
                log.to_str().unwrap(),
                "-o",
                &options,
                "-w",
                "-t",
                "60",
                "start",
            ],
        );
    }

    /// Stops the server (fast: connections are cut, as when a database goes away).
    pub fn stop(&self) {
        self.run(
            "pg_ctl",
            &[
                "-D",
                self.data.to_str().unwrap(),
                "-m",
                "fast",
                "-w",
                "stop",
            ],
        );
    }

    /// Freezes (SIGSTOP) or thaws (SIGCONT) the postmaster and every process under it: a
    /// database that stops answering without closing its connections, as behind a network
    /// partition.
    pub fn freeze(&self, frozen: bool) {
        let Some(postmaster) = self.pid() else {
            return;
        };
        let signal = if frozen {
            nix::sys::signal::Signal::SIGSTOP
        } else {
            nix::sys::signal::Signal::SIGCONT
        };
        let mut pids = vec![postmaster];
        for entry in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                .and_then(|p| p.parse::<i32>().ok());
            if ppid == Some(postmaster) {
                pids.push(pid);
            }
        }
        for pid in pids {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), signal);
        }
    }

    /// The postmaster's PID, while it runs.
    pub fn pid(&self) -> Option<i32> {
        let text = std::fs::read_to_string(self.data.join("postmaster.pid")).ok()?;
        text.lines().next()?.trim().parse().ok()
    }

    /// A libpq connection string for `user` on database `db`.
    pub fn conninfo(&self, user: &str, password: &str, db: &str) -> String {
        format!(
            "host={} port={} user={user} password={password} dbname={db} connect_timeout=5",
            self.socket_dir.display(),
            self.port()
        )
    }

    /// The port (TCP with TLS; else it only names the unix socket).
    pub fn port(&self) -> u16 {
        self.tls.as_ref().map_or(PORT, |t| t.port)
    }

    /// A libpq connection string over loopback TCP with TLS required (a TLS server only).
    pub fn conninfo_tls(&self, user: &str, password: &str, db: &str) -> String {
        format!(
            "host=127.0.0.1 port={} user={user} password={password} dbname={db} \
             sslmode=require connect_timeout=5",
            self.port()
        )
    }

    /// Writes a credentials file (mode 0600) for `user` and returns its path.
    pub fn credentials(&self, dir: &Path, user: &str, password: &str, db: &str) -> PathBuf {
        let p = dir.join(format!("{user}.conn"));
        std::fs::write(
            &p,
            format!(
                "# fleet credentials for tests\n{}\n",
                self.conninfo(user, password, db)
            ),
        )
        .unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        p
    }

    /// A client as `user`, its connection driven on the runtime.
    pub async fn client(&self, user: &str, password: &str, db: &str) -> tokio_postgres::Client {
        let (client, conn) =
            tokio_postgres::connect(&self.conninfo(user, password, db), tokio_postgres::NoTls)
                .await
                .unwrap_or_else(|e| panic!("connect as {user}: {e}"));
        tokio::spawn(async move {
            let _ = conn.await;
        });
        client
    }

    pub async fn superuser(&self, db: &str) -> tokio_postgres::Client {
        self.client(SUPERUSER, SUPERUSER_PASSWORD, db).await
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        // A frozen server would not stop.
        self.freeze(false);
        // By the server's own PID (pg_ctl reads it from the data directory); immediate: the
        // data is thrown away with the directory.
        if self.pid().is_some() {
            let _ = self
                .command("pg_ctl")
                .args([
                    "-D",
                    self.data.to_str().unwrap(),
                    "-m",
                    "immediate",
                    "-w",
                    "stop",
                ])
                .output();
        }
        // Nothing of it outlives the test: the postmaster's PID, if pg_ctl failed.
        if let Some(pid) = self.pid() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}
