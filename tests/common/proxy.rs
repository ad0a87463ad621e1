//! A loopback TCP proxy that can cut or stall every connection through it, to inject faults between
//! a store and its server (PostgreSQL, Redis).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::AbortHandle;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Mode {
    /// Bytes flow both ways.
    Pass,
    /// Every connection is closed, new ones are refused: the server is unreachable.
    Cut,
    /// Connections stay open but no byte moves: the network is stalled.
    Stall,
}

/// A loopback TCP proxy in front of a server that can cut or stall every connection.
pub struct Proxy {
    pub addr: SocketAddr,
    mode: watch::Sender<Mode>,
    connections: Arc<Mutex<Vec<AbortHandle>>>,
    /// When set, the next client bytes that hold this pattern are never delivered, and nothing
    /// after them on that connection: a connection that dies quietly just before its commit.
    freeze_at: Arc<Mutex<Option<Vec<u8>>>>,
    /// When set, the next server bytes that hold this pattern are not delivered: the connection
    /// is closed towards the client instead.
    cut_reply: Arc<Mutex<Option<Vec<u8>>>>,
}

impl Proxy {
    /// Listens on a free loopback port and forwards every connection to `upstream`.
    pub async fn start(upstream: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (mode, _) = watch::channel(Mode::Pass);
        let connections: Arc<Mutex<Vec<AbortHandle>>> = Arc::default();
        let (tx, conns) = (mode.clone(), connections.clone());
        let freeze_at: Arc<Mutex<Option<Vec<u8>>>> = Arc::default();
        let freeze = freeze_at.clone();
        let cut_reply: Arc<Mutex<Option<Vec<u8>>>> = Arc::default();
        let cut = cut_reply.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if *tx.borrow() == Mode::Cut {
                    drop(client);
                    continue;
                }
                let Ok(server) = TcpStream::connect(upstream).await else {
                    continue;
                };
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                let up = tokio::spawn(pipe(cr, sw, tx.subscribe(), Some(freeze.clone()), None));
                let down = tokio::spawn(pipe(sr, cw, tx.subscribe(), None, Some(cut.clone())));
                let mut list = conns.lock().expect("lock");
                list.push(up.abort_handle());
                list.push(down.abort_handle());
            }
        });
        Proxy {
            addr,
            mode,
            connections,
            freeze_at,
            cut_reply,
        }
    }

    /// The next server answer that holds `pattern` is lost (once): the proxy closes the
    /// connection towards the client instead of delivering it. The server did the statement (and,
    /// in autocommit, committed it: its connection stays open until the client's side closes);
    /// the client sees its connection die.
    #[allow(dead_code)]
    pub fn cut_reply(&self, pattern: &[u8]) {
        *self.cut_reply.lock().expect("lock") = Some(pattern.to_vec());
    }

    /// The next connection that sends `COMMIT` freezes there (once): the commit never reaches the
    /// server, and the connection stays open with no byte moving (the server sees its session
    /// idle in its transaction, holding its locks).
    #[allow(dead_code)]
    pub fn freeze_at_commit(&self) {
        // PostgreSQL's simple query: the statement's text ends in NUL.
        self.freeze_at(b"COMMIT\0");
    }

    /// The next connection that sends `pattern` freezes there (once), as `freeze_at_commit` does.
    #[allow(dead_code)]
    pub fn freeze_at(&self, pattern: &[u8]) {
        *self.freeze_at.lock().expect("lock") = Some(pattern.to_vec());
    }

    /// The port clients connect to.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn set(&self, mode: Mode) {
        self.mode.send_replace(mode);
        if mode == Mode::Cut {
            for handle in self.connections.lock().expect("lock").drain(..) {
                handle.abort(); // dropping both halves closes the sockets
            }
        }
    }
}

/// Copies bytes one way, holding them while the proxy is stalled and stopping when it is cut.
async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut mode: watch::Receiver<Mode>,
    freeze_at: Option<Arc<Mutex<Option<Vec<u8>>>>>,
    cut_reply: Option<Arc<Mutex<Option<Vec<u8>>>>>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let found = |pattern: &Mutex<Option<Vec<u8>>>| {
            let mut pattern = pattern.lock().expect("lock");
            let found = pattern
                .as_deref()
                .is_some_and(|p| buf[..n].windows(p.len()).any(|w| w == p));
            if found {
                *pattern = None;
            }
            found
        };
        if freeze_at.as_deref().is_some_and(found) {
            // Hold the connection open, delivering nothing more, until the proxy is dropped.
            let _to = to;
            std::future::pending::<()>().await;
            return;
        }
        if cut_reply.as_deref().is_some_and(found) {
            // Not delivered: dropping this half closes the connection towards the client.
            return;
        }
        loop {
            let now = *mode.borrow_and_update();
            match now {
                Mode::Pass => break,
                Mode::Cut => return,
                Mode::Stall => {
                    if mode.changed().await.is_err() {
                        return;
                    }
                }
            }
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
