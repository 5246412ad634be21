use std::fmt;

/// The configuration values a builder refused: every bad field, each with its reason.
///
/// Setters never fail: a builder validates everything it was given once, when it is
/// built (`build()`, `try_new` or a store's `connect`), and names each refused field.
///
/// ```
/// use retrysafe::ConfigError;
/// let e = ConfigError::new("lease", "must be greater than zero");
/// assert_eq!(e.to_string(), "invalid lease: must be greater than zero");
/// assert_eq!(e.field(), "lease");
///
/// let both = e.and(ConfigError::new("retention", "is too large"));
/// assert_eq!(both.fields().collect::<Vec<_>>(), ["lease", "retention"]);
/// assert_eq!(
///     both.to_string(),
///     "invalid lease: must be greater than zero; invalid retention: is too large"
/// );
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConfigError {
    field: &'static str,
    reason: &'static str,
    more: Vec<(&'static str, &'static str)>,
}

impl ConfigError {
    /// An error about `field`.
    #[doc(hidden)]
    pub fn new(field: &'static str, reason: &'static str) -> Self {
        ConfigError {
            field,
            reason,
            more: Vec::new(),
        }
    }

    /// This error and `other`'s fields after it.
    #[doc(hidden)]
    #[must_use]
    pub fn and(mut self, other: ConfigError) -> Self {
        self.more.push((other.field, other.reason));
        self.more.extend(other.more);
        self
    }

    /// The (first) refused setting.
    pub fn field(&self) -> &'static str {
        self.field
    }

    /// Why it was refused.
    pub fn reason(&self) -> &'static str {
        self.reason
    }

    /// Every refused setting, in the order they were checked.
    pub fn fields(&self) -> impl Iterator<Item = &'static str> + '_ {
        std::iter::once(self.field).chain(self.more.iter().map(|(f, _)| *f))
    }

    /// Every refused setting with its reason.
    pub fn errors(&self) -> impl Iterator<Item = (&'static str, &'static str)> + '_ {
        std::iter::once((self.field, self.reason)).chain(self.more.iter().copied())
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (field, reason)) in self.errors().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "invalid {field}: {reason}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigError {}

/// Collects the refusals of one `build()`, so that its error names every bad field.
///
/// ```
/// use std::time::Duration;
/// use retrysafe_core::__private::Validate;
///
/// let mut v = Validate::new();
/// v.check(Duration::ZERO > Duration::ZERO, "lease", "must be greater than zero");
/// v.check(true, "retention", "unused");
/// let e = v.finish(()).unwrap_err();
/// assert_eq!(e.fields().collect::<Vec<_>>(), ["lease"]);
/// ```
#[derive(Debug, Clone, Default)]
pub struct Validate {
    error: Option<ConfigError>,
}

impl Validate {
    /// Nothing refused yet.
    pub fn new() -> Self {
        Validate::default()
    }

    /// Refuses `field` for `reason` unless `ok`.
    pub fn check(&mut self, ok: bool, field: &'static str, reason: &'static str) {
        if !ok {
            self.refuse(ConfigError::new(field, reason));
        }
    }

    /// Refuses a timeout `field` that is zero or over 30 days
    /// ([`MAX_TIMEOUT`](crate::wire::MAX_TIMEOUT)): the range every layer accepts.
    pub fn timeout(&mut self, value: std::time::Duration, field: &'static str) {
        self.check(
            !value.is_zero() && value <= crate::wire::MAX_TIMEOUT,
            field,
            "must be greater than zero and at most 30 days",
        );
    }

    /// Keeps the value of a checked setting, or its refusal.
    pub fn take<T>(&mut self, checked: Result<T, ConfigError>) -> Option<T> {
        match checked {
            Ok(v) => Some(v),
            Err(e) => {
                self.refuse(e);
                None
            }
        }
    }

    /// Records a refusal.
    pub fn refuse(&mut self, error: ConfigError) {
        self.error = Some(match self.error.take() {
            None => error,
            Some(first) => first.and(error),
        });
    }

    /// Every refusal so far, if any.
    pub fn error(&self) -> Option<&ConfigError> {
        self.error.as_ref()
    }

    /// `value` when nothing was refused, otherwise every refusal.
    pub fn finish<T>(self, value: T) -> Result<T, ConfigError> {
        match self.error {
            None => Ok(value),
            Some(e) => Err(e),
        }
    }
}
