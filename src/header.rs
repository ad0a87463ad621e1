//! The names of the headers the layer reads and writes, as [`HeaderName`] constants (as the `http`
//! crate names the standard ones).

use http::HeaderName;

/// The request header that carries the client's key: `Idempotency-Key`. One to 255 visible ASCII
/// characters (spaces inside allowed, surrounding whitespace trimmed), or the same as a quoted
/// structured-field string (`"abc"`).
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The response header, `Idempotent-Replayed: true`, that marks a replay (Stripe's name; another
/// can be set with
/// [`replay_header`](crate::IdempotencyLayerBuilder::replay_header)).
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The response header, `Idempotency-Replay: omitted`, of a replay whose body was not recorded (it
/// was over the recording limit, had trailers, or its stream failed): status and headers are the
/// original's, the body is empty.
pub const IDEMPOTENCY_REPLAY: HeaderName = HeaderName::from_static("idempotency-replay");

/// The response header saying when the key's record expires, as an HTTP date
/// (`Idempotency-Expires: Sun, 06 Nov 1994 08:49:37 GMT`), on answers the layer recorded (fresh)
/// and on replays. Until then a retry with the key gets this answer again; from then on the key
/// is new and a request with it runs. Not sent on answers whose record was released (a retry runs
/// again). Turned off with
/// [`expiry_header(false)`](crate::IdempotencyLayerBuilder::expiry_header).
pub const IDEMPOTENCY_EXPIRES: HeaderName = HeaderName::from_static("idempotency-expires");
