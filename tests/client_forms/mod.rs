//! The two forms of the standard client stack that the client tests run on alike, so
//! that they cannot drift: the separate layers stacked by hand, and `ClientLayers`.

/// Which form of the stack a test builds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    /// `DeadlineLayer` → `RetryLayer` → `RetryBudgetLayer` → `CircuitBreakerLayer`.
    Separate,
    /// `ClientLayers`, one fused service.
    Fused,
}

/// Runs the test body `async fn $name(form: Form)` once per form, as the tests
/// `$name::separate` and `$name::fused` (extra `#[tokio::test]` arguments after it).
#[macro_export]
macro_rules! both_forms {
    ($name:ident $(, $($arg:tt)*)?) => {
        mod $name {
            #[tokio::test$(($($arg)*))?]
            async fn separate() {
                super::$name($crate::client_forms::Form::Separate).await;
            }

            #[tokio::test$(($($arg)*))?]
            async fn fused() {
                super::$name($crate::client_forms::Form::Fused).await;
            }
        }
    };
}
