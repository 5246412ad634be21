use std::fmt;

/// A configuration value that a builder refused.
///
/// Builders validate what they are given and return this error instead of panicking.
///
/// ```
/// use retrysafe_core::ConfigError;
/// let e = ConfigError::new("lease", "must be greater than zero");
/// assert_eq!(e.to_string(), "invalid lease: must be greater than zero");
/// assert_eq!(e.field(), "lease");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConfigError {
    field: &'static str,
    reason: &'static str,
}

impl ConfigError {
    /// An error about `field`.
    pub fn new(field: &'static str, reason: &'static str) -> Self {
        ConfigError { field, reason }
    }

    /// The refused setting.
    pub fn field(&self) -> &'static str {
        self.field
    }

    /// Why it was refused.
    pub fn reason(&self) -> &'static str {
        self.reason
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid {}: {}", self.field, self.reason)
    }
}

impl std::error::Error for ConfigError {}
