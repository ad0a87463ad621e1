//! The server side: a current-thread runtime on a thread of its own (one core's worth, as a server
//! pinned to one core), and the kernel's accounting of every thread's time on the CPU
//! (`/proc/self/task/<tid>/schedstat`, nanoseconds), read before and after each run.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::Duration;

use axum::Router;
use tokio::runtime::Handle;

/// The load generator's threads (its runtime's workers and the main thread): what the CPU of the
/// rest of the process leaves out.
static LOAD_THREADS: Mutex<Vec<u32>> = Mutex::new(Vec::new());

/// Counts the calling thread as one of the load generator's.
pub(crate) fn mark_load_thread() {
    LOAD_THREADS
        .lock()
        .expect("load threads")
        .push(this_thread());
}

/// The kernel's id of the calling thread.
pub(crate) fn this_thread() -> u32 {
    std::fs::read_link("/proc/thread-self")
        .ok()
        .and_then(|p| p.file_name()?.to_str()?.parse().ok())
        .expect("this thread's id (Linux /proc)")
}

/// Time on the CPU of thread `tid` of this process, in nanoseconds (0 once it has exited).
fn thread_cpu(tid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat"))
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// Every thread of this process and its time on the CPU so far.
fn all_threads() -> HashMap<u32, u64> {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok())
        .map(|tid| (tid, thread_cpu(tid)))
        .collect()
}

/// The CPU time of the server thread and of every other thread that is not the load generator's
/// (the crate's lease keeper, a runtime's blocking pool), at one moment.
pub(crate) struct CpuSnapshot {
    server: u64,
    others: HashMap<u32, u64>,
}

/// CPU time used between two snapshots.
#[derive(Clone, Copy, Default)]
pub(crate) struct CpuUsed {
    /// On the server thread: every connection, handler and store task of the server.
    pub(crate) server: Duration,
    /// On the process's other threads, the load generator's left out.
    pub(crate) others: Duration,
}

/// A current-thread runtime on a thread of its own, and that thread's id.
pub(crate) struct ServerThread {
    pub(crate) handle: Handle,
    tid: u32,
}

impl ServerThread {
    pub(crate) fn start() -> ServerThread {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("server".into())
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("server runtime");
                tx.send((runtime.handle().clone(), this_thread()))
                    .expect("send");
                runtime.block_on(std::future::pending::<()>());
            })
            .expect("server thread");
        let (handle, tid) = rx.recv().expect("server thread started");
        ServerThread { handle, tid }
    }

    /// Serves `router` on the server thread, on a port of 127.0.0.1 of its own.
    pub(crate) async fn serve(&self, router: Router) -> SocketAddr {
        self.handle
            .spawn(async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                    .await
                    .expect("bind");
                let addr = listener.local_addr().expect("addr");
                tokio::spawn(async move { axum::serve(listener, router).await });
                addr
            })
            .await
            .expect("serve")
    }

    pub(crate) fn snapshot(&self) -> CpuSnapshot {
        let load = LOAD_THREADS.lock().expect("load threads").clone();
        let mut others = all_threads();
        others.remove(&self.tid);
        for tid in load {
            others.remove(&tid);
        }
        CpuSnapshot {
            server: thread_cpu(self.tid),
            others,
        }
    }

    /// CPU used since `before` (a thread started since counts from zero).
    pub(crate) fn used_since(&self, before: &CpuSnapshot) -> CpuUsed {
        let now = self.snapshot();
        let others: u64 = now
            .others
            .iter()
            .map(|(tid, ns)| ns.saturating_sub(before.others.get(tid).copied().unwrap_or(0)))
            .sum();
        CpuUsed {
            server: Duration::from_nanos(now.server - before.server),
            others: Duration::from_nanos(others),
        }
    }
}

/// The machine's CPU time by kind (`/proc/stat`, all cores, clock ticks) and this process's
/// (`/proc/self/stat`), to tell how busy the machine was around a run.
#[derive(Clone, Copy)]
pub(crate) struct MachineCpu {
    total: u64,
    idle: u64,
    steal: u64,
    process: u64,
}

impl MachineCpu {
    pub(crate) fn read() -> MachineCpu {
        let stat = std::fs::read_to_string("/proc/stat").expect("/proc/stat");
        let fields: Vec<u64> = stat
            .lines()
            .next()
            .expect("cpu line")
            .split_whitespace()
            .skip(1)
            .filter_map(|f| f.parse().ok())
            .collect();
        let own = std::fs::read_to_string("/proc/self/stat").expect("/proc/self/stat");
        // Past the command's closing parenthesis, from the state on: utime and stime are the 12th
        // and 13th fields.
        let after = &own[own.rfind(')').expect("stat") + 2..];
        let own: Vec<u64> = after
            .split_whitespace()
            .map(|f| f.parse().unwrap_or(0))
            .collect();
        MachineCpu {
            // user nice system idle iowait irq softirq steal (guest time is within user).
            total: fields.iter().take(8).sum(),
            idle: fields[3] + fields[4],
            steal: fields.get(7).copied().unwrap_or(0),
            process: own[11] + own[12],
        }
    }

    /// Shares of the machine's CPU since `before`: (busy, this process, stolen), in percent.
    pub(crate) fn since(&self, before: &MachineCpu) -> (f64, f64, f64) {
        let total = (self.total - before.total).max(1) as f64;
        let pct = |n: u64| 100.0 * n as f64 / total;
        (
            pct((self.total - before.total) - (self.idle - before.idle)),
            pct(self.process - before.process),
            pct(self.steal - before.steal),
        )
    }
}
