//! Giving up: the last response marked.

use std::time::Duration;

use retrysafe_core::budget::RetryBudget;
use retrysafe_core::strategy::GiveUp;
use retrysafe_core::{CallContext, Deadline};
use retrysafe_test_support::both_forms;
use retrysafe_test_support::forms::reqwest::budget_counts;

use super::{client, events, hooked, marked, middleware, s, serve, stack};

both_forms! {
    #[tokio::test]
    async fn giving_up_after_the_last_attempt_marks_the_last_response(form) {
        let (url, script) = serve(vec![(503, vec![("x-try", "last")])]).await;
        let (middleware, retries, give_ups) = hooked(middleware());
        let ctx = CallContext::new();
        let budget = RetryBudget::ratio();
        let client = stack(middleware).budget(budget.clone()).client(form);
        let response = ctx
            .clone()
            .scope(async { client.get(format!("{url}/items")).send().await })
            .await
            .unwrap();
        assert_eq!(response.status(), 503);
        assert!(marked(&response));
        assert_eq!(response.headers()["x-try"], "last");
        assert_eq!(response.text().await.unwrap(), "status 503");
        assert_eq!(script.seen().len(), 3);
        assert!(ctx.downstream_gave_up());
        assert_eq!(events(&retries).len(), 2);
        let give_ups = events(&give_ups);
        assert_eq!(give_ups.len(), 1);
        assert_eq!(give_ups[0].attempts, 3);
        assert_eq!(give_ups[0].reason, GiveUp::AttemptsExhausted);
        assert_eq!(
            give_ups[0].status,
            Some(http::StatusCode::SERVICE_UNAVAILABLE)
        );
        assert_eq!(budget_counts(&budget), (1, 2));
    }
}

both_forms! {
    #[tokio::test]
    async fn a_retry_after_longer_than_the_deadline_gives_up_without_a_second_attempt(form) {
        let (url, script) = serve(vec![(503, vec![("retry-after", "5")]), s(200)]).await;
        let (middleware, retries, give_ups) = hooked(middleware());
        let response = client(form, middleware)
            .get(format!("{url}/items"))
            .with_extension(Deadline::after(Duration::from_secs(2)))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 503);
        assert!(marked(&response));
        assert_eq!(script.seen().len(), 1);
        assert!(retries.lock().unwrap().is_empty());
        let give_ups = events(&give_ups);
        assert_eq!(give_ups[0].reason, GiveUp::NotEnoughTime);
        assert_eq!(give_ups[0].attempts, 1);
    }
}
