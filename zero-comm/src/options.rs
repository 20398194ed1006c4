//! Options shared by all backends.

use std::time::Duration;

use crate::{Error, Result};

/// Options of a communicator.
#[derive(Debug, Clone, PartialEq)]
pub struct CommOptions {
    /// How long a rank waits for its peers inside one collective before
    /// failing with [`Error::Timeout`]. Default: 5 minutes (environment:
    /// `ZERO_COMM_TIMEOUT`, in seconds). Long enough for a slow step on a
    /// loaded machine, short enough that a dead rank does not hold a job.
    pub timeout: Duration,
    /// Check, before each collective that goes through MPI's own collectives
    /// (between nodes), that all ranks called the same one with the same
    /// dtype, sizes and root; costs one small all-gather per collective.
    /// Within a node the check is always on and free. The NCCL backend
    /// honours it too: each launch (a collective or a group) first
    /// all-gathers a descriptor on the GPU and waits for it on the host, so
    /// mismatched collectives give `Error::Mismatch` instead of a timeout.
    /// Default: off (environment: `ZERO_COMM_VALIDATE=1`).
    pub validate: bool,
}

impl Default for CommOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(300),
            validate: false,
        }
    }
}

impl CommOptions {
    /// Defaults overridden by `ZERO_COMM_TIMEOUT` and `ZERO_COMM_VALIDATE`.
    pub fn from_env() -> Result<Self> {
        let mut o = Self::default();
        if let Ok(v) = std::env::var("ZERO_COMM_TIMEOUT") {
            let secs: f64 = v.trim().parse().map_err(|_| Error::Config {
                key: "ZERO_COMM_TIMEOUT".into(),
                msg: format!("`{v}` is not a number of seconds"),
            })?;
            if !(secs.is_finite() && secs > 0.0) {
                return Err(Error::Config {
                    key: "ZERO_COMM_TIMEOUT".into(),
                    msg: format!("must be a positive number of seconds, got `{v}`"),
                });
            }
            o.timeout = Duration::from_secs_f64(secs);
        }
        if let Ok(v) = std::env::var("ZERO_COMM_VALIDATE") {
            o.validate = match v.trim() {
                "1" | "true" | "on" | "yes" => true,
                "0" | "false" | "off" | "no" | "" => false,
                _ => {
                    return Err(Error::Config {
                        key: "ZERO_COMM_VALIDATE".into(),
                        msg: format!("expected 0 or 1, got `{v}`"),
                    })
                }
            };
        }
        Ok(o)
    }

    /// These options with another timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
}
