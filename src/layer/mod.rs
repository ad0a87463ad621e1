//! The HTTP door: [`IdempotencyLayer`] and the service it builds. It reads what the engine needs
//! from a request (the key, the subject, the endpoint, the body and its fingerprint), hands the
//! claim to the engine, runs the handler under the lease the engine gives, records the answer as
//! it reaches the client, and turns the engine's other answers into replays and problem details.
//!
//! | file | what it does |
//! |---|---|
//! | `layer.rs` | [`IdempotencyLayer`] |
//! | `builder.rs`, `settings.rs` | the layer's settings and their checks |
//! | `service.rs`, `future.rs` | the tower service and its future (detached when the client leaves) |
//! | `admission.rs` | key, subject and admission, before anything is read |
//! | `run.rs` | one guarded request: body, fingerprint, claim, answer |
//! | `handler.rs` | the handler run under its lease |
//! | `recording/` | the answer recorded while it reaches the client (and in a handler's transaction) |
//! | `replay.rs`, `problem.rs` | a record back into a response; the layer's own error answers |
//! | `transaction.rs` | `IdempotencyTx`, the handler's transaction |
//! | `grpc.rs` | the gRPC mode (feature `grpc`): unary calls, their trailers, gRPC statuses |

mod admission;
mod body;
mod builder;
mod extract;
mod future;
#[cfg(feature = "grpc")]
#[cfg_attr(docsrs, doc(cfg(feature = "grpc")))]
pub mod grpc;
mod handler;
mod header_policy;
pub mod key;
mod label;
// The layer's own file, as tower-http names it (`limit/layer.rs`).
#[allow(clippy::module_inception)]
mod layer;
mod policy;
mod problem;
mod recording;
mod replay;
mod run;
mod service;
mod settings;
mod subject;
#[cfg(sql)]
mod transaction;

#[cfg(all(test, feature = "openapi"))]
pub(crate) use self::problem::ProblemTypes;
#[cfg(feature = "openapi")]
pub(crate) use self::{service::guards, settings::LayerSettings};

pub use self::builder::IdempotencyLayerBuilder;
pub use self::future::ResponseFuture;
pub use self::layer::IdempotencyLayer;
pub use self::policy::{Disposition, default_policy};
pub use self::problem::{ErrorKind, IdempotencyRejection, Problem};
pub use self::service::IdempotencyService;
pub use self::subject::{Subject, SubjectExtractor};
#[cfg(sql)]
#[cfg_attr(
    docsrs,
    doc(cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql")))
)]
pub use self::transaction::IdempotencyTx;
