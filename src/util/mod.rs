//! Small helpers every other module may use; they use nothing of the crate but each other.

pub(crate) mod hex;
pub(crate) mod hmac;
pub(crate) mod lock;
pub(crate) mod metrics;
pub(crate) mod secret;
