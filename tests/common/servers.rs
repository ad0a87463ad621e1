//! The servers the tests talk to: the one an environment variable names (`DATABASE_URL`,
//! `MYSQL_URL`, `REDIS_URL`, `REDIS_CLUSTER_URLS`); else the one on its usual local address, if it answers;
//! else a private one that this test process starts from the server binaries (its own data
//! directory under the temporary directory, free loopback ports) and that a watchdog stops, and
//! whose files it removes, as soon as this process ends, however it ends (a panic, an interrupt,
//! a kill): the watchdog runs in a session of its own and waits for this process to go away.
//!
//! A server that cannot be started (its binary is missing) is a test failure that says what to
//! install, never a test skipped as if it had passed.

#![allow(dead_code)]

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The PostgreSQL URL of the tests.
pub fn database_url() -> String {
    if let Ok(url) = std::env::var("DATABASE_URL") {
        return url;
    }
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(|| {
        if answers("127.0.0.1:5432") {
            "postgres://postgres@127.0.0.1:5432/test".to_owned()
        } else {
            private_postgres().url.clone()
        }
    })
    .clone()
}

/// The MySQL (or MariaDB) URL of the tests.
pub fn mysql_url() -> String {
    if let Ok(url) = std::env::var("MYSQL_URL") {
        return url;
    }
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(|| {
        if answers("127.0.0.1:3306") {
            "mysql://root@127.0.0.1:3306/test".to_owned()
        } else {
            private_mysql().url.clone()
        }
    })
    .clone()
}

/// The Redis URL of the tests.
pub fn redis_url() -> String {
    if let Ok(url) = std::env::var("REDIS_URL") {
        return url;
    }
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(|| {
        if answers("127.0.0.1:6379") {
            "redis://127.0.0.1:6379".to_owned()
        } else {
            private_redis()
        }
    })
    .clone()
}

/// The initial nodes of the tests' Redis Cluster.
pub fn cluster_urls() -> Vec<String> {
    if let Ok(urls) = std::env::var("REDIS_CLUSTER_URLS") {
        return urls.split(',').map(|u| u.trim().to_owned()).collect();
    }
    static URLS: OnceLock<Vec<String>> = OnceLock::new();
    URLS.get_or_init(|| {
        let defaults = ["127.0.0.1:7000", "127.0.0.1:7001", "127.0.0.1:7002"];
        if defaults.iter().all(|a| cluster_ok(a)) {
            defaults.iter().map(|a| format!("redis://{a}")).collect()
        } else {
            private_cluster()
        }
    })
    .clone()
}

/// A PostgreSQL server of this test process's own, for tests that restart it.
pub struct PrivatePostgres {
    pub url: String,
    data: PathBuf,
}

impl PrivatePostgres {
    /// Restarts the server (a fast shutdown, then a start on the same port and data).
    pub fn restart(&self) {
        let status = as_postgres(&pg_bin("pg_ctl"))
            .arg("-D")
            .arg(&self.data)
            .args(["-w", "-t", "60", "-m", "fast", "restart"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("run pg_ctl restart");
        assert!(status.success(), "restarting the private PostgreSQL failed");
    }
}

/// The process's private PostgreSQL, started on first use.
pub fn private_postgres() -> &'static PrivatePostgres {
    static SERVER: OnceLock<PrivatePostgres> = OnceLock::new();
    SERVER.get_or_init(start_postgres)
}

fn start_postgres() -> PrivatePostgres {
    let initdb = pg_bin("initdb");
    let pg_ctl = pg_bin("pg_ctl");
    let dir = scratch_dir("pg");
    let data = dir.join("data");
    // The watchdog first, so that nothing outlives this process even if a step below fails.
    watchdog(&format!(
        "{} -D '{}' -m immediate stop; rm -rf '{}'",
        as_postgres_prefix(&pg_ctl),
        data.display(),
        dir.display()
    ));
    if running_as_root() {
        // PostgreSQL refuses to run as root: its files belong to the `postgres` user.
        run(Command::new("chown").args(["postgres:postgres"]).arg(&dir));
    }
    run(as_postgres(&initdb).arg("-D").arg(&data).args([
        "-U",
        "postgres",
        "-A",
        "trust",
        "-E",
        "UTF8",
        "--no-sync",
    ]));
    let port = free_port();
    let options = format!(
        "-p {port} -k '{}' -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off \
         -c full_page_writes=off -c max_connections=300",
        dir.display()
    );
    run(as_postgres(&pg_ctl)
        .arg("-D")
        .arg(&data)
        .arg("-l")
        .arg(dir.join("log"))
        .args(["-w", "-t", "60", "-o", &options, "start"]));
    PrivatePostgres {
        url: format!("postgres://postgres@127.0.0.1:{port}/postgres"),
        data,
    }
}

/// A MariaDB (or MySQL) server of this test process's own, for tests that restart it.
pub struct PrivateMySql {
    pub url: String,
    /// The server binary and its arguments, to start it again.
    start: Vec<String>,
    pidfile: PathBuf,
    port: u16,
}

impl PrivateMySql {
    /// Restarts the server: stops it (a clean shutdown), leaves it down for `down`, then starts it
    /// on the same port and data.
    pub fn restart(&self, down: Duration) {
        stop(&self.pidfile, self.port, "MySQL", Duration::from_secs(60));
        std::thread::sleep(down);
        self.launch();
    }

    /// Starts the server in the background and waits until it takes connections.
    fn launch(&self) {
        // `setsid --fork`: the server is no child of this process (nothing to wait for, no zombie
        // once it stops), and the watchdog stops it by its pid file.
        let status = Command::new(binary("setsid", "setsid (Debian: util-linux)"))
            .arg("--fork")
            .args(&self.start)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("start the MySQL server");
        assert!(status.success(), "the MySQL server did not start");
        let started = Instant::now();
        while !answers(&format!("127.0.0.1:{}", self.port)) || !self.pidfile.exists() {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "the private MySQL on port {} did not start within 60 s",
                self.port
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// The process's private MariaDB (or MySQL), started on first use.
pub fn private_mysql() -> &'static PrivateMySql {
    static SERVER: OnceLock<PrivateMySql> = OnceLock::new();
    SERVER.get_or_init(start_mysql)
}

fn start_mysql() -> PrivateMySql {
    let install = "MariaDB's server (Debian: apt-get install mariadb-server), or set MYSQL_URL";
    let dir = scratch_dir("mysql");
    let data = dir.join("data");
    let pidfile = dir.join("server.pid");
    watchdog(&format!(
        "kill $(cat '{}' 2>/dev/null) 2>/dev/null; sleep 2; kill -9 $(cat '{}' 2>/dev/null) \
         2>/dev/null; rm -rf '{}'",
        pidfile.display(),
        pidfile.display(),
        dir.display()
    ));
    let user = if running_as_root() { "root" } else { "" };
    let mariadb = on_path("mariadbd").or_else(|| {
        let sbin = PathBuf::from("/usr/sbin/mariadbd");
        sbin.exists().then_some(sbin)
    });
    let server = match mariadb {
        Some(server) => {
            let mut init = Command::new(binary("mariadb-install-db", install));
            init.arg("--no-defaults")
                .arg(format!("--datadir={}", data.display()))
                .args(["--auth-root-authentication-method=normal", "--skip-test-db"]);
            if !user.is_empty() {
                init.arg(format!("--user={user}"));
            }
            run(&mut init);
            server
        }
        None => {
            // MySQL: `mysqld --initialize-insecure` makes a root without a password.
            let server = on_path("mysqld")
                .or_else(|| {
                    let sbin = PathBuf::from("/usr/sbin/mysqld");
                    sbin.exists().then_some(sbin)
                })
                .unwrap_or_else(|| {
                    panic!(
                        "no MySQL is reachable (set MYSQL_URL, or run one on 127.0.0.1:3306) and \
                         no server binary (mariadbd, mysqld) to start a private one is \
                         installed: install {install}"
                    )
                });
            let mut init = Command::new(&server);
            init.arg("--no-defaults")
                .arg("--initialize-insecure")
                .arg(format!("--datadir={}", data.display()));
            if !user.is_empty() {
                init.arg(format!("--user={user}"));
            }
            run(&mut init);
            server
        }
    };
    let port = free_port();
    let mut start = vec![
        server.display().to_string(),
        "--no-defaults".to_owned(),
        format!("--datadir={}", data.display()),
        format!("--port={port}"),
        "--bind-address=127.0.0.1".to_owned(),
        format!("--socket={}", dir.join("server.sock").display()),
        format!("--pid-file={}", pidfile.display()),
        format!("--log-error={}", dir.join("error.log").display()),
        "--skip-name-resolve".to_owned(),
        "--max-connections=400".to_owned(),
        "--innodb-flush-log-at-trx-commit=0".to_owned(),
    ];
    if !user.is_empty() {
        start.push(format!("--user={user}"));
    }
    let server = PrivateMySql {
        url: format!("mysql://root@127.0.0.1:{port}/test"),
        start,
        pidfile,
        port,
    };
    server.launch();
    // Root may connect over TCP from anywhere, without a password, and the tests' database exists.
    let socket = dir.join("server.sock");
    let client = on_path("mariadb")
        .or_else(|| on_path("mysql"))
        .unwrap_or_else(|| panic!("no mariadb or mysql client is installed: install {install}"));
    run(Command::new(client)
        .arg(format!("--socket={}", socket.display()))
        .args(["-uroot", "-e"])
        .arg(
            "CREATE USER IF NOT EXISTS 'root'@'%'; \
             GRANT ALL PRIVILEGES ON *.* TO 'root'@'%' WITH GRANT OPTION; \
             CREATE DATABASE IF NOT EXISTS test",
        ));
    server
}

fn private_redis() -> String {
    let dir = scratch_dir("redis");
    let port = free_port();
    redis_watchdog(&dir, &[port]);
    start_redis(&dir, port, &[]);
    format!("redis://127.0.0.1:{port}")
}

/// A Redis server of the caller's own that keeps its records across a restart (an append-only
/// file), for tests that restart it.
#[allow(dead_code)]
pub struct PersistentRedis {
    pub url: String,
    dir: PathBuf,
    port: u16,
}

#[allow(dead_code)]
impl PersistentRedis {
    /// Starts one (stopped, and its files removed, once this process ends).
    pub fn start() -> PersistentRedis {
        let dir = scratch_dir("redis-persistent");
        let port = free_port();
        redis_watchdog(&dir, &[port]);
        start_redis(&dir, port, &["--appendonly", "yes"]);
        PersistentRedis {
            url: format!("redis://127.0.0.1:{port}"),
            dir,
            port,
        }
    }

    /// Restarts the server: a clean shutdown (SIGTERM: its records written out), then a start on
    /// the same port and files.
    pub fn restart(&self) {
        let pidfile = self.dir.join(format!("redis-{}.pid", self.port));
        stop(&pidfile, self.port, "Redis", Duration::from_secs(30));
        start_redis(&self.dir, self.port, &["--appendonly", "yes"]);
    }
}

fn private_cluster() -> Vec<String> {
    let dir = scratch_dir("cluster");
    // A cluster node also listens on its port + 10000 (the cluster bus): both must be free, and
    // the port at most 55535.
    let ports: Vec<u16> = (0..3).map(|_| free_cluster_port()).collect();
    redis_watchdog(&dir, &ports);
    for &port in &ports {
        let conf = dir.join(format!("nodes-{port}.conf"));
        start_redis(
            &dir,
            port,
            &[
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                &conf.display().to_string(),
            ],
        );
    }
    let mut create = Command::new(binary(
        "redis-cli",
        "redis-tools (Debian: apt-get install redis-tools)",
    ));
    create.arg("--cluster").arg("create");
    for port in &ports {
        create.arg(format!("127.0.0.1:{port}"));
    }
    run(create.args(["--cluster-replicas", "0", "--cluster-yes"]));
    let started = Instant::now();
    while !ports.iter().all(|p| cluster_ok(&format!("127.0.0.1:{p}"))) {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the private Redis Cluster did not reach cluster_state:ok within 60 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    ports
        .iter()
        .map(|p| format!("redis://127.0.0.1:{p}"))
        .collect()
}

/// One watchdog for the Redis servers on `ports` with files in `dir`: it stops them all, then
/// removes the directory.
fn redis_watchdog(dir: &Path, ports: &[u16]) {
    let kills: String = ports
        .iter()
        .map(|port| {
            format!(
                "kill $(cat '{}' 2>/dev/null) 2>/dev/null; ",
                dir.join(format!("redis-{port}.pid")).display()
            )
        })
        .collect();
    watchdog(&format!("{kills}sleep 0.5; rm -rf '{}'", dir.display()));
}

/// Starts a redis-server on `port` with files in `dir` (stopped by the directory's watchdog).
fn start_redis(dir: &Path, port: u16, extra: &[&str]) {
    let server = binary(
        "redis-server",
        "the Redis server (Debian: apt-get install redis-server)",
    );
    let pidfile = dir.join(format!("redis-{port}.pid"));
    run(Command::new(server)
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no", "--daemonize", "yes"])
        .arg("--pidfile")
        .arg(&pidfile)
        .arg("--dir")
        .arg(dir)
        .arg("--logfile")
        .arg(dir.join(format!("redis-{port}.log")))
        .args(extra));
    let started = Instant::now();
    while !answers(&format!("127.0.0.1:{port}")) {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the private Redis on port {port} did not start within 30 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Stops the private `what` server whose pid is in `pidfile` with SIGTERM (a clean shutdown), and
/// waits until it no longer answers on `port` and has removed its pid file, at most `within`.
fn stop(pidfile: &Path, port: u16, what: &str, within: Duration) {
    let pid = std::fs::read_to_string(pidfile).expect("the server's pid file");
    run(Command::new("kill").arg(pid.trim()));
    let stopped = Instant::now();
    while answers(&format!("127.0.0.1:{port}")) || pidfile.exists() {
        assert!(
            stopped.elapsed() < within,
            "the private {what} did not stop within {within:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs `cleanup` (a shell command) once this process has ended, from a session of its own, so
/// that neither an interrupt of this process's group nor its death stops it first.
fn watchdog(cleanup: &str) {
    let script = format!(
        "while kill -0 {pid} 2>/dev/null; do sleep 0.5; done; {cleanup}",
        pid = std::process::id()
    );
    // `--fork`: setsid returns at once, the watchdog runs on without a parent to wait for it.
    let status = Command::new(binary("setsid", "setsid (Debian: util-linux)"))
        .args(["--fork", "sh", "-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("start the watchdog");
    assert!(status.success(), "the watchdog did not start");
}

fn answers(addr: &str) -> bool {
    addr.parse::<SocketAddr>()
        .ok()
        .and_then(|a| TcpStream::connect_timeout(&a, Duration::from_millis(300)).ok())
        .is_some()
}

fn cluster_ok(addr: &str) -> bool {
    if !answers(addr) {
        return false;
    }
    let (host, port) = addr.split_once(':').unwrap_or((addr, "6379"));
    Command::new("redis-cli")
        .args(["-h", host, "-p", port, "cluster", "info"])
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).contains("cluster_state:ok"))
}

/// A free port at most 55535 whose port + 10000 is free too.
fn free_cluster_port() -> u16 {
    for _ in 0..1000 {
        let port = free_port();
        if port <= 55535 && TcpListener::bind(("127.0.0.1", port + 10000)).is_ok() {
            return port;
        }
    }
    panic!("no free port pair for a Redis Cluster node");
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

fn scratch_dir(what: &str) -> PathBuf {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "axum-idempotency-{what}-{}-{}",
        std::process::id(),
        N.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    dir
}

fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).trim() == "0")
}

/// `program`, run as the `postgres` user when this process is root.
fn as_postgres(program: &Path) -> Command {
    if running_as_root() {
        let mut command = Command::new("runuser");
        command.args(["-u", "postgres", "--"]).arg(program);
        command
    } else {
        Command::new(program)
    }
}

fn as_postgres_prefix(program: &Path) -> String {
    if running_as_root() {
        format!("runuser -u postgres -- '{}'", program.display())
    } else {
        format!("'{}'", program.display())
    }
}

/// A PostgreSQL server binary: on the PATH, or in Debian's `/usr/lib/postgresql/<version>/bin`.
fn pg_bin(name: &str) -> PathBuf {
    if let Some(found) = on_path(name) {
        return found;
    }
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("bin").join(name))
        .filter(|p| p.exists())
        .collect();
    versions.sort();
    versions.pop().unwrap_or_else(|| {
        panic!(
            "no PostgreSQL is reachable (set DATABASE_URL, or run one on 127.0.0.1:5432) and the \
             server binary {name} to start a private one is not installed: install PostgreSQL's \
             server (Debian: apt-get install postgresql)"
        )
    })
}

fn binary(name: &str, install: &str) -> PathBuf {
    on_path(name).unwrap_or_else(|| {
        panic!("{name} is needed to start a private test server and is not installed: install {install}")
    })
}

fn on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(name))
            .find(|p| p.is_file())
    })
}

fn run(command: &mut Command) {
    let output = command
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("could not run {command:?}: {e}"));
    assert!(
        output.status.success(),
        "{command:?} failed: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}
