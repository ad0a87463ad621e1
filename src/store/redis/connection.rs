//! The connection the scripts run on: one server, or a cluster.

use redis::aio::ConnectionManager;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, RedisFuture, Value};

/// How to open another connection to the same server or cluster, with the same settings.
#[derive(Clone)]
pub(super) enum Reconnect {
    Single(redis::Client, redis::aio::ConnectionManagerConfig),
    Cluster(redis::cluster::ClusterClient),
}

/// The connection the scripts run on: one server through a connection manager (re-connects after
/// failures), or a cluster connection (routes each command by its key, follows `MOVED`/`ASK`,
/// refreshes the slot map and re-connects nodes). Both are cheap handles to shared connections.
#[derive(Clone)]
pub(super) enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl redis::aio::ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Connection::Single(c) => c.req_packed_command(cmd),
            Connection::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Connection::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Connection::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Connection::Single(c) => c.get_db(),
            Connection::Cluster(c) => c.get_db(),
        }
    }
}
