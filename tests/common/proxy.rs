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
}

impl Proxy {
    /// Listens on a free loopback port and forwards every connection to `upstream`.
    pub async fn start(upstream: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (mode, _) = watch::channel(Mode::Pass);
        let connections: Arc<Mutex<Vec<AbortHandle>>> = Arc::default();
        let (tx, conns) = (mode.clone(), connections.clone());
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
                let up = tokio::spawn(pipe(cr, sw, tx.subscribe()));
                let down = tokio::spawn(pipe(sr, cw, tx.subscribe()));
                let mut list = conns.lock().expect("lock");
                list.push(up.abort_handle());
                list.push(down.abort_handle());
            }
        });
        Proxy {
            addr,
            mode,
            connections,
        }
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
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
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
